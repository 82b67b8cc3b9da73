"""The saturation detector and the shedding controller (sidecar.decide.saturation), with a fake
clock: stale or missing metrics never shed; the queue's trend and KV use; hysteresis;
the pool rule; the controller caps near the current in-flight, tracks the excess, and
releases to the safety cap."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from confgen.envoy import breaker_runtime_keys, shed_runtime_key
from confgen.runtime import EnvoyProcess
from sidecar.decide.saturation import (
    Admission,
    Headroom,
    InflightWatch,
    PoolLoad,
    PoolSaturation,
    QueueWatch,
    SaturationPolicy,
    admit,
    assess,
    setpoint,
)
from sidecar.observe.engines import LoadSample
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.files.limiter import InflightLimiter

POLICY = SaturationPolicy()  # queue_enter 1.5, queue_exit 0.25, half-life 2 s, lookahead 2 s, stale 5 s


def feed(queues: list[float], capacity: int = 8, step: float = 2.0, kv: float | None = None,
         start: Headroom | None = None, t0: float = 0.0) -> Headroom:
    """One worker's headroom after samples of `queues` waiting per slot, `step` s apart."""
    h = start or Headroom()
    for i, q in enumerate(queues):
        h = h.observe(LoadSample(running=capacity, waiting=q * capacity, kv_usage=kv), t0 + i * step, capacity, POLICY)
    return h


def sat(full_share: float = 1.0, capacity: int = 24, waiting: float = 0.0, saturated: bool = True) -> PoolSaturation:
    return PoolSaturation(saturated=saturated, full_share=full_share, capacity=capacity, fresh_capacity=capacity,
                          waiting=waiting)


# -- detector: one worker -------------------------------------------------------------------


def test_a_burst_is_not_saturation_but_a_sustained_queue_is() -> None:
    """One sample of a whole batch waiting (then back to none) keeps the headroom; the same
    queue held for a few cycles takes it."""
    assert not feed([0, 0, 1.4, 0, 0]).full
    assert not feed([0, 0, 2.2]).full  # one jump: smoothed to half of it, the rise not projected yet
    assert not feed([0, 0, 2.2, 0]).full
    assert feed([0, 2.0, 2.0]).full


def test_a_rising_queue_is_caught_before_its_level_by_the_trend() -> None:
    """A queue growing by 0.375 per slot per cycle is flagged while its smoothed level is
    still under 0.8 of queue_enter (the projected rise makes up for the smoothing's lag);
    a higher level held flat is not."""
    rising = feed([0.0, 0.375, 0.75, 1.125, 1.5])
    assert rising.full and rising.queue < 0.8 * POLICY.queue_enter
    flat = feed([1.2] * 8)
    assert not flat.full and flat.queue == pytest.approx(1.2)


def test_hysteresis_keeps_a_full_worker_full_until_its_queue_is_short() -> None:
    """Once full, a worker stays full while its smoothed queue is above queue_exit (0.25),
    and regains its headroom below it."""
    h = feed([2.0, 2.0, 2.0])
    assert h.full
    h = feed([0.6, 0.6], start=h, t0=6.0)
    assert h.full and h.queue > POLICY.queue_exit
    h = feed([0.0] * 4, start=h, t0=10.0)
    assert not h.full and h.queue <= POLICY.queue_exit


def test_kv_pressure_with_a_queue_takes_the_headroom_without_one_it_does_not() -> None:
    """KV use >= 0.8 with a smoothed queue of at least queue_exit of the running batch is
    enough; KV use alone, with nothing waiting, is not. A KV-bound engine running 16 of its
    256 slots with 8 waiting (0.03 per slot) is full."""
    assert feed([0.4, 0.4, 0.4], kv=0.85).full
    assert not feed([0.4, 0.4, 0.4], kv=0.5).full
    assert not feed([0.0, 0.0, 0.0], kv=0.97).full
    h = Headroom()
    for i in range(4):
        h = h.observe(LoadSample(running=16, waiting=8, kv_usage=0.95), i * 2.0, 256, POLICY)
    assert h.full and h.queue < 0.05
    h = h.observe(LoadSample(running=16, waiting=8, kv_usage=0.5), 8.0, 256, POLICY)
    assert not h.full


