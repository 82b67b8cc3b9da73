"""Load shedding through the real Envoy: overload and the global rate limit both answer
429 with an OpenAI-style JSON error and retry-after."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from confgen.simulate import FleetSpec, WorkerSpec
from tests.integration._stack import Answer, stack

OVERLOAD_TOPOLOGY = """
version: 1
name: overload
admin: {address: 127.0.0.1, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
backpressure: {safety_cap: 1.0, retry_after: 3s}
pools:
  - name: tiny
    engine: vllm
    models: [tiny]
    capacity: 2
    health: {enabled: false}
    workers: ["$w_a", "$w_b"]
"""


def _check_429(answer: Answer, code: str, retry_after: str) -> None:
    assert answer.status == 429
    assert answer.worker == ""
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.headers["retry-after"] == retry_after
    error = answer.json()["error"]
    assert error["code"] == code
    assert error["message"]


def test_overload_sheds_with_429_json_and_retry_after(tmp_path: Path) -> None:
    """A pool at its safety cap (2 workers x capacity 2 x safety_cap 1.0 = 4 in flight, as
    many pending) answers the excess of 10 concurrent requests at once with 429, code
    `overloaded`, retry-after from backpressure.retry_after; the shed requests never reach
    a worker."""
    spec = FleetSpec(workers=tuple(WorkerSpec(name=n, models=("tiny",), decode_ms=40.0) for n in ("a", "b")), seed=1)
    with stack(OVERLOAD_TOPOLOGY, spec, tmp_path / "out") as s:
        s.wait_served({"model": "tiny", "prompt": "warm", "max_tokens": 1})
        # 10 tokens at 40 ms: each admitted request holds its slot for ~0.4 s.
        answers = s.load({"model": "tiny", "prompt": "slow", "max_tokens": 10},
                         count=10, concurrency=10, max_seconds=10)  # fmt: skip
        statuses = sorted(a.status for _, a in answers)
        print(f"overload: {statuses}")
        assert set(statuses) == {200, 429}, statuses
        assert 4 <= statuses.count(200) <= 8
        for _, answer in answers:
            if answer.status == 429:
                _check_429(answer, "overloaded", "3")
        # Shed by the circuit breaker: the pending queue or the in-flight limit overflowed.
        overflows = sum(s.stat(f"cluster.tiny.upstream_rq_{kind}_overflow") for kind in ("pending", "active"))
        assert overflows == statuses.count(429)
        served = sum(s.worker(n).stats()["inference_received"] for n in ("a", "b"))
        assert served == 1 + statuses.count(200)  # the warm-up, then only the admitted ones


NORMAL_TOPOLOGY = """
version: 1
name: normal
admin: {address: 127.0.0.1, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
pools:
  - name: chat
    engine: vllm
    models: [chat]
    capacity: 4
    health: {enabled: false}
    workers: ["$w_a", "$w_b", "$w_c"]
"""


def test_render_alone_neither_sheds_nor_queues_with_every_slot_busy(tmp_path: Path) -> None:
    """The rendered circuit breakers are a safety cap (4 x the declared 12 slots), not the
    shedding rule: 12 clients keeping every slot of the fleet busy, and 6 more waiting in
    the engines' own queues, get no 429 and never wait in Envoy for a limit (no overflow, no
    breaker open). The old 80 %-of-slots rule (9) shed or queued this load."""
    spec = FleetSpec(workers=tuple(WorkerSpec(name=n, models=("chat",), max_num_seqs=4, decode_ms=10.0)
                                   for n in ("a", "b", "c")), seed=1)
    with stack(NORMAL_TOPOLOGY, spec, tmp_path / "out") as s:
        s.wait_served({"model": "chat", "prompt": "warm", "max_tokens": 1})
        answers = s.load({"model": "chat", "prompt": "busy", "max_tokens": 20},
                         count=90, concurrency=18, max_seconds=60, timeout=30)  # fmt: skip
        statuses = Counter(a.status for _, a in answers)
        print(f"18 concurrent on 12 slots: {dict(statuses)}")
        assert statuses == Counter({200: 90}), statuses
        # A request pends in Envoy only while its connection is being set up; none hit a limit.
        for stat in ("upstream_rq_pending_overflow", "upstream_cx_overflow"):
            assert s.stat(f"cluster.chat.{stat}") == 0, stat


GLOBAL_TOPOLOGY = """
version: 1
name: limited
admin: {address: 127.0.0.1, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
limits:
  global: {requests: 3, per: 1m}
pools:
  - name: chat
    engine: vllm
    models: [chat]
    health: {enabled: false}
    workers: ["$w_a"]
"""


def test_global_rate_limit_answers_429_json_with_retry_after(tmp_path: Path) -> None:
    """The listener-wide token bucket (3 per minute) lets three requests through and
    answers the next ones 429, code `rate_limit_exceeded`, with retry-after, without
    reaching a worker."""
    spec = FleetSpec(workers=(WorkerSpec(name="a", models=("chat",), decode_ms=1.0),), seed=1)
    with stack(GLOBAL_TOPOLOGY, spec, tmp_path / "out") as s:
        answers = [s.post({"model": "chat", "prompt": "hi", "max_tokens": 1}) for _ in range(5)]
        assert [a.status for a in answers] == [200, 200, 200, 429, 429]
        for answer in answers[3:]:
            _check_429(answer, "rate_limit_exceeded", "2")
        assert s.worker("a").stats()["inference_received"] == 3
        assert s.stat("global.http_local_rate_limit.rate_limited") == 2
