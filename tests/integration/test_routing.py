"""Routing through the real Envoy: by the body's `model`, by a header, the 404 for an
unknown model, and client-sent Envoy controls that must not steer anything."""

from __future__ import annotations

from pathlib import Path

from confgen.simulate import FleetSpec, WorkerSpec
from tests.integration._stack import stack

TOPOLOGY = """
version: 1
name: routing
admin: {address: 127.0.0.1, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
routes:
  - {name: tier-small, pool: small, match: {headers: [{name: x-tier, exact: small}], models: [chat]}}
  - {name: chat-big, pool: big, match: {models: [chat]}}
pools:
  - name: big
    engine: vllm
    models: [chat, big-only]
    health: {enabled: false}
    outlier_detection: {enabled: false}
    workers: ["$w_big"]
  - name: small
    engine: vllm
    models: [chat, small-only]
    health: {enabled: false}
    outlier_detection: {enabled: false}
    workers: ["$w_small"]
"""


def _fleet() -> FleetSpec:
    return FleetSpec(
        workers=(
            WorkerSpec(name="big", models=("chat", "big-only"), decode_ms=30.0),
            WorkerSpec(name="small", models=("chat", "small-only"), decode_ms=30.0),
        ),
        seed=4,
    )


def test_body_model_and_header_routes_reach_the_right_pool(tmp_path: Path) -> None:
    """The body's `model` picks the pool; a route on header x-tier: small sends the shared
    model `chat` to the small pool (without the header it goes to big); an unknown model
    is a 404 JSON error naming it, answered without touching a worker."""
    with stack(TOPOLOGY, _fleet(), tmp_path / "out") as s:
        s.wait_served({"model": "chat", "prompt": "warm", "max_tokens": 1})
        cases = [
            ({"model": "big-only"}, {}, "big"),
            ({"model": "small-only"}, {}, "small"),
            ({"model": "chat"}, {}, "big"),
            ({"model": "chat"}, {"x-tier": "small"}, "small"),
            ({"model": "chat"}, {"x-tier": "large"}, "big"),
            ({"model": "big-only"}, {"x-tier": "small"}, "big"),
        ]
        for body, headers, pool in cases:
            for _ in range(3):
                answer = s.post({**body, "prompt": "where", "max_tokens": 1}, headers)
                assert (answer.status, answer.worker) == (200, pool), (body, headers)
        received = {n: s.worker(n).stats()["inference_received"] for n in ("big", "small")}
        answer = s.post({"model": "no-such-model", "prompt": "x", "max_tokens": 1}, {"x-tier": "small"})
        assert answer.status == 404
        assert answer.headers["content-type"].startswith("application/json")
        error = answer.json()["error"]
        assert error["code"] == "model_not_found"
        assert "no-such-model" in error["message"]
        assert {n: s.worker(n).stats()["inference_received"] for n in ("big", "small")} == received


def test_client_sent_envoy_controls_are_ignored(tmp_path: Path) -> None:
    """x-envoy-* request controls from a client change nothing: a 1 ms upstream timeout
    does not cut a 0.3 s generation, a retry-on-5xx request does not turn a worker's 500
    into a retried 200, and none of these headers reaches the worker."""
    with stack(TOPOLOGY, _fleet(), tmp_path / "out") as s:
        s.wait_served({"model": "big-only", "prompt": "warm", "max_tokens": 1})
        slow = {"model": "big-only", "prompt": "take your time", "max_tokens": 10}
        controls = {"x-envoy-upstream-rq-timeout-ms": "1", "x-envoy-upstream-rq-per-try-timeout-ms": "1"}
        answer = s.post(slow, controls)
        assert (answer.status, answer.worker) == (200, "big"), answer.body

        s.worker("big").set_fault("error_burst", count=1, status=500)
        retry = {"x-envoy-retry-on": "5xx", "x-envoy-max-retries": "3"}
        answer = s.post({"model": "big-only", "prompt": "fail once", "max_tokens": 1}, retry)
        assert answer.status == 500, "a client-sent x-envoy-retry-on was obeyed"
        assert s.worker("big").stats()["inference_received"] == 3  # warm-up, slow, the failure
        assert s.stat("cluster.big.upstream_rq_retry") == 0

        s.post({"model": "big-only", "prompt": "seen", "max_tokens": 1}, {**controls, **retry})
        seen = {k.lower() for k in s.worker("big").stats()["last_inference_headers"]}
        # (Envoy adds x-envoy-external-address itself; the client's controls must be gone.)
        assert not seen & {*controls, *retry}, seen
