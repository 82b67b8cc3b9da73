"""Edge behaviour of the rendered Envoy: API keys, per-route clients, rate limits."""

from __future__ import annotations

import json
from pathlib import Path

from confgen.runtime import free_port
from tests.support.backends import backends
from tests.support.envoy import request, running_envoy, wait_until

TOPOLOGY = """
version: 1
name: edge
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
auth:
  api_keys:
    - {{client: alice, env: KEY_ALICE}}
    - {{client: bob, env: KEY_BOB, rate_limit: {{requests: 2, per: 1m}}}}
pools:
  - name: open
    engine: vllm
    models: [open-model]
    health: {{enabled: false}}
    workers: ["127.0.0.1:{a}"]
  - name: private
    engine: vllm
    models: [private-model]
    allow_clients: [alice]
    health: {{enabled: false}}
    workers: ["127.0.0.1:{b}"]
"""
SECRETS = {"alice": "sk-alice-123", "bob": "sk-bob-456"}


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_api_keys_clients_and_per_key_limits(tmp_path: Path) -> None:
    """No key or a wrong key is 401; a client not allowed on a pool is 403; the key never
    reaches a worker; a forged client header is overwritten; a client's own bucket
    answers 429 with the OpenAI-style JSON body and retry-after."""
    port = free_port()
    with backends("a", "b") as (a, b):
        text = TOPOLOGY.format(admin=free_port(), port=port, a=a.port, b=b.port)
        with running_envoy(text, tmp_path / "out", secrets=SECRETS):
            url = f"http://127.0.0.1:{port}/v1/completions"
            assert wait_until(lambda: request(url, {"model": "open-model"}, _auth(SECRETS["alice"]))[0] == 200)

            status, _, body = request(url, {"model": "open-model"})
            assert status == 401
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
            assert request(url, {"model": "open-model"}, _auth("sk-wrong"))[0] == 401

            status, _, body = request(url, {"model": "private-model"}, _auth(SECRETS["bob"]))
            assert status == 403, body
            assert json.loads(body)["error"]["code"] == "permission_denied"
            assert b.requests == []
            status, headers, _ = request(url, {"model": "private-model"}, _auth(SECRETS["alice"]))
            assert (status, headers["x-backend"]) == (200, "b")

            forged = {**_auth(SECRETS["alice"]), "x-confgen-client": "bob"}
            assert request(url, {"model": "open-model"}, forged)[0] == 200
            seen = a.requests[-1]["headers"]
            lowered = {k.lower(): v for k, v in seen.items()}
            assert lowered["x-confgen-client"] == "alice"
            assert "authorization" not in lowered
            assert all("sk-" not in v for v in lowered.values())

            # bob has already used one token (the 403 above is checked after the limit).
            answers = [request(url, {"model": "open-model"}, _auth(SECRETS["bob"])) for _ in range(3)]
            limited = [(s, h, bd) for s, h, bd in answers if s == 429]
            assert limited, [s for s, _, _ in answers]
            status, headers, body = limited[0]
            assert headers["content-type"].startswith("application/json")
            assert int(headers["retry-after"]) >= 1
            assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
            # alice has no bucket of her own and is not limited by bob's.
            assert request(url, {"model": "open-model"}, _auth(SECRETS["alice"]))[0] == 200
