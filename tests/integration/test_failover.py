"""Failures through the real Envoy: a worker killed under load, a pool with no healthy
worker handing over to its fallback pool, and the canned last answer."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from confgen import envoy
from confgen.output import atomic_write
from confgen.simulate import FleetSpec, WorkerHandle, WorkerSpec
from tests.integration._stack import Answer, Stack, by_worker, stack
from tests.support.envoy import wait_until

CRASH_TOPOLOGY = """
version: 1
name: crash
admin: {address: 127.0.0.1, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
pools:
  - name: chat
    engine: vllm
    models: [chat]
    balancing: {policy: round_robin}
    health: {interval: 500ms, timeout: 250ms, unhealthy_threshold: 2, no_traffic_interval: 500ms}
    outlier_detection: {consecutive_gateway_failure: 2, interval: 500ms, base_ejection_time: 30s}
    # Every request in flight on the crashed worker retries at once; the default floor
    # (3 concurrent retries) overflowed now and then at 8 clients (429 `overloaded`).
    retries: {min_concurrency: 8}
    workers: ["$w_a", "$w_b", "$w_c"]
"""


def test_killing_a_worker_under_load_fails_no_request_and_stops_its_traffic(tmp_path: Path) -> None:
    """A worker crashed mid-way through steady concurrent load costs zero failed
    non-streaming requests (its in-flight requests and new picks are retried on other
    workers), Envoy marks it unhealthy/ejected, and after that no attempt goes to it."""
    spec = FleetSpec(
        workers=tuple(WorkerSpec(name=n, models=("chat",), decode_ms=20.0) for n in ("a", "b", "c")), seed=11
    )
    with stack(CRASH_TOPOLOGY, spec, tmp_path / "out") as s:
        s.wait_served({"model": "chat", "prompt": "warm", "max_tokens": 1})
        victim = s.worker("b")
        victim_host = f"127.0.0.1:{victim.port}"
        crashed_at: list[float] = []
        cut: list[int] = []  # 1: b was seen generating right before it crashed

        def crash_soon() -> None:
            # Wait until the victim is mid-generation, so the crash cuts requests in flight.
            busy = wait_until(lambda: victim.stats()["running"] > 0, timeout=5, interval=0.01)
            in_flight = victim.stats()["in_flight"]
            victim.crash()
            crashed_at.append(time.monotonic())
            cut.append(1 if busy else 0)  # running > 0 seen just before the crash (in_flight, read after, may be 0)
            print(f"crashed b with {in_flight} requests in flight")

        start = time.monotonic()
        killer = threading.Timer(1.0, crash_soon)
        killer.start()
        answers = s.load({"model": "chat", "prompt": "steady", "max_tokens": 8},
                         count=240, concurrency=8, max_seconds=5)  # fmt: skip
        killer.join(timeout=10)
        assert crashed_at, "the crash never happened"
        assert cut and cut[0] > 0, "b was not mid-generation when it crashed: the test did not cut a request"
        crash_t = crashed_at[0] - start
        failed = [(t, a.status, a.body[:200]) for t, a in answers if a.status != 200]
        print(f"{len(answers)} requests, {len(failed)} failed, by worker {dict(by_worker(answers))}, "
              f"retries {s.stat('cluster.chat.upstream_rq_retry')}, "
              f"retry overflow {s.stat('cluster.chat.upstream_rq_retry_overflow')}")  # fmt: skip
        assert failed == []
        assert len(answers) >= 60
        assert any(t > crash_t + 1.0 for t, _ in answers), "load did not continue after the crash"
        # Nothing came from b once its in-flight requests were gone.
        assert all(a.worker != "b" for t, a in answers if t > crash_t + 0.2)
        assert s.stat("cluster.chat.upstream_rq_retry") >= 1

        # Envoy knows: the host is ejected by outlier detection or failed its health checks.
        flags = s.host_flags("chat")
        assert flags[victim_host] != "healthy", flags
        assert all(f == "healthy" for h, f in flags.items() if h != victim_host), flags
        # ...and stops trying it: no connection attempts to it under more load.
        tried_before = _victim_attempts(s, victim_host)
        more = s.load({"model": "chat", "prompt": "after", "max_tokens": 4}, count=30, concurrency=4, max_seconds=5)
        assert [a.status for _, a in more] == [200] * 30
        assert _victim_attempts(s, victim_host) == tried_before
        assert victim.stats()["up"] is False


def _victim_attempts(s: Stack, host: str) -> int:
    """Connection attempts (incl. failed connects) Envoy made to one host, from /clusters."""
    total = 0
    for line in s.envoy.clusters_text().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "chat" and parts[1] == host and parts[2] in ("cx_total", "cx_connect_fail"):
            total += int(parts[3])
    return total


FALLBACK_TOPOLOGY = """
version: 1
name: fallback
admin: {address: 127.0.0.1, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
pools:
  - name: primary
    engine: vllm
    models: [chat]
    health: {interval: 300ms, timeout: 200ms, unhealthy_threshold: 1, healthy_threshold: 1, no_traffic_interval: 300ms}
    workers: ["$w_p0", "$w_p1"]
    fallback: backup
  - name: backup
    engine: vllm
    models: [chat-small]
    aliases: [chat]
    health: {interval: 300ms, timeout: 200ms, unhealthy_threshold: 1, healthy_threshold: 1, no_traffic_interval: 300ms}
    workers: ["$w_f0"]
last_resort: $last_resort
"""
CANNED = {
    "error": '{kind: error, status: 503, message: "Everything is down, retry shortly."}',
    "completion": '{kind: completion, status: 200, message: "Sorry, no model can answer right now."}',
}


def _fallback_fleet() -> FleetSpec:
    return FleetSpec(
        workers=(
            WorkerSpec(name="p0", models=("chat",), decode_ms=2.0),
            WorkerSpec(name="p1", models=("chat",), decode_ms=2.0),
            WorkerSpec(name="f0", models=("chat-small", "chat"), decode_ms=2.0),
        ),
        seed=2,
    )


def _check_canned(kind: str, answer: Answer) -> None:
    assert answer.worker == ""
    assert answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    if kind == "error":
        assert answer.status == 503
        assert body["error"]["code"] == "no_capacity"
        assert body["error"]["message"] == "Everything is down, retry shortly."
    else:
        assert answer.status == 200
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == "Sorry, no model can answer right now."


def test_fallback_pool_takes_over_then_canned_answer_when_workers_crash(tmp_path: Path) -> None:
    """Every worker of the primary pool crashes: not one request fails, they all go to the
    fallback pool (by retry until the active health checks notice, then directly); once
    the fallback is down too, Envoy answers the canned last-resort error (503, JSON)."""
    text = FALLBACK_TOPOLOGY.replace("$last_resort", CANNED["error"])
    with stack(text, _fallback_fleet(), tmp_path / "out") as s:
        chat = {"model": "chat", "prompt": "hello", "max_tokens": 2}
        s.wait_served(chat)
        assert {s.post(chat).worker for _ in range(10)} == {"p0", "p1"}

        s.worker("p0").crash()
        s.worker("p1").crash()
        # From the crash on, no request fails: before the health checks notice, a retry
        # moves on to the fallback pool; after, the fallback gets them first hand.
        after = [s.post(chat) for _ in range(30)]
        assert [(a.status, a.worker) for a in after] == [(200, "f0")] * 30, [(a.status, a.worker) for a in after]
        assert wait_until(lambda: all("failed_active_hc" in f for f in s.host_flags("primary").values()), timeout=5)
        assert [(a.status, a.worker) for a in (s.post(chat) for _ in range(5))] == [(200, "f0")] * 5

        s.worker("f0").crash()
        t0 = time.monotonic()

        def canned() -> bool:
            answer = s.post(chat)
            return answer.status == 503 and b"no_capacity" in answer.body

        assert wait_until(canned, timeout=10)
        print(f"canned answer {time.monotonic() - t0:.2f}s after the last worker crashed")
        for _ in range(5):
            _check_canned("error", s.post(chat))


@pytest.mark.parametrize("kind", ["error", "completion"])
def test_fallback_and_canned_answer_follow_eds_health(tmp_path: Path, kind: str) -> None:
    """The sidecar's path: marking the primary pool's endpoints UNHEALTHY in its EDS file
    moves traffic to the fallback pool; marking the fallback's too makes Envoy answer the
    canned last resort (kind error: 503 error object; kind completion: a 200 chat
    completion). Healthy again: the primary serves again."""
    text = FALLBACK_TOPOLOGY.replace("$last_resort", CANNED[kind])
    with stack(text, _fallback_fleet(), tmp_path / "out") as s:
        chat = {"model": "chat", "prompt": "hello", "max_tokens": 2}
        s.wait_served(chat, by={"p0", "p1"})
        primary = [s.worker("p0"), s.worker("p1")]
        backup = [s.worker("f0")]

        def publish(pool: str, workers: list[WorkerHandle], health: envoy.eds.HealthStatus) -> None:
            eps = [envoy.Endpoint("127.0.0.1", w.port, health=health, worker=f"127.0.0.1:{w.port}") for w in workers]
            atomic_write(s.out / envoy.layout.eds_path(pool), envoy.render_eds(pool, eps))

        publish("primary", primary, "UNHEALTHY")
        s.wait_served(chat, by={"f0"}, timeout=5)
        assert {s.post(chat).worker for _ in range(10)} == {"f0"}

        publish("backup", backup, "UNHEALTHY")

        def canned() -> bool:
            answer = s.post(chat)
            return answer.worker == "" and answer.headers.get("content-type", "").startswith("application/json")

        assert wait_until(canned, timeout=5)
        answer = s.post(chat)
        _check_canned(kind, answer)
        assert json.loads(answer.body)  # a whole JSON document, not a cut one

        publish("primary", primary, "HEALTHY")
        s.wait_served(chat, by={"p0", "p1"}, timeout=5)
