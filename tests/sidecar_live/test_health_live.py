"""The sidecar, the real Envoy and the simulated fleet: health and load behaviours.

Each test runs the sidecar as a subprocess with a 0.5 s cycle (0.25 s for flapping) and
reads Envoy's own view (admin /clusters) to see what actually takes traffic.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from confgen.simulate import WorkerSpec
from tests.sidecar_live.rig import FAST_ARGS, http, live_rig, now, poll, worker_specs

INTERVAL = 0.5
JITTER = 0.05


def _failed(flags: str) -> bool:
    return "/failed_eds_health" in flags


def test_killed_worker_stops_receiving_traffic_within_one_interval(tmp_path: Path) -> None:
    """A killed worker (connection refused) is published UNHEALTHY within one probe interval
    plus a small margin, after which Envoy makes no further connection attempt to it."""
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4)) as rig:
        port = rig.worker_port("b")
        assert not _failed(rig.envoy_host(port)["health_flags"])
        rig.fleet.worker("b").crash()
        crashed = now()
        assert poll(lambda: _failed(rig.envoy_host(port)["health_flags"]), timeout=5, interval=0.02)
        out_after = now() - crashed
        # one interval (with jitter) until the next probe, then probe + write + Envoy reload
        assert out_after <= INTERVAL * (1 + JITTER) + 0.4, out_after
        connect_fails = rig.envoy_host(port)["cx_connect_fail"]
        results = Counter(rig.send() for _ in range(20))
        assert sum(results.values()) == results[(200, "a")] + results[(200, "c")], results
        assert rig.envoy_host(port)["cx_connect_fail"] == connect_fails
        reason = rig.sidecar.endpoint(port)["reason"]
        assert "connection refused" in reason


def test_slow_health_that_still_serves_is_degraded_not_evicted(tmp_path: Path) -> None:
    """Health answers slower than degraded_latency_s (but within the deadline) mark the worker
    DEGRADED (Envoy's degraded host), never UNHEALTHY: it is alive and still serves."""
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4)) as rig:
        port = rig.worker_port("b")
        rig.fleet.worker("b").set_fault("slow_health", delay_s=0.25)
        seen: set[str] = set()

        def degraded_in_envoy() -> bool:
            seen.add(rig.sidecar.endpoint(port)["status"])
            return "/degraded_eds_health" in rig.envoy_host(port)["health_flags"]

        assert poll(degraded_in_envoy, timeout=5, interval=0.1)
        deadline = now() + 2.0  # four more cycles of slow answers
        while now() < deadline:
            seen.add(rig.sidecar.endpoint(port)["status"])
            assert not _failed(rig.envoy_host(port)["health_flags"])
            time.sleep(0.1)
        assert "UNHEALTHY" not in seen and "DEGRADED" in seen, seen
        status, _, body = http("POST", f"{rig.fleet.worker('b').url}/v1/completions",
                            {"model": "sim-model", "prompt": "hi", "max_tokens": 2})
        assert status == 200, body


def test_flapping_worker_is_damped(tmp_path: Path) -> None:
    """A worker that dies and comes back every ~second returns to rotation once, then each
    recent ejection doubles the successes it needs, so it stays out instead of flapping; it
    returns once it has been steadily up long enough."""
    args = [*FAST_ARGS, "--interval", "0.25", "--probe-deadline", "0.2", "--jitter", "0"]
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4), sidecar_args=args) as rig:
        port = rig.worker_port("b")
        worker = rig.fleet.worker("b")
        statuses: list[str] = []

        def watch(seconds: float) -> None:
            end = now() + seconds
            while now() < end:
                status = rig.sidecar.endpoint(port)["status"]
                if not statuses or statuses[-1] != status:
                    statuses.append(status)
                time.sleep(0.03)

        rounds = 4
        for _ in range(rounds):
            worker.crash()
            watch(0.45)
            worker.revive()
            watch(0.6)  # 2-3 ok probes: enough for rise=2, never for the damped rise=4
        returns = sum(1 for before, after in itertools.pairwise(statuses)
                      if before == "UNHEALTHY" and after == "HEALTHY")
        assert statuses.count("UNHEALTHY") >= 1
        assert returns <= 1, statuses  # undamped it would be `rounds`
        assert statuses[-1] == "UNHEALTHY", statuses
        assert _failed(rig.envoy_host(port)["health_flags"])
        # Steadily up: back after the damped rise (4 probes = 1 s), well within 4 s.
        assert poll(lambda: rig.sidecar.endpoint(port)["status"] == "HEALTHY", timeout=4)


