"""EDS weights from measured load, and the fleet-level autoscaling signals. Pure.

Weight model: an endpoint's weight is the number of sequences it can still take, so a
big idle worker draws more than a small one and a busy one draws little:

    free = (capacity - running - waiting_penalty * waiting) * kv_headroom * ramp

`capacity` is the declared max concurrent sequences. Waiting requests weigh double by
default: a queue only forms once the batch is full, so each one is load the worker has
not even started. `kv_headroom` is 1 below `kv_knee` (0.8, the peers' saturation knee)
and falls linearly to 0 at a full KV cache (new sequences would be preempted). The
target is multiplied by the worker's static share (the topology's `weight`), smoothed
with an EWMA over the previously published weight and rounded toward the target (so
small steps still converge instead of sticking), then clamped to [1, max_weight]: Envoy
rejects a 0 weight, and a full worker keeps a trickle.

Without a sample (health-only engine, unusable metrics) the target is the static weight
`confgen.envoy.eds.static_weight(capacity, share) * weight_per_slot`, which with the
default weight_per_slot of 1 is exactly what `confgen render` wrote first.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from confgen.envoy.eds import MAX_WEIGHT, clamp_weight, static_weight
from sidecar.engines import LoadSample

__all__ = ["WeightPolicy", "pool_saturation", "queue_depth", "weight"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class WeightPolicy:
    """Knobs of the weight model (see the module docstring)."""

    max_weight: int = MAX_WEIGHT
    weight_per_slot: float = 1.0
    waiting_penalty: float = 2.0
    kv_knee: float = 0.8
    smoothing: float = 0.5  # weight of the new target in the EWMA; 1 = no smoothing

    def __post_init__(self) -> None:
        if not 1 <= self.max_weight <= MAX_WEIGHT or self.weight_per_slot <= 0 or self.waiting_penalty < 0:
            raise ValueError(f"max_weight within 1..{MAX_WEIGHT}, weight_per_slot > 0, waiting_penalty >= 0")
        if not 0 < self.kv_knee <= 1 or not 0 < self.smoothing <= 1:
            raise ValueError("kv_knee and smoothing must be within (0, 1]")


def weight(
    sample: LoadSample | None,
    capacity: int,
    previous: int | None,
    policy: WeightPolicy,
    ramp: float = 1.0,
    share: int = 1,
) -> int:
    """EDS weight in [1, max_weight] for one endpoint; `previous` is the last published one.

    `share` is the worker's static weight from the topology: it multiplies the target.
    """
    if capacity < 1 or share < 1:
        raise ValueError(f"capacity and share must be >= 1, got {capacity} and {share}")
    target = _target(sample, capacity, share, policy) * min(max(ramp, 0.0), 1.0)
    if previous is not None:
        blended = policy.smoothing * target + (1 - policy.smoothing) * previous
        # Round toward the target, so that from previous=1 a target of 2 is reached.
        target = math.ceil(blended) if target > previous else math.floor(blended)
    return clamp_weight(target, policy.max_weight)


def _target(sample: LoadSample | None, capacity: int, share: int, policy: WeightPolicy) -> float:
    if sample is None:
        return static_weight(capacity, share, policy.max_weight) * policy.weight_per_slot
    free = capacity - sample.running - policy.waiting_penalty * sample.waiting
    kv = sample.kv_usage
    headroom = 1.0
    if kv is not None and kv > policy.kv_knee:
        headroom = max(1.0 - kv, 0.0) / (1.0 - policy.kv_knee) if policy.kv_knee < 1 else 0.0
    return max(free, 0.0) * headroom * share * policy.weight_per_slot


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
