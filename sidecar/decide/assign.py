"""One pool's published weights from its endpoints' decisions and measurements. Pure.

The daemon hands `assign` what it tracks of each endpoint of a pool (`Member`) and the
pool's decisions (`sidecar.decide.state.decide_pool`); it returns each endpoint's weight
and hysteresis streak, by the rules:

    hashing pool (ring_hash, maglev)   the rendered static weight (moving weights re-map sessions)
    UNHEALTHY, or failing (min_weight)  1: a return starts from the bottom of the ramp
    DRAINING                            the last weight published (1 when none)
    otherwise                           `weights.target`, smoothed, through `hysteresis.gate`
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from confgen.endpoints import static_weight
from sidecar.decide.hysteresis import HysteresisPolicy, gate
from sidecar.decide.state import Decision, Status
from sidecar.decide.weights import WeightPolicy, relative_speeds, smooth, target
from sidecar.observe.engines import LoadSample

__all__ = ["Member", "assign"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Member:
    """What one endpoint's weight is decided from."""

    capacity: int
    share: int  # the worker's static weight: multiplies the computed one
    weight: int | None  # last weight published
    streak: int  # cycles a weight change has been pending
    sample: LoadSample | None
    queue: float  # smoothed waiting requests (`weights.Trend.queue`)
    token_latency_s: float | None  # smoothed time per output token (`weights.Trend`)


def assign(members: Mapping[K, Member], decisions: Mapping[K, Decision], *, hashing: bool, shedding: bool,
           weights: WeightPolicy, hysteresis: HysteresisPolicy) -> dict[K, tuple[int, int]]:
    """key -> (weight, streak) for every key of `decisions` (each one a key of `members`).

    `hashing`: the pool's balancing builds a ring or table from the weights (Envoy re-maps
    sessions, and throws their KV cache away, on every weight change: measured, chat sessions'
    P99 2.5x worse with moving weights); health still changes and the pool's
    hash_balance_factor bounds the load per worker. `shedding`: the pool is under overload, its
    weights follow throughput (`WeightPolicy.shedding_speed_exponent`)."""
    speeds = relative_speeds({k: m.token_latency_s for k, m in members.items()})
    policy = replace(weights, speed_exponent=weights.shedding_speed_exponent) if shedding else weights
    out: dict[K, tuple[int, int]] = {}
    for key, decision in decisions.items():
        m = members[key]
        if hashing:
            out[key] = static_weight(m.capacity, m.share, weights.max_weight), 0
        elif decision.status is Status.UNHEALTHY or decision.min_weight:
            out[key] = 1, 0
        elif decision.status is Status.DRAINING:
            out[key] = m.weight or 1, 0
        else:
            goal = target(m.sample, m.capacity, policy, ramp=decision.ramp, share=m.share,
                          speed=speeds[key], queue=m.queue)
            gated = gate(smooth(goal, m.weight, policy), m.weight, m.streak, hysteresis,
                         max_weight=policy.max_weight, immediate=decision.ramp < 1)
            out[key] = gated.weight, gated.streak
    return out
