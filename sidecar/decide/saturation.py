"""Is a pool saturated, from what its engines report; and how much to admit while it is. Pure.

The in-flight count through the proxy is not a saturation signal: it includes the requests
waiting in the engines' own queues, so it passes any share of the slots at normal load.
What an engine cannot hide is its own waiting queue and its KV-cache use. The rule, in the
spirit of the Gateway API Inference Extension's saturation detector (a server has headroom
while its queue is under 5 and its KV use under 0.8, on metrics fresher than 200 ms; the
pool is saturated when no server has headroom), with these differences:

Per worker (`Headroom.observe`, one call per probe cycle):
- The queue is measured per declared slot, `waiting / capacity`, and smoothed (EWMA,
  half-life `queue_half_life_s`): a fixed count of 5 is a full batch for one engine and
  noise for another, and a single sample is a burst, not saturation.
- Trend: once the smoothed queue has risen on two samples in a row it is projected
  `lookahead_s` ahead along its rise, so a queue that grows cycle after cycle is caught
  before it is long, while a single jump (a burst) is only smoothed.
- Hysteresis: a worker loses its headroom when the projected queue reaches `queue_enter`
  (1.5: a batch and a half waiting), or when its KV use is at least `kv_threshold` while
  the smoothed queue is at least `queue_exit` of the batch it runs (a KV-bound engine runs
  fewer sequences than its slots, so its queue per slot stays short when it is full). It
  regains it only once the smoothed queue is at most `queue_exit` per slot and no KV
  pressure holds it.
- Fresh metrics only: a worker without a sample (probe failed, health-only engine) or
  whose sample is older than `stale_after_s` has headroom as far as shedding goes, and
  its trend starts over. Stale or missing metrics never trigger shedding.

Per pool (`assess`): the pool is saturated when the workers without headroom hold at
least `max_utilization` (the topology's `backpressure.max_utilization`) of the declared
capacity of the workers in rotation. With least_request the workers with headroom take
the load the others cannot, so the default 0.8 sheds only when little room is left.

Per pool, the standing queue (`QueueWatch`, the daemon runs it once per cycle and adds its
verdict): the pool's waiting requests per declared slot (fresh metrics only) at least
`pool_enter` (1.0) on every probe for `pool_hold_s` (2 s), or `pool_burst` (2.5) at once.
It sees the surge the per-worker rule cannot: a queue on the fast workers while the
speed-weighted balancer keeps the slow worker's short, so the workers without headroom
hold less than `max_utilization` of the capacity.

While saturated (`admit`), this Envoy's in-flight limit is set at once to its share of
what the fleet can hold with full batches and half a batch waiting:

    limit = (1 + target_queue) x batch / ingresses

`batch` is what the workers in rotation can run at once (`PoolSaturation.batch`): each
worker's declared slots, its running count when it runs more than that, or, when its KV
cache is full and requests wait (KV-bound), what it runs. Load the engines hold that did
not come through the Envoys counted (their requests in flight, running + waiting, past
this Envoy's in-flight x ingresses: clients that bypass the proxy, an Envoy not counted
in `--ingresses`) is taken off first, so it is not buried; critical requests ride the
HIGH-priority breaker and are not in `active`, so they count here too: the DEFAULT limit
makes room for them. With several Envoys whose traffic is uneven this errs toward
refusing the lighter one. In flight past the limit, Envoy
answers 429 at once (it overflows instead of queueing); the requests already in flight are
never cancelled, so the backlog built before the limit acts drains at the fleet's full
rate, then admission follows completions: throughput stays at the fleet's best while a new
request waits about half a batch, and the excess, not more, is refused. Every Envoy
sharing the fleet holds the same share (`/ ingresses`: file mode's `--ingresses`, ADS's
connected Envoys), so together they admit what one Envoy would.

Release: once the pool is no longer saturated the limit stays, and returns to the safety
cap once it has refused no request for `release_after_s`. A queue kept short by the limit
itself (requests still refused) is still saturation, so the gate does not open to the
whole excess, saturate again and swing.

Why these rules and values, what they were chosen over and the measurements behind them:
docs/architecture.md, "Backpressure sheds measured saturation, not slot counts" and "A
pool-level standing queue beside the per-worker rule" (the model: bench/sweep/overload.py).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

from sidecar.observe.engines import LoadSample

__all__ = ["Admission", "Headroom", "InflightWatch", "PoolLoad", "PoolSaturation", "QueueWatch", "SaturationPolicy",
           "admit", "assess", "setpoint"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class SaturationPolicy:
    """Knobs of the detector and the controller (see the module docstring)."""

    queue_enter: float = 1.5
    queue_exit: float = 0.25
    kv_threshold: float = 0.8
    queue_half_life_s: float = 2.0
    lookahead_s: float = 2.0
    stale_after_s: float = 5.0
    target_queue: float = 0.5
    release_after_s: float = 4.0
    # The pool's standing queue (`QueueWatch`): waiting requests per declared slot over the
    # workers with fresh metrics.
    pool_enter: float = 1.0
    pool_hold_s: float = 2.0
    pool_burst: float = 2.5
    # This Envoy's own in-flight count between probes (`InflightWatch`; file target only):
    # in flight past the batch, per unit of batch, read every `inflight_interval_s` (0: off).
    inflight_interval_s: float = 0.5
    inflight_enter: float = 1.0
    inflight_hold_s: float = 2.5
    inflight_burst: float = 2.5

    def __post_init__(self) -> None:
        if not 0 <= self.queue_exit < self.queue_enter:
            raise ValueError("queue_exit must be >= 0 and below queue_enter")
        if not 0 < self.kv_threshold <= 1:
            raise ValueError("kv_threshold must be within (0, 1]")
        if self.queue_half_life_s < 0 or self.lookahead_s < 0 or self.release_after_s < 0:
            raise ValueError("queue_half_life_s, lookahead_s and release_after_s must be >= 0")
        if self.stale_after_s <= 0 or self.target_queue < 0:
            raise ValueError("stale_after_s must be > 0 and target_queue >= 0")
        if not self.queue_exit < self.pool_enter <= self.pool_burst or self.pool_hold_s < 0:
            raise ValueError("need queue_exit < pool_enter <= pool_burst and pool_hold_s >= 0")
        if self.inflight_interval_s < 0:
            raise ValueError("inflight_interval_s must be >= 0 (0: no in-flight watch)")
        if self.inflight_interval_s > 0 and (not self.queue_exit < self.inflight_enter <= self.inflight_burst
                                             or self.inflight_hold_s < 0):
            raise ValueError("with the in-flight watch on, need queue_exit < inflight_enter <= inflight_burst and "
                             "inflight_hold_s >= 0 (inflight_interval_s=0 turns it off)")


@dataclass(frozen=True, slots=True)
class Headroom:
    """One worker's view for the detector: smoothed queue per slot, its trend, and whether
    it has headroom (`full` False). `at` is the time of the last sample taken in."""

    full: bool = False
    queue: float = 0.0  # smoothed waiting requests per declared slot
    slope: float = 0.0  # of the smoothed queue, per second
    rising: int = 0  # consecutive samples on which the smoothed queue rose
    kv: float | None = None
    waiting: float = 0.0  # the latest sample's waiting requests (what the controller reads)
    running: float = 0.0  # the latest sample's running sequences
    at: float | None = None

    def observe(self, sample: LoadSample | None, at: float, capacity: int, policy: SaturationPolicy) -> Headroom:
        """Take one probe result into account (`at`: when it was taken)."""
        if sample is None or capacity < 1:
            return Headroom()  # missing metrics: headroom as far as shedding goes; the trend starts over
        if self.at is not None and at <= self.at:
            return self  # not newer than what we have
        raw = max(sample.waiting, 0.0) / capacity
        if self.at is None or at - self.at > policy.stale_after_s:
            queue, slope, rising = raw, 0.0, 0
        else:
            dt = at - self.at
            keep = 0.5 ** (dt / policy.queue_half_life_s) if policy.queue_half_life_s > 0 else 0.0
            queue = self.queue * keep + raw * (1.0 - keep)
            slope = (queue - self.queue) / dt
            rising = self.rising + 1 if slope > 0 else 0
        kv = sample.kv_usage
        # KV-bound: the engine runs fewer sequences than its slots, so its queue is weighed
        # against the batch it actually runs.
        batch = min(max(sample.running, 1.0), float(capacity))
        kv_held = kv is not None and kv >= policy.kv_threshold and queue * capacity >= policy.queue_exit * batch
        if self.full:
            full = queue > policy.queue_exit or kv_held
        else:
            # The rise is projected only once it has lasted two samples: one jump is a burst.
            trend = slope * policy.lookahead_s if rising >= 2 else 0.0
            full = queue + trend >= policy.queue_enter or kv_held
        return Headroom(full=full, queue=queue, slope=slope, rising=rising, kv=kv, waiting=max(sample.waiting, 0.0),
                        running=max(sample.running, 0.0), at=at)

    def fresh(self, now: float, policy: SaturationPolicy) -> bool:
        return self.at is not None and now - self.at <= policy.stale_after_s

    def batch(self, capacity: int, policy: SaturationPolicy) -> float:
        """What this worker can run at once: its declared slots, what it runs when that is
        more, or what it runs while its KV cache is full and requests wait (KV-bound)."""
        if self.kv is not None and self.kv >= policy.kv_threshold and self.waiting > 0:
            return max(min(self.running, float(capacity)), 1.0)
        return max(float(capacity), self.running)


@dataclass(frozen=True, slots=True)
class PoolSaturation:
    """The detector's verdict on one pool (`assess`)."""

    saturated: bool
    full_share: float  # share of the capacity in rotation without headroom (fresh metrics)
    capacity: int  # declared capacity of the workers in rotation
    fresh_capacity: int  # ... of those with fresh metrics
    waiting: float  # waiting requests of the workers with fresh metrics (latest samples)
    in_flight: float = 0.0  # running + waiting of the workers with fresh metrics (latest samples)
    reason: str = ""  # why saturated: "headroom" (per-worker rule), "queue" (standing queue), "inflight" (Envoy's)
    batch: float = 0.0  # what the workers in rotation can run at once (0: unknown, the capacity is used)


