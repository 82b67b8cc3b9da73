"""Backpressure with the real Envoy, the rendered config, the sidecar as a process and the
simulated fleet: no shedding at normal load (the limit is the render's safety cap); when
the engines report saturation the sidecar lowers Envoy's in-flight limit (circuit-breaker
runtime overrides) so new requests get 429 + retry-after at once while admitted ones
complete; once saturation clears the limit goes back to the cap."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.sidecar_live.rig import FAST_ARGS, Rig, http, live_rig, poll, worker_specs

BODY = {"model": "sim-model", "prompt": "hold a slot", "max_tokens": 40}  # ~1 s at decode_ms=20
KEYS = ("circuit_breakers.chat.default.max_requests", "circuit_breakers.chat.default.max_pending_requests")


def _gauge(rig: Rig, name: str) -> float | None:
    found = re.search(rf'^confgen_sidecar_{name}\{{pool="chat"\}} (\S+)$', rig.sidecar.metrics(), re.M)
    return float(found.group(1)) if found else None


def _runtime(rig: Rig) -> list[str | None]:
    status, text = rig.envoy.admin_get("/runtime")
    assert status == 200, text
    entries = json.loads(text)["entries"]
    return [entries[k]["final_value"] if k in entries else None for k in KEYS]


def _burst(rig: Rig, n: int) -> Counter[int]:
    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(lambda _: http("POST", rig.url, BODY, timeout=30.0), range(n)))
    return Counter(status for status, _, _ in answers)


def test_normal_load_is_never_shed_and_the_limit_is_the_safety_cap(tmp_path: Path) -> None:
    """Three workers of 4 slots: the limit the sidecar keeps in Envoy is the render's safety
    cap, 4 x 12 = 48 (metric and /runtime agree). Three rounds of 12 concurrent requests
    (every slot busy) and one of 18 (six waiting in the engines) all get 200 and the pool
    never counts as saturated (the old 80 % rule, 9 here, shed these)."""
    workers = worker_specs(["a", "b", "c"], max_num_seqs=4, decode_ms=20.0)
    with live_rig(tmp_path, workers, capacity=4) as rig:
        assert poll(lambda: _gauge(rig, "inflight_limit") == 48, timeout=5), rig.sidecar.metrics()
        assert _runtime(rig) == ["48", "48"]
        seen: set[float | None] = set()
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.2):
                seen.add(_gauge(rig, "pool_saturated"))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            rounds = [_burst(rig, 12) for _ in range(3)] + [_burst(rig, 18)]
        finally:
            stop.set()
            watcher.join(timeout=5)
        print(f"rounds: {[dict(r) for r in rounds]}, saturated gauge seen: {seen}")
        assert all(set(r) == {200} for r in rounds), rounds
        assert seen == {0.0}, seen
        assert _gauge(rig, "inflight_limit") == 48


def test_overload_is_shed_with_429_and_retry_after_and_admitted_requests_complete(tmp_path: Path) -> None:
    """Three workers of 2 slots (safety cap 24) under 20 closed-loop clients: the engines'
    queues grow past a batch per slot, the sidecar declares the pool saturated and lowers
    Envoy's limit under what is in flight (below the cap, so the 429s are its doing): the
    excess gets 429 `overloaded` with retry-after at once, admitted requests still
    complete. When the clients stop, the limit returns to the cap."""
    workers = worker_specs(["a", "b", "c"], max_num_seqs=2, decode_ms=20.0)
    with live_rig(tmp_path, workers, capacity=2) as rig:
        assert poll(lambda: _gauge(rig, "inflight_limit") == 24, timeout=5), rig.sidecar.metrics()
        statuses: Counter[int] = Counter()
        shed: list[tuple[dict[str, str], bytes]] = []
        lowest = [24.0]
        lock = threading.Lock()
        deadline = time.monotonic() + 10.0

        def client() -> None:
            for _ in range(200):
                if time.monotonic() >= deadline:
                    return
                status, headers, body = http("POST", rig.url, BODY, timeout=30.0)
                with lock:
                    statuses[status] += 1
                    if status == 429 and len(shed) < 50:
                        shed.append((headers, body))
                if status == 429:
                    time.sleep(0.2)

        with ThreadPoolExecutor(max_workers=21) as pool:
            clients = [pool.submit(client) for _ in range(20)]
            while time.monotonic() < deadline:
                limit = _gauge(rig, "inflight_limit")
                if limit is not None:
                    lowest[0] = min(lowest[0], limit)
                time.sleep(0.3)
            for job in clients:
                job.result(timeout=60)
        print(f"20 clients on 6 slots for 10 s: {dict(statuses)}, lowest limit {lowest[0]}")
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[429] > 0 and statuses[200] > 0, statuses
        assert lowest[0] < 20, lowest  # the sidecar's limit, under the 20 clients and the cap of 24
        for headers, body in shed:
            assert headers["retry-after"] == "2"
            assert json.loads(body)["error"]["code"] == "overloaded"
        assert any(e.get("event") == "shed.start" for e in rig.sidecar.events())
        seen = re.search(r'^confgen_sidecar_shed_requests_total'
                         r'\{class="standard",pool="chat",reason="saturated"\} (\S+)$', rig.sidecar.metrics(), re.M)
        shed_lines = [ln for ln in rig.sidecar.metrics().splitlines() if "shed_requests_total{" in ln]
        assert seen is not None and float(seen.group(1)) > 0, shed_lines  # the sidecar saw its 429s
        assert _gauge(rig, "pool_queue_per_slot") is not None
        assert poll(lambda: _gauge(rig, "inflight_limit") == 24, timeout=15), rig.sidecar.state()
        assert _runtime(rig) == ["24", "24"]
        # no sheddable traffic in this topology: the limiter never sets a shed share
        assert "confgen.shed.chat.sheddable" not in json.loads(rig.envoy.admin_get("/runtime")[1])["entries"]
        assert "sheddable_refused_ratio{" not in rig.sidecar.metrics()
        assert _gauge(rig, "pool_saturated") == 0.0
        assert set(_burst(rig, 6)) == {200}


def test_saturation_from_outside_load_sheds_then_releases(tmp_path: Path) -> None:
    """Load that bypasses this Envoy (36 long requests sent to the engines directly: 12
    running, 24 waiting, 2 per slot) makes the pool saturated with nothing of this
    Envoy's in flight: its limit falls to the floor of 1, so of 4 concurrent requests
    through Envoy at least 3 get 429. Once the outside load has drained the limit
    climbs back to the safety cap (48) and requests pass again."""
    workers = worker_specs(["a", "b", "c"], max_num_seqs=4, decode_ms=20.0)
    with live_rig(tmp_path, workers, capacity=4) as rig:
        assert poll(lambda: _gauge(rig, "inflight_limit") == 48, timeout=5), rig.sidecar.metrics()
        long_body = {"model": "sim-model", "prompt": "outside", "max_tokens": 120}
        targets = [rig.fleet.worker(name).url + "/v1/completions" for name in ("a", "b", "c")]
        with ThreadPoolExecutor(max_workers=36) as outside:
            jobs = [outside.submit(http, "POST", targets[i % 3], long_body, 60.0) for i in range(36)]
            assert poll(lambda: _gauge(rig, "inflight_limit") == 1, timeout=8), rig.sidecar.state()
            during = _burst(rig, 4)
            print(f"4 concurrent under outside load: {dict(during)}")
            assert during[429] >= 3 and set(during) <= {200, 429}, during
            assert all(job.result(timeout=60)[0] == 200 for job in jobs)
        assert poll(lambda: _gauge(rig, "inflight_limit") == 48, timeout=15), rig.sidecar.state()
        assert set(_burst(rig, 4)) == {200}


def test_a_spike_through_envoy_is_refused_on_its_own_in_flight_count(tmp_path: Path) -> None:
    """Probes every 4 s, and the engine-side rules set out of reach (queue levels of 40-50
    per slot), so only the in-flight watch can act: 30 long requests at once through Envoy
    on three workers of 2 slots are 30 / 6 - 1 = 4 past the batch, over the burst level of
    2.5. The limit becomes 1.5 x 6 = 9 in Envoy (reason "inflight"; the watch reads every
    0.5 s, so it is usually there before the next probe: the time is printed), further
    requests get 429 at once and the 30 admitted ones complete."""
    args = [a if a != "0.5" or i != 1 else "4" for i, a in enumerate(FAST_ARGS)]
    args += ["--saturation", "queue_enter=50", "--saturation", "pool_enter=40", "--saturation", "pool_burst=50"]
    workers = worker_specs(["a", "b", "c"], max_num_seqs=2, decode_ms=20.0)
    long_body = {"model": "sim-model", "prompt": "spike", "max_tokens": 200}  # ~4 s each
    with live_rig(tmp_path, workers, capacity=2, sidecar_args=args) as rig:
        assert poll(lambda: _gauge(rig, "inflight_limit") == 24, timeout=8), rig.sidecar.metrics()
        with ThreadPoolExecutor(max_workers=30) as spike:
            t0 = time.monotonic()
            jobs = [spike.submit(http, "POST", rig.url, long_body, 60.0) for _ in range(30)]
            assert poll(lambda: _runtime(rig) == ["9", "9"], timeout=8.0), rig.sidecar.events()[-5:]
            took = time.monotonic() - t0
            chat = rig.sidecar.state()["pools"]["chat"]
            assert (chat["saturated"], chat["saturated_reason"], chat["shedding"]) == (True, "inflight", True), chat
            started = [e for e in rig.sidecar.events() if e.get("event") == "shed.start"]
            assert started and started[0]["reason"] == "inflight", started
            after = _burst(rig, 4)
            answers = [job.result(timeout=60)[0] for job in jobs]
        print(f"limit 9 after {took:.2f} s; spike: {Counter(answers)}, then 4 more: {dict(after)}, {started[0]}")
        assert after == Counter({429: 4}), after
        assert set(answers) <= {200, 429} and answers.count(200) >= 9, Counter(answers)