def test_missing_metrics_give_headroom_and_restart_the_trend() -> None:
    """A probe without a sample (failed, or a health-only engine) resets the worker to
    'has headroom'; a sample older than the previous one changes nothing."""
    h = feed([2.0, 2.0, 2.0])
    assert h.full
    gone = h.observe(None, 8.0, 8, POLICY)
    assert not gone.full and gone.at is None
    assert h.observe(LoadSample(running=0, waiting=0), 1.0, 8, POLICY) is h


def test_a_sample_after_a_long_gap_starts_the_trend_over() -> None:
    """After more than stale_after_s without a sample, the next one is taken as it is (no
    slope from the gap)."""
    h = feed([0.0, 0.0])
    later = h.observe(LoadSample(running=8, waiting=4), 60.0, 8, POLICY)
    assert later.slope == 0.0 and later.queue == pytest.approx(0.5) and not later.full


# -- detector: the pool --------------------------------------------------------------------


def test_pool_is_saturated_when_the_full_share_of_capacity_reaches_max_utilization() -> None:
    """Three workers of 8 slots: two full is 0.67 of the capacity, under 0.8; three full
    is saturation. With max_utilization 0.5, two are enough. Capacity weighs: one full
    worker of 32 slots against two of 4 is 0.8."""
    full, free = feed([2.0] * 3), feed([0.0] * 3)
    now = 4.0
    assert not assess([(full, 8), (full, 8), (free, 8)], now, POLICY, 0.8).saturated
    assert assess([(full, 8), (full, 8), (full, 8)], now, POLICY, 0.8).saturated
    assert assess([(full, 8), (full, 8), (free, 8)], now, POLICY, 0.5).saturated
    weighed = assess([(feed([2.0] * 3, capacity=32), 32), (free, 4), (free, 4)], now, POLICY, 0.8)
    assert weighed.saturated and weighed.full_share == pytest.approx(0.8)


def test_stale_or_missing_metrics_never_make_a_pool_saturated() -> None:
    """Every worker full on its last sample, but that sample is older than stale_after_s:
    not saturated, and nothing counts as waiting. A pool with no sample at all, or no
    worker in rotation, is not saturated either."""
    full = feed([2.0] * 3)  # last sample at t=4
    stale = assess([(full, 8)] * 3, 4.0 + POLICY.stale_after_s + 0.1, POLICY, 0.8)
    assert not stale.saturated and stale.fresh_capacity == 0 and stale.waiting == 0
    assert not assess([(Headroom(), 8)] * 3, 4.0, POLICY, 0.8).saturated
    assert not assess([], 4.0, POLICY, 0.8).saturated
    half = assess([(full, 8), (full, 8), (Headroom(), 8)], 4.0, POLICY, 0.8)
    assert not half.saturated and half.capacity == 24 and half.fresh_capacity == 16


# -- controller ------------------------------------------------------------------------------


def test_below_saturation_the_limit_is_the_safety_cap() -> None:
    """Not saturated and not shedding: the render's cap, whatever Envoy has in flight."""
    assert admit(None, sat(saturated=False, waiting=100), 500, False, 96, 1, 0.0, POLICY) == Admission(limit=96)


def test_on_saturation_the_limit_goes_at_once_to_full_batches_and_half_a_batch_waiting() -> None:
    """24 slots, 60 in flight: the limit is 1.5 x 24 = 36 at once, under what is in flight,
    so new requests get 429 until the backlog has drained; whatever the queue or the
    in-flight count. Two ingresses hold half each, within [1, cap]."""
    first = admit(None, sat(waiting=36), 60, False, 96, 1, 0.0, POLICY)
    assert first == Admission(limit=36, shedding=True)
    assert admit(first, sat(waiting=500), 3, True, 96, 1, 2.0, POLICY).limit == 36
    assert admit(None, sat(waiting=36), 60, False, 96, 2, 0.0, POLICY).limit == 18
    assert admit(None, sat(capacity=1, waiting=9), 60, False, 96, 4, 0.0, POLICY).limit == 1  # never below 1
    assert admit(None, sat(capacity=200, waiting=9), 60, False, 96, 1, 0.0, POLICY).limit == 96  # nor above the cap