def _trimmed(values: list[float], caps: list[int]) -> list[float]:
    """`values` (per worker) with the largest per declared slot counted up to one batch of its own (its
    declared slots), beyond that as far as the next largest: what one worker reports past every other
    worker of its pool moves the pool by its own share at most (a worker may misreport its load, as a
    compromised or broken engine does: its queue of 1e12 made the whole pool shed, its 1e12 running would
    have raised the batch past any shedding). A load the fleet really has shows on more than one worker;
    a pool of one is its own."""
    if len(values) < 2:
        return values
    per_slot = [v / max(c, 1) for v, c in zip(values, caps, strict=True)]
    top = max(range(len(values)), key=per_slot.__getitem__)
    second = max(q for i, q in enumerate(per_slot) if i != top)
    out = list(values)
    out[top] = min(values[top], max(second, 1.0) * max(caps[top], 1))
    return out


def assess(workers: Iterable[tuple[Headroom, int]], now: float, policy: SaturationPolicy,
           max_utilization: float) -> PoolSaturation:
    """`workers`: (headroom, declared capacity) of each worker in rotation. The pool's waiting and in-flight
    figures take each worker's as reported, but the one that reports the most per slot counts a batch of its
    own at most beyond what the next one reports (`_trimmed`)."""
    capacity = fresh_capacity = full_capacity = 0
    batch = 0.0
    fresh: list[tuple[Headroom, int]] = []
    for headroom, cap in workers:
        capacity += cap
        if not headroom.fresh(now, policy):
            batch += cap
            continue
        fresh.append((headroom, cap))
        fresh_capacity += cap
        if headroom.full:
            full_capacity += cap
    caps = [cap for _, cap in fresh]
    queued = _trimmed([h.waiting for h, _ in fresh], caps)
    # running past the declared slots raises the batch (an engine that runs more than declared), trimmed alike
    beyond = _trimmed([max(0.0, h.running - cap) for h, cap in fresh], caps)
    running = [min(h.running, cap + extra) for (h, cap), extra in zip(fresh, beyond, strict=True)]
    waiting = sum(queued)
    in_flight = waiting + sum(running)
    for (headroom, cap), run in zip(fresh, running, strict=True):
        batch += min(headroom.batch(cap, policy), max(float(cap), run))
    share = full_capacity / capacity if capacity else 0.0
    saturated = capacity > 0 and share >= max_utilization - 1e-9
    return PoolSaturation(saturated=saturated, full_share=share, capacity=capacity, fresh_capacity=fresh_capacity,
                          waiting=waiting, in_flight=in_flight, reason="headroom" if saturated else "", batch=batch)


