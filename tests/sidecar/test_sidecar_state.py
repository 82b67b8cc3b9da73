"""Per-endpoint health state machine and pool decisions, driven by a fake clock."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import pytest

from sidecar.decide.state import (
    Decision,
    EndpointState,
    HealthPolicy,
    Outcome,
    ProbeResult,
    Status,
    decide_pool,
)
from sidecar.observe.engines import LoadSample

POLICY = HealthPolicy()  # probe every 1 s, rise 2, fall 3


def ok(at: float, latency: float = 0.01, sample: LoadSample | None = None) -> ProbeResult:
    return ProbeResult(at, Outcome.OK, health_latency_s=latency, sample=sample)


def fail(at: float, outcome: Outcome = Outcome.TIMEOUT) -> ProbeResult:
    return ProbeResult(at, outcome)


def http(at: float, code: int) -> ProbeResult:
    return ProbeResult(at, Outcome.HTTP_STATUS, health_latency_s=0.01, http_status=code)


def run(state: EndpointState, results: Iterable[ProbeResult],
        policy: HealthPolicy = POLICY) -> tuple[EndpointState, list[tuple[float, Status]]]:
    """Feed results in order; return the final state and every published-status change."""
    changes: list[tuple[float, Status]] = []
    for result in results:
        before = state.published
        state = state.observe(result, policy)
        if state.published is not before:
            changes.append((result.at, state.published))
    return state, changes


def healthy(now: float = 0.0) -> EndpointState:
    return EndpointState.adopt(Status.HEALTHY, now)


def test_killed_worker_is_unhealthy_after_one_refused_probe() -> None:
    """Connection refused (nothing listens) ejects on the very next probe."""
    state, changes = run(healthy(), [ok(1.0), fail(2.0, Outcome.REFUSED)])
    assert state.status is Status.UNHEALTHY
    assert changes == [(2.0, Status.UNHEALTHY)]


def test_timeouts_and_5xx_eject_after_fall_not_before() -> None:
    """Timeouts and HTTP 5xx need `fall` consecutive failures; resets need `reset_fall`."""
    _, changes = run(healthy(), [fail(1.0), http(2.0, 503), fail(3.0)])
    assert changes == [(3.0, Status.UNHEALTHY)]
    _, changes = run(healthy(), [fail(1.0), ok(2.0), fail(3.0), fail(4.0)])
    assert changes == []
    _, changes = run(healthy(), [fail(1.0, Outcome.RESET), fail(2.0, Outcome.RESET)])
    assert changes == [(2.0, Status.UNHEALTHY)]


def test_slow_but_alive_is_degraded_not_unhealthy() -> None:
    """Slow health answers (and 429) degrade the endpoint; it is never ejected for slowness."""
    slow = [ok(float(t), latency=3.0) for t in range(1, 60)]
    state, changes = run(healthy(), slow)
    assert changes == [(2.0, Status.DEGRADED)]
    state, changes = run(state, [ok(60.0), ok(61.0)])
    assert changes == [(61.0, Status.HEALTHY)]
    state, changes = run(healthy(), [http(float(t), 429) for t in range(1, 10)])
    assert changes == [(2.0, Status.DEGRADED)]


def test_flapping_worker_is_damped() -> None:
    """A worker alternating ok/fail is ejected once (error burst) and stays out."""
    results = [ok(float(t)) if t % 2 else fail(float(t)) for t in range(1, 200)]
    state, changes = run(healthy(), results)
    assert changes == [(10.0, Status.UNHEALTHY)]  # the 5th failure within 30 s
    assert state.status is Status.UNHEALTHY


def test_repeat_offender_needs_more_successes_each_time() -> None:
    """Each ejection within the flap window doubles `rise`: 2, then 4 successes."""
    t = 0.0

    def tick() -> float:
        nonlocal t
        t += 1.0
        return t

    state, _ = run(healthy(), [fail(tick(), Outcome.REFUSED)])
    state, changes = run(state, [ok(tick()), ok(tick())])
    assert [s for _, s in changes] == [Status.HEALTHY]
    state, _ = run(state, [fail(tick(), Outcome.REFUSED)])
    state, changes = run(state, [ok(tick()) for _ in range(3)])
    assert changes == []
    state, changes = run(state, [ok(tick())])
    assert [s for _, s in changes] == [Status.HEALTHY]
    assert state.rise_needed(POLICY) == 4


def test_periodic_failures_below_fall_are_caught_by_error_burst() -> None:
    """ok,ok,fail repeated never reaches `fall` in a row, but is ejected and then kept out."""
    results = [fail(float(t)) if t % 3 == 0 else ok(float(t)) for t in range(1, 300)]
    state, changes = run(healthy(), results)
    assert len(changes) <= 3  # out, back once (rise 2 fits the pattern), out for good
    assert state.status is Status.UNHEALTHY


def _busy(tokens: float, running: float = 4.0) -> LoadSample:
    return LoadSample(running=running, waiting=0.0, generated_tokens=tokens)


def test_stall_ejects_after_probes_and_time_floor() -> None:
    """running > 0 with a flat token counter ejects after stall_probes and stall_min_s."""
    results = [ok(float(t), sample=_busy(1000.0)) for t in range(0, 40)]
    state, changes = run(healthy(), results)
    assert changes == [(30.0, Status.UNHEALTHY)]
    assert state.stalled
    # /health keeps answering, but the engine stays out until tokens move again.
    state, changes = run(state, [ok(float(t), sample=_busy(1000.0)) for t in range(40, 50)])
    assert changes == []
    state, changes = run(state, [ok(50.0, sample=_busy(1100.0)), ok(51.0, sample=_busy(1200.0))])
    assert changes == [(51.0, Status.HEALTHY)]  # progress seen at 50 and 51: rise 2


def test_long_prefill_and_idle_are_not_stalls() -> None:
    """A flat counter for less than stall_min_s, or with nothing running, is not a stall."""
    prefill = [ok(float(t), sample=_busy(500.0)) for t in range(0, 25)]
    prefill.append(ok(25.0, sample=_busy(510.0)))
    idle = [ok(float(t), sample=_busy(510.0, running=0.0)) for t in range(26, 200)]
    _, changes = run(healthy(), prefill + idle)
    assert changes == []


def test_counter_reset_is_progress_not_stall() -> None:
    """An engine restart resets its counter to a lower value: that counts as progress."""
    results = [ok(float(t), sample=_busy(9000.0 if t < 20 else 10.0)) for t in range(0, 45)]
    _, changes = run(healthy(), results)
    assert changes == []


def _skipped(at: float, tokens: float) -> ProbeResult:
    """A metrics-only probe (health skipped) that found the engine progressing."""
    return ProbeResult(at, Outcome.OK, sample=_busy(tokens), health_checked=False)


def test_progress_lets_health_be_skipped_but_at_most_health_every_s() -> None:
    """Only a HEALTHY endpoint whose token counter rose since the last sample may skip /health,
    and /health is asked again once health_every_s passed since the last health answer."""
    state = healthy()
    assert state.needs_health(0.0, POLICY)  # nothing known yet
    state, _ = run(state, [ok(0.0, sample=_busy(100.0))])
    assert state.needs_health(1.0, POLICY)  # one sample: no movement seen yet
    state, _ = run(state, [ok(1.0, sample=_busy(200.0))])
    assert not state.needs_health(2.0, POLICY)
    state, _ = run(state, [_skipped(t, 200.0 + 100 * t) for t in (2.0, 3.0, 4.0, 5.0)])
    assert not state.needs_health(5.5, POLICY)
    assert state.needs_health(6.0, POLICY)  # last health answer at 1.0: 5 s ago
    assert healthy().needs_health(0.0, HealthPolicy(health_every_s=0.0))
    off, _ = run(healthy(), [ok(0.0, sample=_busy(1.0)), ok(1.0, sample=_busy(2.0))],
                 HealthPolicy(health_every_s=0.0))
    assert off.needs_health(1.5, HealthPolicy(health_every_s=0.0))


def test_idle_flat_slow_or_failing_endpoints_always_ask_health() -> None:
    """An idle engine (counter flat), a counter that went down, a slow answer, a recent
    failure, a DEGRADED or new endpoint: /health is asked on the next probe."""
    moving = [ok(0.0, sample=_busy(100.0)), ok(1.0, sample=_busy(200.0))]
    cases = {
        "flat": [*moving, ok(2.0, sample=_busy(200.0, running=0.0))],
        "restarted": [*moving, ok(2.0, sample=_busy(5.0))],
        "no sample": [*moving, ProbeResult(2.0, Outcome.BAD_METRICS, health_latency_s=0.01)],
        "slow": [ok(0.0, sample=_busy(100.0)), ok(1.0, latency=2.0, sample=_busy(200.0))],
        "failed": [ok(0.0, sample=_busy(100.0)), fail(1.0), ok(2.0, sample=_busy(200.0)),
                   ok(3.0, sample=_busy(300.0))],
    }
    for name, results in cases.items():
        state, _ = run(healthy(), results)
        assert state.needs_health(results[-1].at + 0.5, POLICY), name
    proven, _ = run(healthy(), moving)
    assert not proven.needs_health(1.5, POLICY)
    assert replace(proven, status=Status.DEGRADED).needs_health(1.5, POLICY)
    assert replace(proven, fresh=True).needs_health(1.5, POLICY)
    assert replace(proven, status=Status.UNHEALTHY).needs_health(1.5, POLICY)


def test_stall_is_detected_the_same_when_health_was_skipped() -> None:
    """Skipped health probes feed the same stall detection: a counter that stops while
    requests run ejects after stall_probes and stall_min_s, as with health every cycle."""
    moving = [ok(0.0, sample=_busy(0.0)), ok(1.0, sample=_busy(10.0))]
    state, _ = run(healthy(), moving)
    flat = [ProbeResult(float(t), Outcome.OK, sample=_busy(10.0), health_checked=not state.needs_health(t, POLICY))
            for t in range(2, 40)]
    _, changes = run(state, flat)
    assert changes == [(31.0, Status.UNHEALTHY)]


def test_drain_sticks_until_undrained() -> None:
    """DRAINING survives ok and failing probes; undrain returns with a fresh ramp."""
    state = healthy().drain()
    state, changes = run(state, [ok(1.0), fail(2.0, Outcome.REFUSED), ok(3.0), ok(4.0)])
    assert changes == []
    assert state.published is Status.DRAINING
    state = state.undrain(now=10.0)
    assert state.published is Status.HEALTHY
    assert state.ramp(10.0, POLICY) == 0.0
    assert decide_pool({"a": state}, POLICY, now=40.0)["a"].ramp == pytest.approx(0.5)


def test_new_endpoint_waits_for_first_ok_then_ramps() -> None:
    """A new endpoint is out until its first ok probe, then ramps linearly over slow_start_s."""
    state, changes = run(EndpointState.new(0.0), [http(1.0, 503), http(2.0, 503), ok(3.0)])
    assert changes == [(3.0, Status.HEALTHY)]
    ramps = [state.ramp(t, POLICY) for t in (3.0, 18.0, 33.0, 63.0, 100.0)]
    assert ramps == [0.0, 0.25, 0.5, 1.0, 1.0]
    recovered, _ = run(state, [fail(70.0, Outcome.REFUSED), ok(71.0), ok(72.0)])
    assert recovered.ramp(72.0, POLICY) == 0.0


def test_out_of_order_results_are_ignored() -> None:
    """A result older than the last one taken into account changes nothing."""
    state, _ = run(healthy(), [ok(10.0)])
    assert state.observe(fail(5.0, Outcome.REFUSED), POLICY) is state


@pytest.mark.parametrize(
    ("published", "probe"),
    [
        (Status.HEALTHY, lambda t: ok(t)),
        (Status.DEGRADED, lambda t: ok(t, latency=5.0)),
        (Status.UNHEALTHY, lambda t: fail(t, Outcome.REFUSED)),
        (Status.DRAINING, lambda t: ok(t)),
        ("UNKNOWN", lambda t: ok(t)),
    ],
)
def test_adopt_on_restart_causes_no_transition(
    published: Status | str, probe: Callable[[float], ProbeResult]
) -> None:
    """Seeding from the published status then seeing consistent probes changes nothing."""
    now = 1000.0
    pool = {"a": EndpointState.adopt(published, now), "b": healthy(now), "c": healthy(now)}
    first = decide_pool(pool, POLICY, now)
    expected = Status.HEALTHY if published == "UNKNOWN" else Status(published)
    assert first["a"].status is expected
    assert first["a"].ramp in (0.0, 1.0) and not first["a"].min_weight
    state, changes = run(pool["a"], [probe(now + t) for t in range(1, 50)])
    assert changes == []
    pool["a"] = state
    later = decide_pool(pool, POLICY, now + 50)["a"]
    assert (later.status, later.ramp, later.min_weight) == (
        first["a"].status, first["a"].ramp, first["a"].min_weight)


def _down(since: float) -> EndpointState:
    state, _ = run(healthy(), [fail(since, Outcome.REFUSED)])
    return state


def test_ejection_cap_keeps_the_rest_at_minimum_weight() -> None:
    """At most max_ejected_fraction are ejected; the longest-failing go first; stable."""
    pool = {"a": _down(5.0), "b": _down(3.0), "c": _down(4.0), "d": healthy()}
    decisions = decide_pool(pool, POLICY, now=10.0)
    assert {k for k, d in decisions.items() if d.status is Status.UNHEALTHY} == {"b", "c"}
    assert decisions["a"].status is Status.HEALTHY and decisions["a"].min_weight
    assert decisions["d"] == Decision(Status.HEALTHY, 1.0, False, pool["d"].reason)
    assert decide_pool(pool, POLICY, now=11.0) == decisions


def test_kept_endpoint_keeps_its_degraded_status() -> None:
    """Beyond the cap a failing endpoint stays published as it was before failing."""
    degraded, _ = run(healthy(), [ok(1.0, latency=5.0), ok(2.0, latency=5.0)])
    failed, _ = run(degraded, [fail(3.0, Outcome.REFUSED)])
    pool = {"a": _down(1.0), "x": _down(0.5), "b": failed, "c": healthy(), "d": healthy()}
    decisions = decide_pool(pool, POLICY, now=4.0)
    assert decisions["a"].status is decisions["x"].status is Status.UNHEALTHY
    assert decisions["b"].status is Status.DEGRADED and decisions["b"].min_weight


def test_all_down_ejects_none_and_lists_every_endpoint() -> None:
    """When every endpoint fails, none is ejected: all stay listed at minimum weight."""
    pool = {name: _down(float(i)) for i, name in enumerate("abc")}
    decisions = decide_pool(pool, POLICY, now=10.0)
    assert set(decisions) == set(pool)
    assert all(d.status is Status.HEALTHY and d.min_weight for d in decisions.values())
    single = decide_pool({"only": _down(1.0)}, POLICY, now=2.0)
    assert single["only"].status is Status.HEALTHY and single["only"].min_weight


def test_drained_endpoints_do_not_count_toward_the_cap() -> None:
    """Drained endpoints are published DRAINING and excluded from the cap's denominator."""
    pool = {"a": _down(1.0), "b": healthy(), "c": healthy().drain(), "d": healthy().drain()}
    decisions = decide_pool(pool, POLICY, now=5.0)
    assert decisions["a"].status is Status.UNHEALTHY  # 1 of 2 active: within 50 %
    assert decisions["c"].status is Status.DRAINING
    assert decisions["d"].status is Status.DRAINING


