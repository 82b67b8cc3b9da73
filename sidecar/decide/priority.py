"""Sheddable first: the share of a pool's sheddable requests Envoy refuses at once. Pure.

The render puts, before every route that carries sheddable traffic (a route of class
sheddable, or a copy matched on the sheddable API-key clients' id), a route that matches a
runtime share of those requests (`confgen.envoy.shed_runtime_key`, a percentage, 0 by
default) and answers 429 `overloaded` + retry-after at once. Critical traffic rides Envoy's
HIGH-priority breaker at the safety cap; standard traffic and the sheddable requests the share
lets through meet the DEFAULT breaker, whose limit follows the shedding controller
(`sidecar.decide.saturation.admit`) while the pool is saturated.

This controller moves the share, once per cycle (at most every `min_interval_s`), from what
the in-flight limiter saw in the same cycle:

- the pool is not shedding (its limit is the safety cap): 0, at once;
- the pool has just started shedding: `first` (100 %) at once, before the limit meets any
  standard request: the backlog a surge builds before the limit acts is drained by
  refusing, and the sheddable requests go first (with 50 % first, the 150 % surge's
  standard traffic took refusals during the ramp);
- this Envoy's in-flight count is unknown (stale or missing metrics, admin unreachable):
  unchanged, never raised;
- the DEFAULT breaker refused requests since the last cycle: the excess is still meeting
  standard traffic, so the share rises, multiplicatively (`first` points, then x `factor`,
  up to 100): under a surge the sheddable traffic takes the refusals within a few cycles;
- nothing refused for `quiet_s` and the limit has room (in flight under `room` x limit): the
  share is refusing more than the excess, so it falls by `step_down` points per cycle. The
  quiet time matters at small limits: at 5 of 6 in flight the share fell every other cycle
  and rose again on the next refusal (100/90 sawtooth, measured), letting sheddable requests
  in while standard ones were refused;
- otherwise (the limit binds but refuses nothing yet): unchanged.

Raising fast and lowering slowly errs on the side of the standard traffic: the cost is a few
sheddable requests refused for a cycle or two too long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["ShedShare", "ShedSharePolicy", "ShedShares", "next_share"]


@dataclass(frozen=True, slots=True)
class ShedSharePolicy:
    first: int = 100  # percent when the pool starts shedding (then lowered while the limit has room)
    factor: float = 2.0  # each further raise multiplies the share
    step_down: int = 10  # points removed per cycle while the limit has room
    room: float = 0.9  # "the limit has room": in flight below room x limit
    min_interval_s: float = 1.0  # the share moves at most this often (the cycle is 2 s by default)
    quiet_s: float = 4.0  # lowered only once the limit has refused nothing for this long

    def __post_init__(self) -> None:
        if not (1 <= self.first <= 100 and self.factor >= 1.0 and 1 <= self.step_down <= 100
                and 0.0 < self.room <= 1.0 and self.min_interval_s >= 0.0 and self.quiet_s >= 0.0):
            raise ValueError(f"invalid shed share policy: {self}")


@dataclass(frozen=True, slots=True)
class ShedShare:
    """One pool's share: the percentage of its sheddable requests refused at once."""

    percent: int = 0
    changed_at: float | None = None
    refused_at: float | None = None  # the last cycle the limit refused requests while shedding


def next_share(previous: ShedShare | None, *, shedding: bool, refused: bool, in_flight: int | None,
               limit: int, now: float, policy: ShedSharePolicy) -> ShedShare:
    """The pool's next share (see the module docstring). `refused`: the DEFAULT breaker refused
    requests since the previous cycle; `in_flight`: this Envoy's DEFAULT-priority requests in
    flight to the pool (None: unknown); `limit`: the in-flight limit of this cycle."""
    previous = previous or ShedShare()
    if not shedding:
        return previous if previous.percent == 0 and previous.refused_at is None else ShedShare(0, now)
    if in_flight is None:
        return previous
    if previous.percent == 0 and previous.refused_at is None:  # the first cycle of a shedding episode
        return ShedShare(policy.first, now, now if refused else None)
    if refused:
        previous = replace(previous, refused_at=now)
    if previous.changed_at is not None and now - previous.changed_at < policy.min_interval_s:
        return previous
    if refused:
        raised = min(100, max(policy.first, math.ceil(previous.percent * policy.factor)))
        return previous if raised == previous.percent else replace(previous, percent=raised, changed_at=now)
    quiet = previous.refused_at is None or now - previous.refused_at >= policy.quiet_s
    if previous.percent > 0 and quiet and in_flight < policy.room * limit:
        return replace(previous, percent=max(0, previous.percent - policy.step_down), changed_at=now)
    return previous


class ShedShares:
    """Every pool's share over time; both in-flight limiters keep one (file: admin runtime,
    ADS: the RTDS layer), beside their `Admissions`."""

    def __init__(self, policy: ShedSharePolicy | None = None) -> None:
        self._policy = policy or ShedSharePolicy()
        self._state: dict[str, ShedShare] = {}

    def percent(self, pool: str) -> int:
        state = self._state.get(pool)
        return state.percent if state is not None else 0

    def forget(self, pool: str) -> None:
        self._state.pop(pool, None)

    def step(self, pool: str, *, shedding: bool, refused: bool, in_flight: int | None, limit: int,
             now: float) -> int:
        state = next_share(self._state.get(pool), shedding=shedding, refused=refused, in_flight=in_flight,
                           limit=limit, now=now, policy=self._policy)
        self._state[pool] = state
        return state.percent
