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
  (1.5: a batch and a half waiting; at 1.0 a 4-worker fleet of 4-slot engines shed 6-12
  of ~880 requests in bursts at ~90 % load, at 1.5 none, and overload is caught a cycle
  or two later), or when its KV use is at least `kv_threshold` while the
  smoothed queue is at least `queue_exit` of the batch it runs (a KV-bound engine runs
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

While saturated (`admit`), the in-flight limit of this Envoy follows a proportional
controller on the pool's smoothed waiting queue:

    limit = active + gain x (target_queue x capacity - waiting) / ingresses

`active` is this Envoy's requests in flight to the pool. The first saturated cycle caps
admission near the current in-flight; when the limit binds, active ~ limit and the rule
moves the limit by `gain` of the error per cycle, settling where the engines hold
`target_queue` waiting requests per slot: batches stay full (throughput at the fleet's
best) while a new request waits at most about half a batch, so admitted latency stays
bounded and the excess, not more, gets 429 at once (Envoy overflows past the limit
instead of queueing). `gain` 0.5 keeps the loop damped even when the queue answers one
cycle late; `/ ingresses` because every Envoy sharing the fleet runs the same rule on the
same queue. The limit stays within [1, cap], cap being the render's safety cap.

Release: once the pool is no longer saturated the limit only rises (by the same rule,
the queue being short), and returns to the safety cap once it has refused no request
for `release_after_s`. A queue kept short by the limit itself (requests still refused)
is still saturation, so the loop does not open the gate to the whole excess, saturate
again and swing.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from sidecar.observe.engines import LoadSample

__all__ = ["Admission", "Headroom", "PoolLoad", "PoolSaturation", "SaturationPolicy", "admit", "assess"]

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
    gain: float = 0.5
    release_after_s: float = 4.0

    def __post_init__(self) -> None:
        if not 0 <= self.queue_exit < self.queue_enter:
            raise ValueError("queue_exit must be >= 0 and below queue_enter")
        if not 0 < self.kv_threshold <= 1:
            raise ValueError("kv_threshold must be within (0, 1]")
        if self.queue_half_life_s < 0 or self.lookahead_s < 0 or self.release_after_s < 0:
            raise ValueError("queue_half_life_s, lookahead_s and release_after_s must be >= 0")
        if self.stale_after_s <= 0 or self.target_queue < 0 or not 0 < self.gain <= 1:
            raise ValueError("stale_after_s must be > 0, target_queue >= 0 and gain within (0, 1]")


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


@dataclass(frozen=True, slots=True)
class PoolSaturation:
    """The detector's verdict on one pool (`assess`)."""

    saturated: bool
    full_share: float  # share of the capacity in rotation without headroom (fresh metrics)
    capacity: int  # declared capacity of the workers in rotation
    fresh_capacity: int  # ... of those with fresh metrics
    waiting: float  # waiting requests of the workers with fresh metrics (latest samples)
    in_flight: float = 0.0  # running + waiting of the workers with fresh metrics (latest samples)


def assess(workers: Iterable[tuple[Headroom, int]], now: float, policy: SaturationPolicy,
           max_utilization: float) -> PoolSaturation:
    """`workers`: (headroom, declared capacity) of each worker in rotation."""
    capacity = fresh_capacity = full_capacity = 0
    waiting = in_flight = 0.0
    for headroom, cap in workers:
        capacity += cap
        if not headroom.fresh(now, policy):
            continue
        fresh_capacity += cap
        waiting += headroom.waiting
        in_flight += headroom.waiting + headroom.running
        if headroom.full:
            full_capacity += cap
    share = full_capacity / capacity if capacity else 0.0
    return PoolSaturation(saturated=capacity > 0 and share >= max_utilization - 1e-9, full_share=share,
                          capacity=capacity, fresh_capacity=fresh_capacity, waiting=waiting, in_flight=in_flight)


@dataclass(frozen=True, slots=True)
class Admission:
    """The controller's state for one pool: the limit it wants Envoy to hold."""

    limit: int
    shedding: bool = False  # the limit follows the controller (saturated, or releasing)
    clear_since: float | None = None  # when the pool stopped looking saturated


def admit(previous: Admission | None, pool: PoolSaturation, active: int | None, refused: bool, cap: int,
          ingresses: int, now: float, policy: SaturationPolicy) -> Admission:
    """The next in-flight limit for this Envoy (see the module docstring); within [1, cap].

    `active`: this Envoy's requests in flight to the pool (None: unknown). `refused`: the
    limit refused requests since the previous call (demand is past it).
    """
    cap = max(cap, 1)
    prev = previous if previous is not None and previous.shedding else None
    if pool.saturated:
        if active is None:  # cannot see our own in-flight: hold what is in force, never shed blindly
            return prev if prev is not None else Admission(limit=cap)
        return Admission(limit=_controlled(pool, active, cap, ingresses, policy), shedding=True)
    if prev is None:
        return Admission(limit=cap)
    # Not saturated any more: only raise the limit, and go back to the cap once it has
    # refused nothing for release_after_s (a short queue held short by the limit itself is
    # still saturation).
    limit = max(prev.limit, _controlled(pool, active, cap, ingresses, policy) if active is not None else 0)
    since = None if refused else (prev.clear_since if prev.clear_since is not None else now)
    if since is not None and now - since >= policy.release_after_s:
        return Admission(limit=cap)
    return Admission(limit=limit, shedding=True, clear_since=since)


def _controlled(pool: PoolSaturation, active: int, cap: int, ingresses: int, policy: SaturationPolicy) -> int:
    error = policy.target_queue * pool.fresh_capacity - pool.waiting
    wanted = active + policy.gain * error / ingresses
    return min(max(math.floor(wanted + 0.5), 1), cap)


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """What the limit of one pool is computed from."""

    cap: int  # the render's safety cap (confgen.model.in_flight_cap)
    saturation: PoolSaturation