def test_probe_result_and_policy_validation() -> None:
    """http_status goes with HTTP_STATUS only; nonsensical policies are refused."""
    with pytest.raises(ValueError, match="http_status"):
        ProbeResult(1.0, Outcome.HTTP_STATUS)
    with pytest.raises(ValueError, match="http_status"):
        ProbeResult(1.0, Outcome.OK, http_status=200)
    with pytest.raises(ValueError, match="max_ejected_fraction"):
        HealthPolicy(max_ejected_fraction=1.5)
    with pytest.raises(ValueError, match="probe counts"):
        HealthPolicy(fall=0)
    with pytest.raises(ValueError, match="unknown published status"):
        EndpointState.adopt("SLEEPY", 0.0)


def _health_only(at: float) -> ProbeResult:
    """A health-only probe (metrics skipped, the engine quiet) that answered ok."""
    return ProbeResult(at, Outcome.OK, health_latency_s=0.01, metrics_checked=False)


def test_quiet_engine_lets_metrics_be_skipped_but_at_most_quiet_metrics_every_s() -> None:
    """A HEALTHY endpoint whose last sample showed nothing running or waiting may skip /metrics,
    until quiet_metrics_probes intervals passed since the last sample; a skipped probe keeps it quiet."""
    idle = _busy(500.0, running=0.0)
    state = healthy()
    assert state.needs_metrics(0.0, POLICY)  # nothing known yet
    state, _ = run(state, [ok(0.0, sample=idle)])
    assert not state.needs_metrics(1.0, POLICY)
    state, changes = run(state, [_health_only(1.0), _health_only(2.0)])
    assert changes == [] and not state.needs_metrics(2.4, POLICY)
    assert state.needs_metrics(2.6, POLICY)  # last sample at 0.0: the third probe reads metrics
    assert state.needs_health(2.4, POLICY)  # never both skipped: a quiet engine is asked /health
    off = HealthPolicy(quiet_metrics_probes=1)
    assert run(healthy(), [ok(0.0, sample=idle)], off)[0].needs_metrics(0.5, off)


