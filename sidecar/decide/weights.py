"""EDS weights from measured speed and load, and the fleet-level autoscaling signals. Pure.

Weight model. Envoy's least_request with unequal weights picks hosts from an EDF schedule
with dynamic weights weight / (active_requests + 1)^active_request_bias, counting its own
in-flight requests at pick time. So the sidecar leaves the fast-moving part (how many
sequences a worker runs right now) to Envoy and publishes what Envoy cannot see, all of
it slow-moving:

    target = capacity * share * weight_per_slot * speed ** speed_exponent * queue_room * kv_room

- `capacity * share` is confgen's static weight (`confgen.endpoints.static_weight`).
- `speed` is the worker's per-sequence decode speed relative to the fastest of its pool
  (`relative_speeds`: fastest 1.0), from the smoothed time per generated token (`Trend`).
- Why a power of it: under that EDF a host's in-flight count is about its request rate
  times its latency (which goes as 1 / speed), so the rate it gets grows slower than its
  weight. Weights proportional to speed would give every worker about its capacity share,
  which P2C already does, and the slowest worker's long requests would still set the P99.
  The default exponent 3: a half-speed worker gets 1/8 of a full one's weight, so it takes
  the overflow once the fast workers' batches are full.
- `queue_room` = 1 - waiting_penalty * queue / capacity (floored at 0), with `queue` the
  waiting requests smoothed with half-life `queue_half_life_s` (0: the latest count). It
  is for load Envoy cannot see (other clients of the same workers) and is off by default
  (waiting_penalty 0): Envoy's in-flight counts already include the requests it queued.
- `kv_room` is 1 below `kv_knee` and falls linearly to 0 at a full KV cache (new
  sequences would be preempted). Off by default (kv_knee 1). KV pressure still counts for
  saturation (`pool_saturation`, its own knee of 0.8).

The target is scaled by the slow-start ramp, optionally smoothed with an EWMA over the
previously published weight (`smoothing` < 1; its inputs are smoothed already, so the
default publishes the target), then clamped to [1, max_weight]: Envoy rejects a 0 weight,
and a full worker keeps a trickle. The daemon publishes it through the gate of
`sidecar.decide.hysteresis` (a change must matter for routing and last); `weight` is the
ungated form (rounded toward the target, so small steps still converge).

Speed measurement (`Trend.observe`): the deltas of the engine's inter-token latency
histogram (`_sum` / `_count`) between two scrapes give the mean time per token over that
interval. It is folded into a running mean for the first updates, then an EWMA with
half-life `speed_half_life_s`, only when at least `speed_min_tokens` tokens were generated
(an idle worker keeps its estimate); one update after a long pause moves it at most
half-way. A level shift skips the EWMA: `speed_jump_updates` intervals in a row whose
time per token is past the estimate by `speed_jump` (relative) or more, and by
`speed_jump_noise` times the usual deviation of the ordinary intervals (prefill-heavy
traffic makes each interval's mean noisy), on the same side, replace it by their mean.
So the long half-life that keeps a steady fleet's weights (and EDS file) still against
batch-size noise does not delay a worker that slows 2x: it is measured at its new speed
on the second interval after the change. Known bias: time per token grows with the
batch, so a worker that runs a smaller batch looks a little faster than it is. The bias
pushes load back toward the worker it penalises (negative feedback) and the long
half-life keeps that loop far slower than Envoy's, so it settles instead of oscillating.
Engines without the histogram
(TGI, llama.cpp, health-only) have speed 1.0.

Without a sample (health-only engine, unusable metrics) the target is the static weight
`confgen.endpoints.static_weight(capacity, share) * weight_per_slot`, which with the
default weight_per_slot of 1 is exactly what `confgen render` wrote first; so is an idle
fleet's, whose speeds are not measured yet.

How each default was chosen, and what the others measured: docs/architecture.md, "Weight
model and how its defaults were chosen" (the sweep: bench/sweep/, its tables in results.md).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from confgen.endpoints import MAX_WEIGHT, clamp_weight, static_weight
from sidecar.observe.engines import LoadSample

__all__ = ["Trend", "WeightPolicy", "pool_saturation", "queue_depth", "relative_speeds", "smooth", "target", "weight"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class WeightPolicy:
    """Knobs of the weight model (see the module docstring)."""

    max_weight: int = MAX_WEIGHT
    weight_per_slot: float = 1.0
    waiting_penalty: float = 0.0
    kv_knee: float = 1.0  # 1: KV use does not lower the weight (see the module docstring)
    smoothing: float = 1.0  # weight of the new target in the EWMA; 1 = no smoothing
    speed_exponent: float = 3.0
    # While the pool sheds (its in-flight limit follows the shedding controller), weights
    # follow throughput instead: speed^1. speed^3 keeps a slow worker's batch half empty
    # while the fast ones queue, which at 78 % buys latency but under overload wastes the
    # slow worker's capacity; the overload model (bench/sweep/overload.py) measured the
    # false alarms at 78 % 49 -> 25 requests and the same surge figures.
    shedding_speed_exponent: float = 1.0
    speed_half_life_s: float = 20.0
    speed_min_tokens: float = 16.0
    queue_half_life_s: float = 3.0
    speed_jump: float = 0.4  # an interval this far (relative) from the estimate may be a level shift
    speed_jump_updates: int = 2  # ... and this many of them in a row, same side, replace the estimate
    speed_jump_noise: float = 3.0  # the jump is at least this many times the usual deviation

    def __post_init__(self) -> None:
        if not 1 <= self.max_weight <= MAX_WEIGHT or self.weight_per_slot <= 0 or self.waiting_penalty < 0:
            raise ValueError(f"max_weight within 1..{MAX_WEIGHT}, weight_per_slot > 0, waiting_penalty >= 0")
        if not 0 < self.kv_knee <= 1 or not 0 < self.smoothing <= 1:
            raise ValueError("kv_knee and smoothing must be within (0, 1]")
        if self.speed_exponent < 0 or self.shedding_speed_exponent < 0 or self.speed_min_tokens < 1:
            raise ValueError("speed_exponent and shedding_speed_exponent must be >= 0 and speed_min_tokens >= 1")
        if self.speed_half_life_s <= 0 or self.queue_half_life_s < 0:
            raise ValueError("speed_half_life_s must be > 0 and queue_half_life_s >= 0")
        if self.speed_jump <= 0 or self.speed_jump_updates < 1 or self.speed_jump_noise < 0:
            raise ValueError("speed_jump must be > 0, speed_jump_updates >= 1 and speed_jump_noise >= 0")


@dataclass(frozen=True, slots=True)
class Trend:
    """The slow-moving view of one endpoint, updated by `observe` from each scrape.

    `token_latency_s` is the smoothed time per generated token (None until measured);
    `queue` the waiting requests, smoothed with half-life `queue_half_life_s`.
    """

    token_latency_s: float | None = None
    queue: float = 0.0
    at: float | None = None  # time of the last sample taken into account
    speed_at: float | None = None  # time of the last speed update
    speed_updates: int = 0
    latency_sum: float | None = None  # counters at the last speed update (the baseline)
    latency_count: float | None = None
    shift: tuple[float, ...] = ()  # consecutive per-token means past the jump bound, same side
    noise: float = 0.0  # smoothed |per-token mean / estimate - 1| of the ordinary intervals

    def observe(self, sample: LoadSample | None, now: float, policy: WeightPolicy) -> Trend:
        """Take one scrape into account; without a sample (or an older one) nothing changes."""
        if sample is None or (self.at is not None and now < self.at):
            return self
        queue = sample.waiting
        if self.at is not None and policy.queue_half_life_s > 0:
            keep = 0.5 ** ((now - self.at) / policy.queue_half_life_s)
            queue = self.queue * keep + sample.waiting * (1.0 - keep)
        nxt = replace(self, queue=queue, at=now)
        total, count = sample.token_latency_s, sample.token_latency_n
        if total is None or count is None:
            return replace(nxt, latency_sum=None, latency_count=None)
        if self.latency_sum is None or self.latency_count is None or total < self.latency_sum \
                or count < self.latency_count:
            return replace(nxt, latency_sum=total, latency_count=count, speed_at=now)  # first or reset
        tokens = count - self.latency_count
        if tokens < policy.speed_min_tokens:
            return nxt  # keep the baseline: the next scrape's delta covers these tokens too
        per_token = (total - self.latency_sum) / tokens
        updates = self.speed_updates + 1
        shift: tuple[float, ...] = ()
        noise = self.noise
        if self.token_latency_s is None:
            latency = per_token
        else:
            elapsed = now - (self.speed_at if self.speed_at is not None else now)
            # The plain mean of the first updates (1/n), then the EWMA: a first noisy
            # interval does not stick for a half-life, and one late update moves it at most
            # half-way.
            alpha = max(min(1.0 - 0.5 ** (elapsed / policy.speed_half_life_s), 0.5), 1.0 / updates)
            latency = self.token_latency_s + alpha * (per_token - self.token_latency_s)
            deviation = abs(per_token / self.token_latency_s - 1.0) if self.token_latency_s > 0 else 0.0
            bound = max(policy.speed_jump, policy.speed_jump_noise * self.noise)
            if deviation < bound:
                noise = self.noise + alpha * (deviation - self.noise)
            else:
                shift = _level_shift(self.shift, per_token, self.token_latency_s)
                if len(shift) >= policy.speed_jump_updates:
                    latency, shift = sum(shift) / len(shift), ()
        return replace(nxt, token_latency_s=latency, latency_sum=total, latency_count=count, speed_at=now,
                       speed_updates=updates, shift=shift, noise=noise)


def _level_shift(pending: tuple[float, ...], per_token: float, estimate: float) -> tuple[float, ...]:
    """`pending` with `per_token` appended, restarted when it lies on the other side."""
    if pending and (pending[0] > estimate) != (per_token > estimate):
        return (per_token,)
    return (*pending, per_token)


def relative_speeds(latencies: Mapping[K, float | None]) -> dict[K, float]:
    """Per-sequence speed relative to the fastest endpoint of a pool (fastest = 1.0).

    `latencies` are `Trend.token_latency_s` values; an endpoint without one gets 1.0, as
    the weight model would have it without a speed signal.
    """
    known = [t for t in latencies.values() if t is not None and t > 0]
    fastest = min(known, default=None)
    return {key: 1.0 if fastest is None or t is None or t <= 0 else fastest / t for key, t in latencies.items()}


def weight(
    sample: LoadSample | None,
    capacity: int,
    previous: int | None,
    policy: WeightPolicy,
    ramp: float = 1.0,
    share: int = 1,
    speed: float = 1.0,
    queue: float | None = None,
) -> int:
    """EDS weight in [1, max_weight] for one endpoint; `previous` is the last published one.

    `share` is the worker's static weight from the topology: it multiplies the target.
    `speed` is the endpoint's relative speed (`relative_speeds`), `queue` its smoothed
    waiting requests (`Trend.queue`; the sample's own count when None).
    """
    goal = target(sample, capacity, policy, ramp=ramp, share=share, speed=speed, queue=queue)
    if previous is not None:
        blended = policy.smoothing * goal + (1 - policy.smoothing) * previous
        # Round toward the target, so that from previous=1 a target of 2 is reached.
        goal = math.ceil(blended) if goal > previous else math.floor(blended)
    return clamp_weight(goal, policy.max_weight)


def target(
    sample: LoadSample | None,
    capacity: int,
    policy: WeightPolicy,
    ramp: float = 1.0,
    share: int = 1,
    speed: float = 1.0,
    queue: float | None = None,
) -> float:
    """The unrounded, unsmoothed weight `weight` aims at (the slow-start ramp applied).

    The publish gate (`sidecar.decide.hysteresis`) compares this with the published weight, so
    that rounding noise around a fractional target never reaches Envoy.
    """
    if capacity < 1 or share < 1:
        raise ValueError(f"capacity and share must be >= 1, got {capacity} and {share}")
    return _target(sample, capacity, share, policy, speed, queue) * min(max(ramp, 0.0), 1.0)


def smooth(goal: float, previous: int | None, policy: WeightPolicy) -> float:
    """The EWMA of `goal` over the published weight (`policy.smoothing`; 1: `goal` itself)."""
    if previous is None or policy.smoothing >= 1:
        return goal
    return policy.smoothing * goal + (1 - policy.smoothing) * previous


def _target(
    sample: LoadSample | None, capacity: int, share: int, policy: WeightPolicy, speed: float, queue: float | None
) -> float:
    static = static_weight(capacity, share, policy.max_weight) * policy.weight_per_slot
    if sample is None:
        return static
    waiting = sample.waiting if queue is None else queue
    queue_room = max(1.0 - policy.waiting_penalty * waiting / capacity, 0.0)
    kv = sample.kv_usage
    kv_room = 1.0
    if kv is not None and kv > policy.kv_knee:
        kv_room = max(1.0 - kv, 0.0) / (1.0 - policy.kv_knee) if policy.kv_knee < 1 else 0.0
    return static * math.pow(min(max(speed, 0.0), 1.0), policy.speed_exponent) * queue_room * kv_room


def pool_saturation(
    samples: Mapping[K, LoadSample | None], capacities: Mapping[K, int], kv_knee: float = 0.8
) -> float:
    """Fleet saturation: 1.0 means full, above 1 means requests queue.

    max(sum(running + waiting) / sum(capacity), mean(kv_usage) / kv_knee) over the
    endpoints that have a sample and a capacity. Slots are the fleet-wide analogue of the
    peers' per-endpoint max(waiting/5, kv/0.8): declared capacity replaces the arbitrary
    queue length 5, and KV pressure still counts when long contexts fill the cache before
    the slots are used. 0.0 when no endpoint has a sample.
    """
    load = 0.0
    capacity = 0
    kv: list[float] = []
    for key, sample in samples.items():
        cap = capacities.get(key)
        if sample is None or cap is None or cap < 1:
            continue
        load += sample.running + sample.waiting
        capacity += cap
        if sample.kv_usage is not None:
            kv.append(sample.kv_usage)
    if capacity == 0:
        return 0.0
    kv_pressure = sum(kv) / len(kv) / kv_knee if kv else 0.0
    return max(load / capacity, kv_pressure)


def queue_depth(samples: Mapping[K, LoadSample | None]) -> float:
    """Requests waiting across the fleet (the `llm_queue_depth` autoscaling signal)."""
    return sum(s.waiting for s in samples.values() if s is not None)
