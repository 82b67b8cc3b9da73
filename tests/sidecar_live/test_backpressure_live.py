"""Backpressure from the fleet: the sidecar keeps Envoy's in-flight limit (circuit breakers,
overridden through the admin runtime layer) at max_utilization of the capacity that serves,
and lowers it when the engines are saturated by load that did not come through this Envoy."""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.sidecar_live.rig import Rig, http, live_rig, poll, worker_specs

CONCURRENCY = 8
BODY = {"model": "sim-model", "prompt": "hold a slot", "max_tokens": 40}  # ~1 s at decode_ms=20


def _limit(rig: Rig) -> float | None:
    found = re.search(r'^confgen_sidecar_inflight_limit\{pool="chat"\} (\S+)$', rig.sidecar.metrics(), re.M)
    return float(found.group(1)) if found else None


def _runtime(rig: Rig) -> dict[str, str]:
    status, text = rig.envoy.admin_get("/runtime")
    assert status == 200, text
    return {key: entry["final_value"] for key, entry in json.loads(text)["entries"].items()}


def _burst(rig: Rig, n: int = CONCURRENCY) -> tuple[Counter[int], list[bytes]]:
    """`n` concurrent slow requests through Envoy: status counts and the 429 bodies."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(lambda _: http("POST", rig.url, BODY, timeout=20.0), range(n)))
    return Counter(status for status, _, _ in answers), [body for status, _, body in answers if status == 429]


def _overloaded(body: bytes) -> bool:
    return bool(json.loads(body)["error"]["code"] == "overloaded")


def test_limit_follows_capacity_when_workers_die(tmp_path: Path) -> None:
    """Three workers of capacity 4: the limit is floor(0.8 x 12) = 9 and 8 concurrent
    requests all pass. Kill two: the limit becomes floor(0.8 x 4) = 3 (metric and Envoy's
    /runtime agree) and the same 8 concurrent requests now get 429 `overloaded` JSON beyond
    the 3 the surviving worker is allowed, instead of queueing in it. Revived, back to 9."""
    workers = worker_specs(["a", "b", "c"], max_num_seqs=4, decode_ms=20.0)
    with live_rig(tmp_path, workers, capacity=4) as rig:
        assert poll(lambda: _limit(rig) == 9, timeout=5), rig.sidecar.metrics()
        keys = ("circuit_breakers.chat.default.max_requests", "circuit_breakers.chat.default.max_pending_requests")
        assert [_runtime(rig).get(k) for k in keys] == ["9", "9"]
        before, _ = _burst(rig)
        assert before == Counter({200: CONCURRENCY}), before

        rig.fleet.worker("b").crash()
        rig.fleet.worker("c").crash()
        assert poll(lambda: _limit(rig) == 3, timeout=5), rig.sidecar.state()
        assert [_runtime(rig).get(k) for k in keys] == ["3", "3"]
        after, shed = _burst(rig)
        print(f"8 concurrent: before {dict(before)}, after {dict(after)}")
        assert set(after) <= {200, 429}, after
        assert after[429] >= CONCURRENCY - 3 - 1, after  # one may slip in as another finishes
        assert shed and all(_overloaded(body) for body in shed)

        rig.fleet.worker("b").revive()
        rig.fleet.worker("c").revive()
        assert poll(lambda: _limit(rig) == 9, timeout=8), rig.sidecar.state()
        assert [_runtime(rig).get(k) for k in keys] == ["9", "9"]


def test_limit_falls_under_outside_load_and_recovers(tmp_path: Path) -> None:
    """Load that bypasses this Envoy (10 long requests sent to the engines directly, 10/12 of
    the slots, above the 0.8 rule) lowers the limit towards this Envoy's own in-flight
    requests (none: the floor of 1), so 4 requests through Envoy get 429 except one; once
    the outside load ends the limit climbs back to floor(0.8 x 12) = 9."""
    workers = worker_specs(["a", "b", "c"], max_num_seqs=4, decode_ms=20.0)
    with live_rig(tmp_path, workers, capacity=4) as rig:
        assert poll(lambda: _limit(rig) == 9, timeout=5), rig.sidecar.metrics()
        long_body = {"model": "sim-model", "prompt": "outside", "max_tokens": 250}  # ~5-6 s
        targets = [rig.fleet.worker(name).url + "/v1/completions" for name in ("a", "b", "c")]
        with ThreadPoolExecutor(max_workers=10) as outside:
            jobs = [outside.submit(http, "POST", targets[i % 3], long_body, 30.0) for i in range(10)]
            assert poll(lambda: _limit(rig) == 1, timeout=5), rig.sidecar.state()
            during, shed = _burst(rig, 4)
            print(f"4 concurrent under outside load: {dict(during)}")
            assert during[429] >= 3 and set(during) <= {200, 429}, during
            assert all(_overloaded(body) for body in shed)
            assert all(job.result(timeout=30)[0] == 200 for job in jobs)
        assert poll(lambda: _limit(rig) == 9, timeout=5), rig.sidecar.state()