def test_stalled_worker_is_evicted(tmp_path: Path) -> None:
    """A wedged engine (health 200, requests running, generated-token counter flat) is
    ejected once the stall lasts stall_probes probes and stall_min_s; it returns after the
    counter moves again."""
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4, decode_ms=20.0)) as rig:
        port = rig.worker_port("b")
        direct = f"{rig.fleet.worker('b').url}/v1/completions"
        body = {"model": "sim-model", "prompt": "stall me", "max_tokens": 150}
        with ThreadPoolExecutor(max_workers=2) as pool:
            jobs = [pool.submit(http, "POST", direct, body, 20.0) for _ in range(2)]
            assert poll(lambda: (rig.sidecar.endpoint(port)["sample"] or {}).get("running", 0) > 0, timeout=5)
            rig.fleet.worker("b").set_fault("stall")
            stalled = now()
            assert poll(lambda: _failed(rig.envoy_host(port)["health_flags"]), timeout=8, interval=0.1)
            # stall_min_s=1.5 and 3 probes, plus a cycle to notice
            assert now() - stalled >= 1.5
            assert "stalled" in rig.sidecar.endpoint(port)["reason"]
            results = Counter(rig.send() for _ in range(10))
            assert all(status == 200 and name != "b" for status, name in results), results
            rig.fleet.worker("b").set_fault("none")
            assert poll(lambda: rig.sidecar.endpoint(port)["status"] == "HEALTHY", timeout=5)
            for job in jobs:
                job.result(timeout=25)


def test_drained_worker_finishes_in_flight_streams(tmp_path: Path) -> None:
    """POST /drain publishes the worker DRAINING: streams already on it run to [DONE], and
    new requests go to the other workers."""
    with live_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=8, decode_ms=25.0)) as rig:
        started: list[str] = []
        finished: dict[int, tuple[str, bytes]] = {}
        lock = threading.Lock()

        def stream(i: int) -> None:
            import urllib.request

            req = urllib.request.Request(rig.url, method="POST", headers={"content-type": "application/json"},
                                         data=b'{"model":"sim-model","prompt":"long","max_tokens":60,"stream":true}')
            with urllib.request.urlopen(req, timeout=20) as resp:
                name = resp.headers.get("x-sim-worker", "-")
                with lock:
                    started.append(name)
                finished[i] = (name, resp.read())

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        assert poll(lambda: len(started) == 4, timeout=5)
        target = Counter(started).most_common(1)[0][0]
        port = rig.worker_port(target)
        status, body = rig.sidecar.post(f"/drain?pool=chat&worker=127.0.0.1:{port}")
        assert status == 200, body
        assert poll(lambda: "/eds_status_draining" in rig.envoy_host(port)["health_flags"], timeout=3)
        during = Counter(name for _, name in (rig.send() for _ in range(8)))
        for t in threads:
            t.join(timeout=20)
        assert len(finished) == 4
        on_target = [data for name, data in finished.values() if name == target]
        assert on_target and all(data.rstrip().endswith(b"data: [DONE]") for data in on_target)
        assert during[target] == 0, during
        status, _ = rig.sidecar.post(f"/undrain?pool=chat&worker=127.0.0.1:{port}")
        assert status == 200
        assert poll(lambda: "draining" not in rig.envoy_host(port)["health_flags"], timeout=3)


