"""Publish gate for weights: which changes are worth an EDS write. Pure: no clock, no I/O.

Every EDS write makes Envoy rebuild the pool's load-balancer state (and restarts its
weighted scheduler), so a weight is republished only when the change matters for routing:

- The gate compares the unrounded target (`sidecar.decide.weights.target`) with the weight
  published last, not two rounded values, so a target that sits near x.5 never makes the
  published weight flip between two integers.
- A change counts when the target is at least `threshold` (relative) AND `min_step`
  weight units away from the published weight, and its rounding differs from it.
- It is published once it has counted on `sustain` consecutive cycles (one noisy probe
  is not enough); an endpoint whose target falls back inside the band resets its streak.
- `immediate` (slow start, a return to service) publishes as soon as a change counts.
  Health, drain and membership changes never pass through the gate: the daemon publishes
  them on the cycle they happen, and the gated weights of the other endpoints go with them.

The state of one endpoint is (published weight, streak), carried by the caller; `gate`
returns the next one. The defaults (threshold 0.2, sustain 2, min_step 1) were chosen in
bench/sweep (results.md, "publish gate"): the smallest band whose 2x slowdown is
republished within 3 probe cycles, with 0, 1 and 0 EDS writes after the first minute of
five steady minutes on three chat fleets (tests/bench/test_sweep.py pins both).
"""

from __future__ import annotations

from dataclasses import dataclass

from confgen.endpoints import MAX_WEIGHT, clamp_weight

__all__ = ["Gated", "HysteresisPolicy", "gate"]


@dataclass(frozen=True, slots=True)
class HysteresisPolicy:
    """When a weight change is published (see the module docstring)."""

    threshold: float = 0.2  # relative distance from the published weight that matters
    min_step: float = 1.0  # and absolute distance, in weight units (the integer dead band)
    sustain: int = 2  # consecutive cycles the change must hold

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.min_step < 0 or self.sustain < 1:
            raise ValueError("threshold and min_step must be >= 0, sustain >= 1")


@dataclass(frozen=True, slots=True)
class Gated:
    """The weight to publish this cycle and how many cycles a change has been pending."""

    weight: int
    streak: int = 0


def gate(
    goal: float,
    published: int | None,
    streak: int,
    policy: HysteresisPolicy,
    *,
    max_weight: int = MAX_WEIGHT,
    immediate: bool = False,
) -> Gated:
    """The next (published weight, streak) of one endpoint whose target is `goal`.

    `published` is None before the first publish: the target is taken as it is.
    """
    candidate = clamp_weight(goal, max_weight)
    if published is None:
        return Gated(candidate, 0)
    if candidate == published:
        return Gated(published, 0)
    bounded = min(max(goal, 1.0), float(max_weight))
    band = max(policy.threshold * published, policy.min_step)
    if abs(bounded - published) < band:
        return Gated(published, 0)
    streak += 1
    if immediate or streak >= policy.sustain:
        return Gated(candidate, 0)
    return Gated(published, streak)