def _standing(since: float | None, on: bool, signal: float, now: float, enter: float, hold_s: float, burst: float,
              leave: float) -> tuple[float | None, bool]:
    """The rule both watches share: (since when the signal has been >= `enter` on every
    read, on). On once held `hold_s` or at `burst` at once; off again at `leave` or below."""
    since = (since if since is not None else now) if signal >= enter else None
    if on:
        return since, signal > leave
    return since, signal >= burst or (since is not None and now - since >= hold_s - 1e-9)


@dataclass(frozen=True, slots=True)
class QueueWatch:
    """The pool's standing queue, CoDel's idea on the engines' waiting queues.

    The signal is the pool's waiting requests per declared slot over the workers with fresh
    metrics (`PoolSaturation.waiting / fresh_capacity`), read at each probe. The pool is
    saturated once the signal has been at least `pool_enter` on every probe for
    `pool_hold_s` (a queue that stands, not a burst the fleet absorbs), or at once when it
    reaches `pool_burst` (a spike: a few seconds of it would bury the admitted requests).
    It stays so until the signal is at most `queue_exit`; the controller's release rule
    (`admit`) then decides when the limit returns to the cap. Per pool rather than per
    worker: with least_request's weights the load (and the queue) sits on the fast
    workers while a slow one keeps headroom, so a share of workers without headroom can
    stay under `max_utilization` through a whole surge (measured: bench/sweep/overload.py).
    Without fresh metrics the watch starts over: stale or missing metrics never shed.
    """

    since: float | None = None  # since when the signal has been >= pool_enter on every probe
    on: bool = False
    signal: float | None = None  # the last signal (None: no fresh metrics)

    def observe(self, pool: PoolSaturation, now: float, policy: SaturationPolicy) -> QueueWatch:
        if pool.fresh_capacity < 1:
            return QueueWatch()
        signal = pool.waiting / pool.fresh_capacity
        since, on = _standing(self.since, self.on, signal, now, policy.pool_enter, policy.pool_hold_s,
                              policy.pool_burst, policy.queue_exit)
        return QueueWatch(since=since, on=on, signal=signal)

    def apply(self, pool: PoolSaturation) -> PoolSaturation:
        """`pool` with this watch's verdict added (the per-worker headroom rule stands too)."""
        if pool.saturated or not self.on:
            return pool
        return replace(pool, saturated=True, reason="queue")