def test_weights_move_traffic_away_from_a_growing_queue(tmp_path: Path) -> None:
    """With the queue term on (waiting_penalty, off by default: Envoy counts its own queued
    requests), a worker whose queue grows (load from outside this Envoy) gets weight 1 while
    an idle one keeps its capacity, and Envoy's least_request then sends it a small share."""
    # Shedding is not under test here (tests/sidecar_live/test_backpressure_live.py): on a loaded
    # machine the simulated engines queue too, and a saturated pool's 429s would hide the weights.
    queue_args = (*FAST_ARGS, "--weights", "waiting_penalty=2", "--weights", "queue_half_life_s=0",
                  "--saturation", "queue_enter=1000", "--saturation", "queue_exit=999",
                  "--saturation", "kv_threshold=1", "--saturation", "pool_enter=1000",
                  "--saturation", "pool_burst=1000", "--saturation", "inflight_interval_s=0")
    with live_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=8, decode_ms=20.0), capacity=8,
                  sidecar_args=queue_args) as rig:
        pa, pb = rig.worker_port("a"), rig.worker_port("b")
        direct = f"{rig.fleet.worker('b').url}/v1/completions"
        body = {"model": "sim-model", "prompt": "queue", "max_tokens": 120}
        with ThreadPoolExecutor(max_workers=12) as loaders:
            jobs = [loaders.submit(http, "POST", direct, body, 30.0) for _ in range(12)]

            def skewed() -> bool:
                a, b = rig.envoy_host(pa), rig.envoy_host(pb)
                return b.get("weight") == "1" and int(a.get("weight", "0")) >= 6

            assert poll(skewed, timeout=5, interval=0.1), rig.sidecar.state()
            assert rig.sidecar.endpoint(pb)["sample"]["waiting"] >= 2
            assert f'llm_queue_depth{{pool="chat",worker="127.0.0.1:{pb}"}}' in rig.sidecar.metrics()
            with ThreadPoolExecutor(max_workers=6) as senders:
                results = Counter(senders.map(lambda _: rig.send(timeout=30), range(24)))
            for job in jobs:
                job.result(timeout=30)
        by_worker = Counter(name for (status, name), n in results.items() for _ in range(n) if status == 200)
        assert sum(by_worker.values()) == 24, results
        assert by_worker["b"] <= 6 < by_worker["a"], by_worker


@pytest.mark.parametrize("policy", ["least_request", "ring_hash, hash_on: {header: x-session-id}"],
                         ids=["least_request", "ring_hash"])
def test_hashing_pools_keep_the_rendered_weights(tmp_path: Path, policy: str) -> None:
    """A worker measured 4x slower loses weight under least_request, but a ring_hash pool keeps the
    rendered weights (capacity x share): a weight change rebuilds Envoy's ring and moves sessions,
    with their KV cache, to other workers."""
    workers = tuple(WorkerSpec(name=name, models=("sim-model",), speed=speed, max_num_seqs=4, decode_ms=10.0)
                    for name, speed in (("fast", 1.0), ("slow", 0.25)))
    with live_rig(tmp_path, workers, capacity=4, policy=policy) as rig:
        pf, ps = rig.worker_port("fast"), rig.worker_port("slow")
        body = {"model": "sim-model", "prompt": "speed", "max_tokens": 60}
        urls = [f"{rig.fleet.worker(name).url}/v1/completions" for name in ("fast", "slow")] * 4
        with ThreadPoolExecutor(max_workers=8) as loaders:  # 8 bounded requests straight to the workers
            jobs = [loaders.submit(http, "POST", url, body, 30.0) for url in urls]

            def weights() -> tuple[int, int]:
                return rig.sidecar.endpoint(pf)["weight"], rig.sidecar.endpoint(ps)["weight"]

            if policy == "least_request":
                assert poll(lambda: weights()[1] < weights()[0], timeout=10, interval=0.1), rig.sidecar.state()
            else:
                deadline = now() + 4.0
                while now() < deadline:  # as long as the measurement takes under least_request
                    assert weights() == (4, 4), rig.sidecar.state()
                    time.sleep(0.1)
            for job in jobs:
                job.result(timeout=30)
        if policy != "least_request":
            assert rig.envoy_host(ps).get("weight") == "4"  # and Envoy holds the rendered weight


def test_a_whole_pool_failing_is_failing_in_the_metrics_though_published_as_it_was(tmp_path: Path) -> None:
    """Found by review: with every worker of a pool failing the sidecar ejects none (more likely its own view
    is wrong; Envoy's checks decide) and keeps them published HEALTHY, so alerts on the published status never
    fired in a whole-pool outage. `endpoint_failing` says what the probes say (1 for each), `endpoint_serving`
    0, while `endpoint_health` still shows what is published."""
    with live_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=4)) as rig:
        ports = [rig.worker_port(n) for n in ("a", "b")]
        rig.fleet.worker("a").crash()
        rig.fleet.worker("b").crash()

        def sample(name: str, port: int) -> float | None:
            for line in rig.sidecar.metrics().splitlines():
                if line.startswith(name + "{") and f':{port}"' in line and 'state="' not in line:
                    return float(line.rsplit(" ", 1)[1])
            return None

        assert poll(lambda: all(sample("confgen_sidecar_endpoint_failing", p) == 1.0 for p in ports), timeout=10)
        assert all(sample("confgen_sidecar_endpoint_serving", p) == 0.0 for p in ports)
        published = {rig.sidecar.endpoint(p)["status"] for p in ports}
        assert published <= {"HEALTHY", "DEGRADED"}, published  # the sidecar stood back
