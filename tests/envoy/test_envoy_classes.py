"""Traffic classes under overload: critical traffic (a route's `class`, or an API-key client's)
rides Envoy's HIGH-priority circuit breaker, which the sidecar never lowers; standard and
sheddable traffic use DEFAULT, the one the sidecar's shedding limit sets. Checked on the
real Envoy by setting DEFAULT's limit to 0 through the runtime layer, as the sidecar does."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from confgen import envoy, parse_topology
from confgen.nginx import unsupported
from confgen.runtime import free_port
from tests.support.backends import backends
from tests.support.envoy import request, running_envoy, wait_until

TOPOLOGY = """
version: 1
name: classes
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
auth:
  api_keys:
    - {{client: ops, env: KEY_OPS, class: critical}}
    - {{client: batch, env: KEY_BATCH, class: sheddable}}
routes:
  - {{name: urgent, pool: chat, class: critical, match: {{headers: [{{name: x-tier, exact: urgent}}]}}}}
pools:
  - name: chat
    engine: vllm
    models: [chat-model]
    health: {{enabled: false}}
    workers: ["127.0.0.1:{a}"]
"""
SECRETS = {"ops": "sk-ops-123", "batch": "sk-batch-456"}


def _auth(client: str) -> dict[str, str]:
    return {"authorization": f"Bearer {SECRETS[client]}"}


def test_render_gives_critical_traffic_the_high_priority_breaker() -> None:
    """The critical route and a copy of every other route for the critical clients carry
    priority HIGH; the pool has a HIGH threshold at the safety cap beside DEFAULT, both
    tracking what remains; nginx is told it honours no class."""
    topo, _ = parse_topology(TOPOLOGY.format(admin=1, port=2, a=3).encode(), "classes.yaml")
    files = envoy.render(topo, config_dir="/etc/confgen", secrets=SECRETS)
    lds = json.loads(files["lds.json"])
    hcm = lds["resources"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    priority = {r["name"]: r["route"].get("priority", "DEFAULT") for r in routes if "route" in r}
    assert priority["urgent"] == "HIGH"
    assert "urgent/critical" not in priority  # critical already
    assert priority["model/chat-model/critical"] == "HIGH" and priority["model/chat-model"] == "DEFAULT"
    copy = next(r for r in routes if r["name"] == "model/chat-model/critical")
    assert {"name": "x-confgen-client", "string_match": {"safe_regex": {"regex": "^(ops)$"}}} in \
        copy["match"]["headers"]
    cds = json.loads(files["cds.json"])
    chat = next(c for c in cds["resources"] if c["name"] == "chat")
    thresholds = {t["priority"]: t for t in chat["circuit_breakers"]["thresholds"]}
    assert thresholds["HIGH"]["max_requests"] == thresholds["DEFAULT"]["max_requests"]
    assert thresholds["HIGH"]["track_remaining"] and thresholds["DEFAULT"]["track_remaining"]
    assert {path for path, _ in unsupported(topo)} >= {"routes[0].class", "auth.api_keys[0].class",
                                                       "auth.api_keys[1].class"}


def test_with_default_shut_critical_traffic_still_passes_on_the_real_envoy(tmp_path: Path) -> None:
    """DEFAULT's max_requests at 0 (what the sidecar's limit does at its extreme): the
    sheddable client gets 429 `overloaded` at once; the critical client and the critical
    route are served; a forged client header does not make a request critical."""
    port, admin = free_port(), free_port()
    with backends("a") as (a,):
        text = TOPOLOGY.format(admin=admin, port=port, a=a.port)
        with running_envoy(text, tmp_path / "out", secrets=SECRETS) as proc:
            url = f"http://127.0.0.1:{port}/v1/completions"
            body = {"model": "chat-model"}
            assert wait_until(lambda: request(url, body, _auth("batch"))[0] == 200)
            keys = "&".join(f"circuit_breakers.chat.default.{k}=0" for k in ("max_requests", "max_pending_requests"))
            with urllib.request.urlopen(urllib.request.Request(f"{proc.admin_url}/runtime_modify?{keys}",
                                                               method="POST"), timeout=10) as answer:
                assert answer.status == 200
            status, headers, answer_body = request(url, body, _auth("batch"))
            assert status == 429, answer_body
            assert json.loads(answer_body)["error"]["code"] == "overloaded" and headers["retry-after"]
            assert request(url, body, _auth("ops"))[0] == 200
            assert request(url, body, {**_auth("batch"), "x-tier": "urgent"})[0] == 200
            assert request(url, body, {**_auth("batch"), "x-confgen-client": "ops"})[0] == 429