@dataclass(frozen=True, slots=True)
class InflightWatch:
    """This Envoy's own requests in flight to the pool, read between probes (file target).

    The engines' queue is seen once per probe (2 s); Envoy's in-flight count is as fresh as
    an admin call, and a surge shows in it first. The signal is the in-flight past the
    batch the fleet can run, per unit of batch: `in_flight x ingresses / batch - 1` (this
    Envoy's share scaled to the fleet; `batch` from the last probe's verdict, so an engine
    that runs more than its declared slots raises it). The pool is saturated once the
    signal has been at least `inflight_enter` on every read for `inflight_hold_s` (2.5 s:
    longer than the 2 s bursts at 1.75x the bench's bursty fleet absorbs), or at once at
    `inflight_burst` (a spike); clear again at `queue_exit` or below. Only while the last
    verdict had fresh engine metrics: stale or missing metrics never shed. What it gained
    in the virtual-time model: docs/architecture.md ("A pool-level standing queue").
    """

    since: float | None = None
    on: bool = False
    signal: float | None = None

    def observe(self, in_flight: int | None, pool: PoolSaturation | None, ingresses: int, now: float,
                policy: SaturationPolicy) -> InflightWatch:
        """`pool`: the last probe's verdict for the pool (None: none yet)."""
        if in_flight is None or pool is None or pool.fresh_capacity < 1:
            return InflightWatch()
        batch = pool.batch if pool.batch > 0 else float(pool.capacity)
        if batch <= 0:
            return InflightWatch()
        signal = in_flight * max(ingresses, 1) / batch - 1.0
        since, on = _standing(self.since, self.on, signal, now, policy.inflight_enter, policy.inflight_hold_s,
                              policy.inflight_burst, policy.queue_exit)
        return InflightWatch(since=since, on=on, signal=signal)

    def apply(self, pool: PoolSaturation) -> PoolSaturation:
        """`pool` with this watch's verdict added."""
        if pool.saturated or not self.on:
            return pool
        return replace(pool, saturated=True, reason="inflight")