def test_busy_slow_failing_or_new_endpoints_always_read_metrics() -> None:
    """Running or waiting requests, a rising counter, a slow answer, a failure on record, a
    DEGRADED or new endpoint, or no sample at all: /metrics is read on the next probe."""
    idle = _busy(500.0, running=0.0)
    cases = {
        "running": [ok(0.0, sample=_busy(500.0))],
        "waiting": [ok(0.0, sample=LoadSample(running=0.0, waiting=2.0, generated_tokens=500.0))],
        "rising": [ok(0.0, sample=_busy(400.0, running=0.0)), ok(1.0, sample=idle)],
        "slow": [ok(0.0, latency=2.0, sample=idle)],
        "failed": [ok(0.0, sample=idle), fail(0.5), ok(1.0, sample=idle)],
        "no sample": [ProbeResult(0.0, Outcome.BAD_METRICS, health_latency_s=0.01)],
    }
    for name, results in cases.items():
        state, _ = run(healthy(), results)
        assert state.needs_metrics(1.5, POLICY), name
    degraded = EndpointState.adopt(Status.DEGRADED, 0.0)
    assert run(degraded, [ok(0.0, sample=idle)])[0].needs_metrics(0.5, POLICY)
    fresh = EndpointState.new(0.0)
    assert fresh.needs_metrics(0.5, POLICY)