def test_the_batch_is_what_the_engines_run_not_only_what_is_declared() -> None:
    """A worker running more than its declared slots counts what it runs (up to a batch more than
    the next worker: see the next test); one whose KV cache is full with requests waiting counts
    what it runs (fewer); one without fresh metrics counts its declared slots."""
    more = Headroom().observe(LoadSample(running=12, waiting=0, kv_usage=0.3), 1.0, 8, POLICY)
    kv_bound = Headroom().observe(LoadSample(running=5, waiting=3, kv_usage=0.95), 1.0, 8, POLICY)
    kv_idle = Headroom().observe(LoadSample(running=5, waiting=0, kv_usage=0.95), 1.0, 8, POLICY)
    pool = assess([(more, 8), (kv_bound, 8), (kv_idle, 8), (Headroom(), 8)], 1.0, POLICY, 0.8)
    assert pool.batch == 12 + 5 + 8 + 8
    assert pool.in_flight == 12 + 8 + 5
    assert setpoint(pool, 96, 1, POLICY, active=25) == 50  # 1.5 x 33 = 49.5, rounded half up
    assert setpoint(pool, 96, 1, POLICY, active=15) == 40  # 10 in flight came from elsewhere


def test_one_worker_reporting_far_more_than_the_rest_moves_nothing_for_them() -> None:
    """Found by review: one worker reporting a queue of 1e12 made its pool saturated and the in-flight
    limit 1; one reporting 1e12 running would have raised the batch past any shedding. The worker that
    reports most per slot counts one batch of its own at most beyond what the next one reports: the pool
    moves by that worker's own share, as if it reported a batch waiting or a batch more running."""
    honest = Headroom().observe(LoadSample(running=6, waiting=1, kv_usage=0.3), 1.0, 8, POLICY)
    fleet = [(honest, 8), (honest, 8), (honest, 8)]
    for lie, bounded in ((LoadSample(running=6, waiting=1e12, kv_usage=0.3),
                          LoadSample(running=6, waiting=8, kv_usage=0.3)),
                         (LoadSample(running=1e12, waiting=1, kv_usage=0.3),
                          LoadSample(running=16, waiting=1, kv_usage=0.3))):
        pool = assess([*fleet, (Headroom().observe(lie, 1.0, 8, POLICY), 8)], 1.0, POLICY, 0.8)
        same = assess([*fleet, (Headroom().observe(bounded, 1.0, 8, POLICY), 8)], 1.0, POLICY, 0.8)
        assert (pool.waiting, pool.in_flight, pool.batch) == (same.waiting, same.in_flight, same.batch), pool
        watch = QueueWatch()
        for t in range(10):
            watch = watch.observe(pool, float(t), POLICY)
        assert not watch.on and not pool.saturated
        assert setpoint(pool, 96, 1, POLICY, active=30) == setpoint(same, 96, 1, POLICY, active=30) > 1
    # a pool of one is its own: its queue counts whole
    alone = assess([(Headroom().observe(LoadSample(running=6, waiting=1e12, kv_usage=0.3), 1.0, 8, POLICY), 8)],
                   1.0, POLICY, 0.8)
    assert alone.waiting == 1e12


def test_load_that_bypasses_this_envoy_is_taken_off_its_share() -> None:
    """The engines hold 36 (12 running, 24 waiting) and nothing came through this Envoy:
    1.5 x 12 - 36 is under the floor, so the limit is 1. All 36 through it: nothing came from
    outside, the limit is 1.5 x 12 = 18; two Envoys holding 18 each: 9 each."""
    busy = replace(sat(capacity=12, waiting=24), in_flight=36.0)
    assert admit(None, busy, 0, False, 48, 1, 0.0, POLICY).limit == 1
    assert admit(None, busy, 36, False, 48, 1, 0.0, POLICY).limit == 18
    assert admit(None, busy, 18, False, 48, 2, 0.0, POLICY).limit == 9


def test_without_its_own_in_flight_count_the_sidecar_never_starts_shedding() -> None:
    """Envoy's stats unreadable: a saturated pool keeps the cap (or the limit in force)."""
    assert admit(None, sat(waiting=99), None, False, 96, 1, 0.0, POLICY) == Admission(limit=96)
    held = Admission(limit=40, shedding=True)
    assert admit(held, sat(waiting=99), None, False, 96, 1, 0.0, POLICY) == held