@dataclass(frozen=True, slots=True)
class Admission:
    """The controller's state for one pool: the limit it wants Envoy to hold."""

    limit: int
    shedding: bool = False  # the limit follows the controller (saturated, or releasing)
    clear_since: float | None = None  # when the pool stopped looking saturated


def admit(previous: Admission | None, pool: PoolSaturation, active: int | None, refused: bool, cap: int,
          ingresses: int, now: float, policy: SaturationPolicy) -> Admission:
    """The next in-flight limit for this Envoy (see the module docstring); within [1, cap].

    `active`: this Envoy's requests in flight to the pool (None: unknown, and then shedding
    never starts). `refused`: the limit refused requests since the previous call (demand is
    past it).
    """
    cap = max(cap, 1)
    prev = previous if previous is not None and previous.shedding else None
    if pool.saturated:
        if active is None:  # cannot see our own in-flight: hold what is in force, never shed blindly
            return prev if prev is not None else Admission(limit=cap)
        return Admission(limit=setpoint(pool, cap, ingresses, policy, active), shedding=True)
    if prev is None:
        return Admission(limit=cap)
    # Not saturated any more: keep the limit, and go back to the cap once it has refused
    # nothing for release_after_s (a short queue held short by the limit itself is still
    # saturation).
    since = None if refused else (prev.clear_since if prev.clear_since is not None else now)
    if since is not None and now - since >= policy.release_after_s:
        return Admission(limit=cap)
    fresh = setpoint(pool, cap, ingresses, policy, active) if active is not None else prev.limit
    return Admission(limit=max(prev.limit, fresh), shedding=True, clear_since=since)


def setpoint(pool: PoolSaturation, cap: int, ingresses: int, policy: SaturationPolicy, active: int = 0) -> int:
    """This Envoy's share of full batches plus `target_queue` of a batch waiting, less its
    share of the load the engines hold that did not come through the Envoys counted
    (`pool.in_flight` past `active` x ingresses: load that bypasses them); in [1, cap]."""
    ingresses = max(ingresses, 1)
    batch = pool.batch if pool.batch > 0 else float(pool.capacity)
    outside = max(0.0, pool.in_flight - active * ingresses)
    wanted = ((1.0 + policy.target_queue) * batch - outside) / ingresses
    return min(max(math.floor(wanted + 0.5), 1), cap)


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """What the limit of one pool is computed from."""

    cap: int  # the render's safety cap (confgen.model.in_flight_cap)
    saturation: PoolSaturation
