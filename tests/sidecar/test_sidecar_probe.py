"""The prober against a real simulated engine: the metrics-only probe and its fallback."""

from __future__ import annotations

import asyncio

from confgen.simulate import FleetSpec, WorkerSpec, run_fleet_in_thread
from sidecar.observe.probe import Prober, ProbeReport, Target
from sidecar.observe.result import Outcome


def _probe(port: int, *, health: bool) -> ProbeReport:
    async def go() -> ProbeReport:
        async with Prober(max_concurrency=4, deadline_s=2.0, body_cap=1 << 20) as prober:
            return await prober.probe(Target("127.0.0.1", port, "vllm", "/health", "/metrics"), health=health)

    return asyncio.run(go())


def test_metrics_only_probe_of_a_live_engine_skips_health() -> None:
    """health=False on a live engine: OK with its load sample and no health latency, marked as
    not health-checked; the default probe is health-checked."""
    with run_fleet_in_thread(FleetSpec(workers=(WorkerSpec(name="a"),), seed=1)) as fleet:
        skipped = _probe(fleet.workers[0].port, health=False)
        full = _probe(fleet.workers[0].port, health=True)
    assert skipped.result.outcome is Outcome.OK and skipped.error is None
    assert skipped.result.sample is not None
    assert not skipped.result.health_checked and skipped.result.health_latency_s is None
    assert full.result.outcome is Outcome.OK and full.result.sample is not None
    assert full.result.health_checked and full.result.health_latency_s is not None


def test_metrics_only_probe_of_a_crashed_engine_is_classified_by_health() -> None:
    """When the metrics-only request fails, the probe asks /health: a crashed engine is REFUSED,
    exactly as with health every cycle (one probe, so a crash still ejects within one interval)."""
    with run_fleet_in_thread(FleetSpec(workers=(WorkerSpec(name="a"),), seed=1)) as fleet:
        fleet.workers[0].crash()
        report = _probe(fleet.workers[0].port, health=False)
    assert report.result.outcome is Outcome.REFUSED and report.error == "refused"
    assert report.result.health_checked


def test_metrics_only_probe_with_a_cut_body_falls_back_to_bad_metrics() -> None:
    """A truncated metrics body on a skipped-health probe: /health is asked and answers ok, so
    the outcome is BAD_METRICS (alive, load unknown), never OK without a sample."""
    with run_fleet_in_thread(FleetSpec(workers=(WorkerSpec(name="a"),), seed=1)) as fleet:
        fleet.workers[0].set_fault("truncated_metrics", how="cut")
        report = _probe(fleet.workers[0].port, health=False)
    assert report.result.outcome is Outcome.BAD_METRICS and report.error == "bad_metrics"
    assert report.result.health_checked and report.result.health_latency_s is not None


def test_health_only_probe_keeps_the_sample_and_classifies_failures() -> None:
    """metrics=False on a live engine: OK with a health latency and no sample, marked as not
    metrics-checked (the caller keeps its last sample); on a crashed engine it is REFUSED and
    marked metrics-checked, exactly as a full probe reports it."""

    async def go(port: int) -> ProbeReport:
        async with Prober(max_concurrency=4, deadline_s=2.0, body_cap=1 << 20) as prober:
            return await prober.probe(Target("127.0.0.1", port, "vllm", "/health", "/metrics"), metrics=False)

    with run_fleet_in_thread(FleetSpec(workers=(WorkerSpec(name="a"),), seed=1)) as fleet:
        live = asyncio.run(go(fleet.workers[0].port))
        fleet.workers[0].crash()
        dead = asyncio.run(go(fleet.workers[0].port))
    assert live.result.outcome is Outcome.OK and live.error is None
    assert live.result.sample is None and not live.result.metrics_checked
    assert live.result.health_checked and live.result.health_latency_s is not None
    assert dead.result.outcome is Outcome.REFUSED and dead.error == "refused"
    assert dead.result.metrics_checked


def test_a_blocked_event_loop_changes_no_verdict() -> None:
    """Issue 26, attack 2's second half: a picker held the sidecar's loop and every probe
    missed its deadline, so four healthy workers were marked UNHEALTHY. Here the loop is
    blocked for 3 s (a deliberate blocking call) while two probes of a healthy worker are in
    flight: one whose 1 s deadline passes during the block (before: TIMEOUT, and with fall=1
    UNHEALTHY), one whose 5 s deadline does not (before: a 3 s health latency, DEGRADED).
    Neither changes the worker's state."""
    import time

    from sidecar.decide.state import EndpointState, HealthPolicy, Status

    policy = HealthPolicy(fall=1, degraded_probes=1, degraded_latency_s=1.0)

    async def go(port: int) -> tuple[ProbeReport, ProbeReport]:
        target = Target("127.0.0.1", port, "vllm", "/health", "/metrics")
        async with Prober(max_concurrency=4, deadline_s=1.0, body_cap=1 << 20) as short, \
                Prober(max_concurrency=4, deadline_s=5.0, body_cap=1 << 20) as long:
            await short.probe(target)  # connections warm, as in a running sidecar
            await long.probe(target)
            probes = asyncio.gather(short.probe(target), long.probe(target))
            await asyncio.sleep(0)  # both probes started: their deadlines are set
            time.sleep(3.0)  # noqa: ASYNC251 - the point: the loop held (a blocking parse, a stuck callback)
            first, second = await probes
            return first, second

    with run_fleet_in_thread(FleetSpec(workers=(WorkerSpec(name="a"),), seed=1)) as fleet:
        late, slow = asyncio.run(go(fleet.workers[0].port))
    assert late.result.outcome is Outcome.LOOP_LATE and late.error == "loop_late", late
    assert slow.result.outcome is Outcome.OK, slow
    assert slow.result.health_latency_s is not None and slow.result.health_latency_s < 1.0
    for report in (late, slow):
        state = EndpointState.adopt(Status.HEALTHY, report.result.at - 1)
        assert state.observe(report.result, policy).published is Status.HEALTHY


def test_sglang_health_second_is_neither_a_timeout_nor_slowness() -> None:
    """SGLang's /health answers after its one-second poll at the earliest (the simulated engine polls like
    the real handler). With the short deadline a fast probe interval gives (0.4 s), every probe used to
    time out (the pool all UNHEALTHY), and with a long one every worker read 1 s slow (DEGRADED). The
    health probe now waits the poll out and counts only what exceeds it; a stopped engine still fails."""

    async def go(port: int, deadline_s: float) -> ProbeReport:
        async with Prober(max_concurrency=4, deadline_s=deadline_s, body_cap=1 << 20) as prober:
            return await prober.probe(Target("127.0.0.1", port, "sglang", "/health", "/metrics"))

    with run_fleet_in_thread(FleetSpec(workers=(WorkerSpec(name="a", engine="sglang"),), seed=1)) as fleet:
        port = fleet.workers[0].port
        short, long = asyncio.run(go(port, 0.4)), asyncio.run(go(port, 5.0))
        fleet.workers[0].set_fault("stall")
        stalled = asyncio.run(go(port, 0.4))
    for report in (short, long):
        assert report.result.outcome is Outcome.OK, report
        assert report.result.health_latency_s is not None and report.result.health_latency_s < 0.5, report
        assert report.result.sample is not None
    assert stalled.result.outcome is Outcome.TIMEOUT, stalled