def test_release_waits_until_the_limit_refuses_nothing_then_returns_to_the_cap() -> None:
    """The queue is short but the limit still refuses requests: still shedding (the limit
    never falls while clear). Once nothing was refused for release_after_s (4 s), back to the cap."""
    state = Admission(limit=30, shedding=True)
    clear = sat(saturated=False, full_share=0.0, waiting=0)
    state = admit(state, clear, 30, True, 96, 1, 0.0, POLICY)
    assert state.shedding and state.limit == 36 and state.clear_since is None  # the setpoint (1.5 x 24)
    state = admit(state, clear, 20, False, 96, 1, 2.0, POLICY)
    assert state.shedding and state.limit == 36 and state.clear_since == 2.0
    state = admit(state, clear, 20, False, 96, 1, 4.0, POLICY)
    assert state.shedding
    state = admit(state, clear, 20, False, 96, 1, 6.0, POLICY)
    assert state == Admission(limit=96)


def _fluid(load: float, cycles: int = 300, slots: int = 24, ingresses: int = 1) -> tuple[float, float]:
    """A fluid fleet of `slots` slots, each finishing 0.5 requests per 2 s cycle, offered
    `load` x its capacity evenly through `ingresses` Envoys, each run by its own sidecar
    (--ingresses N) on the same engine reports. Returns (shed share, mean waiting per
    slot) over the second half."""
    rate = 0.5 * slots * load / ingresses  # requests offered per cycle to each Envoy
    heads = [Headroom()] * 3
    states: list[Admission | None] = [None] * ingresses
    own = [0.0] * ingresses  # each Envoy's requests in flight
    shed = offered = waiting_sum = 0.0
    for cycle in range(cycles):
        now = cycle * 2.0
        total = sum(own)
        done_share = min(total, slots) * 0.5 / total if total else 0.0  # completions spread pro rata
        refused = [0.0] * ingresses
        for i in range(ingresses):
            state = states[i]
            limit = state.limit if state is not None else 4 * slots
            left = own[i] * (1 - done_share)
            admitted = min(rate, max(limit - left, 0.0))
            refused[i] = rate - admitted
            own[i] = left + admitted
        total = sum(own)
        waiting = max(total - slots, 0.0)
        heads = [h.observe(LoadSample(running=min(total, slots) / 3, waiting=waiting / 3), now, slots // 3, POLICY)
                 for h in heads]
        pool = assess([(h, slots // 3) for h in heads], now, POLICY, 0.8)
        states = [admit(states[i], pool, round(own[i]), refused[i] > 0, 4 * slots, ingresses, now, POLICY)
                  for i in range(ingresses)]
        if cycle >= cycles // 2:
            offered += rate * ingresses
            shed += sum(refused)
            waiting_sum += waiting / slots
    return shed / offered, waiting_sum / (cycles - cycles // 2)


@pytest.mark.parametrize("ingresses", [1, 2])
@pytest.mark.parametrize("load", [1.15, 1.2, 1.5, 2.0])
def test_under_overload_the_shed_share_tracks_the_excess_and_the_queue_stays_bounded(load: float,
                                                                                     ingresses: int) -> None:
    """On a fluid model of the fleet, overload by 15 % to 100 % through one Envoy or two
    (each with its own sidecar, --ingresses 2): the controller settles with a shed share
    within 5 points of the excess (1 - 1/load) and the engines' queue near the target
    (0.5 per slot), far below the 3 per slot the safety cap allows."""
    share, queue = _fluid(load, ingresses=ingresses)
    excess = 1 - 1 / load
    print(f"load {load}, {ingresses} ingresses: shed {share:.3f} (excess {excess:.3f}), waiting per slot {queue:.2f}")
    assert excess - 0.05 <= share <= excess + 0.05
    assert queue <= 1.0


def test_below_capacity_the_fluid_fleet_is_never_shed() -> None:
    """At 75 % and 95 % of capacity nothing queues for long, nothing is shed."""
    for load in (0.75, 0.95):
        assert _fluid(load) == (0.0, 0.0)
        assert _fluid(load, ingresses=2) == (0.0, 0.0)


# -- detector: the pool's standing queue (QueueWatch) ----------------------------------------


def watch(queues: list[float], step: float = 2.0, capacity: int = 24, start: QueueWatch | None = None,
          t0: float = 0.0) -> QueueWatch:
    """The watch after probes `step` s apart (a fake clock) seeing `queues` waiting per slot."""
    w = start or QueueWatch()
    for i, q in enumerate(queues):
        pool = sat(full_share=0.0, capacity=capacity, waiting=q * capacity, saturated=False)
        w = w.observe(pool, t0 + i * step, POLICY)
    return w


def test_a_standing_pool_queue_saturates_after_the_hold_a_burst_does_not() -> None:
    """A batch per slot waiting on one probe (the bench's 2 s bursts at 1.75x) is not
    saturation; held for pool_hold_s (2 s: two probes 2 s apart) it is, whatever the
    per-worker rule says (the verdict's reason is "queue")."""
    assert not watch([0.0, 1.2, 0.0, 1.4, 0.1]).on
    assert not watch([1.2], step=0.5).on
    held = watch([0.0, 1.1, 1.2])
    assert held.on and held.signal == pytest.approx(1.2)
    verdict = held.apply(sat(full_share=0.67, waiting=1.2 * 24, saturated=False))
    assert verdict.saturated and verdict.reason == "queue"
    assert watch([0.0, 1.1, 1.2], step=0.5).on is False  # held 0.5 s only (probes 0.5 s apart)
    assert not watch([0.0, 1.1, 1.2, 1.0, 1.3], step=0.5).on  # 1.5 s
    assert watch([0.0, 1.1, 1.2, 1.0, 1.3, 1.1], step=0.5).on  # held 2 s


def test_a_spike_past_pool_burst_saturates_at_once() -> None:
    """2.5 waiting per slot (a 3x spike buries the admitted requests within seconds) is
    saturation on the first probe that sees it."""
    assert watch([0.0, 2.5]).on
    assert not watch([0.0, 2.4]).on


def test_the_watch_clears_only_once_the_queue_is_short() -> None:
    """Once on, the watch holds while the queue is above queue_exit (0.25 per slot): the
    controller keeps it near target_queue (0.5), which must not read as recovery."""
    w = watch([2.6])
    w = watch([0.5, 0.4, 0.3], start=w, t0=2.0)
    assert w.on
    w = watch([0.25], start=w, t0=8.0)
    assert not w.on


def test_without_fresh_metrics_the_watch_starts_over_and_never_saturates() -> None:
    """No worker with fresh metrics (fresh_capacity 0): no signal, not on, and the hold
    starts over, so a stale view never sheds."""
    w = watch([1.5])
    blind = PoolSaturation(saturated=False, full_share=0.0, capacity=24, fresh_capacity=0, waiting=0.0)
    w = w.observe(blind, 2.0, POLICY)
    assert not w.on and w.signal is None and w.since is None
    assert not watch([1.5], start=w, t0=4.0).on  # the hold starts over
    assert not w.apply(blind).saturated


# -- detector: this Envoy's own in-flight (InflightWatch) ------------------------------------


def inflight(counts: list[int], step: float = 0.5, batch: float = 24.0, ingresses: int = 1,
             start: InflightWatch | None = None, t0: float = 0.0, fresh: bool = True) -> InflightWatch:
    """The watch after reads `step` s apart (a fake clock) of this Envoy's in-flight `counts`."""
    pool = replace(sat(saturated=False, capacity=24), batch=batch, fresh_capacity=24 if fresh else 0)
    w = start or InflightWatch()
    for i, n in enumerate(counts):
        w = w.observe(n, pool, ingresses, t0 + i * step, POLICY)
    return w


def test_in_flight_past_twice_the_batch_saturates_after_the_hold_a_two_second_burst_does_not() -> None:
    """48 in flight on a batch of 24 is 1.0 past it: held 2.5 s (six reads 0.5 s apart) it
    is saturation; for the 2 s of a burst at 1.75x it is not."""
    assert not inflight([48] * 5).on  # 2.0 s
    held = inflight([48] * 6)  # 2.5 s
    assert held.on and held.signal == pytest.approx(1.0)
    assert not inflight([48, 48, 48, 30, 48, 48, 48]).on  # a dip starts the hold over
    assert held.apply(sat(saturated=False)).reason == "inflight"


def test_a_spike_past_the_burst_level_saturates_at_once_and_clears_only_when_short() -> None:
    on = inflight([84])  # 84 / 24 - 1 = 2.5
    assert on.on
    assert inflight([40], start=on, t0=1.0).on  # 0.67 past the batch: still on
    assert not inflight([29], start=on, t0=1.0).on  # 0.21: at or under queue_exit, clear


def test_the_batch_and_the_ingresses_scale_the_signal() -> None:
    """Two Envoys each with 24 in flight are 48 on the fleet; an engine batch of 48 (engines
    running more than declared) halves the signal."""
    assert inflight([24], ingresses=2).signal == pytest.approx(1.0)
    assert inflight([48], batch=48.0).signal == pytest.approx(0.0)


def test_without_fresh_engine_metrics_or_its_own_count_the_in_flight_watch_never_saturates() -> None:
    assert not inflight([200] * 10, fresh=False).on
    w = inflight([84])
    assert w.on
    assert w.observe(None, sat(), 1, 1.0, POLICY) == InflightWatch()
    assert w.observe(84, None, 1, 1.0, POLICY) == InflightWatch()


def test_policy_refuses_inconsistent_thresholds() -> None:
    """queue_exit must sit below queue_enter (the hysteresis band), kv_threshold in (0, 1],
    stale_after_s > 0, target_queue >= 0, the watches' levels ordered."""
    for bad in ({"queue_exit": 1.5}, {"kv_threshold": 0.0}, {"stale_after_s": 0.0}, {"target_queue": -0.5},
                {"pool_enter": 3.0}, {"pool_enter": 0.2}, {"pool_hold_s": -1.0}, {"inflight_enter": 0.2},
                {"inflight_enter": 3.0}, {"inflight_hold_s": -1.0}, {"inflight_interval_s": -0.5}):
        with pytest.raises(ValueError):
            SaturationPolicy(**bad)  # type: ignore[arg-type]
    # the watch's levels are checked only while it is on: high queue levels can turn shedding off
    SaturationPolicy(queue_enter=1000, queue_exit=999, pool_enter=1000, pool_burst=1000, inflight_interval_s=0)


def test_runtime_keys_name_the_default_priority_thresholds() -> None:
    """The keys Envoy 1.40 reads for a cluster's DEFAULT-priority circuit breakers."""
    assert breaker_runtime_keys("chat") == ("circuit_breakers.chat.default.max_requests",
                                    "circuit_breakers.chat.default.max_pending_requests")


def test_limiter_refuses_zero_ingresses() -> None:
    """--ingresses 0 would divide by zero: refused when the limiter is built."""
    with pytest.raises(ValueError, match="ingresses"):
        InflightLimiter(EnvoyAdmin("http://127.0.0.1:1"), 0)


def test_limiter_counts_refusals_by_reason_and_leaves_critical_requests_out_of_its_in_flight() -> None:
    """Envoy 1.40 counts a max_requests refusal in upstream_rq_active_overflow and a pending
    one in upstream_rq_pending_overflow: both are refusals, tallied as "cap" at the safety
    cap and "saturated" under the controller's limit. With a HIGH-priority breaker (critical
    traffic), the requests it holds (cap - remaining_rq) are not DEFAULT's in-flight."""
    limiter = InflightLimiter(EnvoyAdmin("http://127.0.0.1:1"), 1)
    base = {"cluster.chat.upstream_rq_active": 30, "cluster.chat.upstream_rq_active_overflow": 5,
            "cluster.chat.upstream_rq_pending_overflow": 1}
    assert limiter._read("chat", base, None, 96) == 30  # the first read only sets the baseline
    assert "chat" not in limiter._refused
    more = {**base, "cluster.chat.upstream_rq_active_overflow": 9}
    assert limiter._read("chat", more, None, 96) == 30
    assert "chat" in limiter._refused
    limiter._refused.clear()
    shedding = Admission(limit=20, shedding=True)
    most = {**more, "cluster.chat.upstream_rq_pending_overflow": 3,
            "cluster.chat.circuit_breakers.high.remaining_rq": 90}
    assert limiter._read("chat", most, shedding, 96) == 24  # 6 critical requests in flight
    assert "chat" in limiter._refused
    limiter._refused.clear()
    assert limiter.shed["chat"] == {"cap": 4, "saturated": 2}
    assert limiter._read("chat", most, shedding, 96) == 24
    assert limiter._read("chat", None, shedding, 96) is None  # Envoy unreadable: unknown, never shed
    assert "chat" not in limiter._refused


class _Failing:
    """A limiter whose watch fails once after `ok` calls (a fault a real Envoy can't produce)."""

    watch_interval_s = 0.01

    def __init__(self, ok: int, enough: int = 0, seen: Any = None) -> None:
        self.calls, self.ok, self.enough, self.seen = 0, ok, enough, seen

    async def watch(self, now: float) -> None:
        self.calls += 1
        if self.seen is not None and self.calls == self.enough:
            self.seen.set()  # the event the test waits on: no polling
        if self.calls > self.ok:
            raise RuntimeError("boom")


def test_the_watch_loop_runs_until_cancelled_and_a_failure_is_logged_not_raised_at_close(
        caplog: pytest.LogCaptureFixture) -> None:
    """The in-flight limiter's loop (`watch_loop`, run from the limiter's start to its close) calls
    its watch every interval until cancelled; if the watch raises, the task ends, the failure is
    logged once, and gathering it at close does not raise (the rest of the shutdown still runs).
    The real limiter's start runs the loop and its close ends it."""
    import asyncio

    from sidecar.outputs.files.limiter import report_end, watch_loop

    async def scenario() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        seen = asyncio.Event()
        steady = _Failing(ok=10**6, enough=3, seen=seen)
        running = asyncio.create_task(watch_loop(steady, loop.time))
        await asyncio.wait_for(seen.wait(), timeout=5)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        assert running.cancelled()
        failing = _Failing(ok=2)
        broken = asyncio.create_task(watch_loop(failing, loop.time), name="limits-watch")
        broken.add_done_callback(report_end)
        done = await asyncio.wait_for(asyncio.gather(broken, return_exceptions=True), timeout=5)
        assert isinstance(done[0], RuntimeError)
        limiter = InflightLimiter(EnvoyAdmin("http://127.0.0.1:1"), 1)
        await limiter.start()
        task = limiter._watching
        assert task is not None and not task.done()
        await limiter.close()
        assert task.cancelled() and limiter._watching is None
        return steady.calls, failing.calls

    with caplog.at_level("ERROR", logger="sidecar.outputs.files.limiter"):
        steady_calls, failing_calls = asyncio.run(scenario())
    assert steady_calls >= 3 and failing_calls == 3
    failed = [r for r in caplog.records if "task.failed" in r.getMessage()]
    assert len(failed) == 1, [r.getMessage() for r in caplog.records]


def test_a_pool_the_limiter_stops_limiting_gets_its_rendered_breakers_back() -> None:
    """A real Envoy's admin runtime: the limiter posts a pool's breaker overrides and its shed share;
    once the pool leaves the cycle's loads (a reload made it strict_dns, or removed it) the overrides
    are removed, so the cluster's rendered breakers apply again (before, the last limit stayed in
    Envoy's admin layer for good, and a shedding pool switched to strict_dns kept refusing at it)."""
    bootstrap = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "layered_runtime": {"layers": [{"name": "static", "static_layer": {}},
                                       {"name": "admin", "admin_layer": {}}]},
        "static_resources": {"clusters": [{"name": name, "type": "STATIC", "connect_timeout": "1s",
                                           "load_assignment": {"cluster_name": name, "endpoints": []}}
                                          for name in ("chat", "code")]},
    }
    keys = (*breaker_runtime_keys("chat"), shed_runtime_key("chat"))

    async def run(url: str) -> tuple[dict[str, str], dict[str, str]]:
        async with EnvoyAdmin(url) as admin:
            limiter = InflightLimiter(admin, 1, sheddable=lambda: ("chat",))
            loads = {pool: PoolLoad(96, sat(full_share=1.0, capacity=16)) for pool in ("chat", "code")}
            await limiter.set_limits(loads, 0.0)
            before = await admin.runtime() or {}
            await limiter.set_limits({"code": loads["code"]}, 1.0)  # chat is no longer the limiter's
            after = await admin.runtime() or {}
            assert "chat" not in limiter.in_force and limiter.in_force.get("code")
        return ({k: v for k, v in before.items() if k in keys}, {k: v for k, v in after.items() if k in keys})

    with EnvoyProcess(bootstrap) as envoy:
        before, after = asyncio.run(run(envoy.admin_url))
    assert set(before) == set(keys), before
    assert after == {}, after
