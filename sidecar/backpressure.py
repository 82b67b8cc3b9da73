"""Envoy's in-flight limit per pool, kept true to the fleet (the design's 80 % rule).

confgen renders each pool's circuit breakers (`max_requests`, `max_pending_requests`) as
floor(max_utilization x the pool's declared capacity): true only while every worker
serves. Past the limit Envoy answers 429 `overloaded` instead of queueing in engines.
The sidecar keeps that limit true at run time through Envoy's admin runtime layer,
`circuit_breakers.<cluster>.default.max_requests` and `...max_pending_requests` (checked
against Envoy 1.40: POST /runtime_modify takes effect on the next request).

The rule, per EDS pool, each cycle (u = backpressure.max_utilization):

    base  = max(1, floor(u x capacity in rotation / ingresses))

    `capacity in rotation` sums the declared capacity of endpoints published HEALTHY or
    DEGRADED that the sidecar does not know to be failing (one kept in rotation only by
    the ejection cap is failing); when every one of them is failing the sidecar stands
    back (see sidecar.state) and counts them all. `ingresses` Envoys share the fleet.

    limit = base                                    no load sample, or s unknown
          = clamp(floor(active x u / s), 1, base)   when s > u
          = clamp(ceil(prev x u / s), prev, base)   when s <= u (prev: the limit in force)

    s is the measured saturation of the endpoints counted above (sidecar.weights.
    pool_saturation: engines' running + waiting over capacity, or KV use over its knee),
    a view that includes every other ingress and any load that bypasses Envoy; `active`
    is this Envoy's `cluster.<pool>.upstream_rq_active`.

Why it is sound: when all load comes through this Envoy, active ~= s x capacity and the
formula gives back u x capacity = base; with outside load E it gives this Envoy its
proportional share, and repeated cycles converge to the fixed point active + E = u x
capacity (the step's slope there is E / (u x capacity) < 1). When the outside load alone
passes u x capacity the limit falls to its floor of 1: new requests get 429 instead of
queueing in engines that are already full. Lowering the limit below `active` cancels no
request; it only refuses new ones until enough finish. As saturation drops below u the
limit grows by the factor u / s per cycle (fast when the fleet is idle, slow near u, so
it does not swing between the floor and base) and never exceeds base. Without samples
(health-only engines) only the capacity rule applies.

The value is posted only when it differs from what Envoy's /runtime shows (read every
cycle, so an Envoy restart that lost the admin layer is repaired), and read back to
confirm; `in_force` is what Envoy confirmed.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.logs import log_event
from sidecar.publish import EnvoyAdmin

__all__ = ["InflightLimiter", "PoolLoad", "inflight_limit", "runtime_keys"]

_log = logging.getLogger("sidecar.backpressure")


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """What the limit of one pool is computed from (see the module docstring)."""

    capacity: int  # declared capacity of the endpoints counted as in rotation
    saturation: float | None  # None: no endpoint has a load sample
    max_utilization: float


def base_limit(capacity: int, max_utilization: float, ingresses: int) -> int:
    """max(1, floor(u x capacity / ingresses)): the 80 % rule over the capacity that serves."""
    return max(1, math.floor(max_utilization * capacity / ingresses + 1e-9))


def inflight_limit(load: PoolLoad, ingresses: int, active: int | None, previous: int | None) -> int:
    """The pool's in-flight limit for this Envoy, in [1, base]."""
    base = base_limit(load.capacity, load.max_utilization, ingresses)
    s, u = load.saturation, load.max_utilization
    if s is None or s <= 0:
        return base
    if s > u:
        if active is None:  # cannot see our own share: never raise, never go past base
            return min(previous or base, base)
        return min(max(math.floor(active * u / s + 1e-9), 1), base)
    if previous is None:
        return base
    # ceil: below u the limit grows by at least 1 a cycle, so it cannot stick under base
    return min(max(math.ceil(previous * u / s - 1e-9), previous), base)


def runtime_keys(pool: str) -> tuple[str, str]:
    """Envoy's runtime keys that override the pool's DEFAULT-priority circuit breakers."""
    return (f"circuit_breakers.{pool}.default.max_requests",
            f"circuit_breakers.{pool}.default.max_pending_requests")


class InflightLimiter:
    """Applies `inflight_limit` to Envoy through its admin runtime layer."""

    def __init__(self, admin: EnvoyAdmin, ingresses: int) -> None:
        if ingresses < 1:
            raise ValueError(f"ingresses must be >= 1, got {ingresses}")
        self._admin = admin
        self._ingresses = ingresses
        self.in_force: dict[str, int] = {}  # pool -> limit Envoy confirmed

    def forget(self, pool: str) -> None:
        self.in_force.pop(pool, None)

    async def apply(self, loads: Mapping[str, PoolLoad]) -> None:
        """Compute every pool's limit and set those Envoy does not hold yet."""
        if not loads:
            return
        runtime = await self._admin.runtime()
        if runtime is None:
            log_event(_log, logging.WARNING, "limit.unreachable", admin=self._admin.base_url,
                      note="Envoy's runtime could not be read; limits unchanged")
            return
        wanted: dict[str, int] = {}
        for pool, load in loads.items():
            saturated = load.saturation is not None and load.saturation > load.max_utilization
            active = await self._active(pool) if saturated else None
            previous = _int_or_none(runtime.get(runtime_keys(pool)[0]))
            wanted[pool] = inflight_limit(load, self._ingresses, active, previous)
        changes = {key: str(limit) for pool, limit in wanted.items() for key in runtime_keys(pool)
                   if runtime.get(key) != str(limit)}
        if changes and not await self._admin.set_runtime(changes):
            log_event(_log, logging.ERROR, "limit.refused", admin=self._admin.base_url, keys=sorted(changes))
        after = await self._admin.runtime() if changes else runtime
        for pool, limit in wanted.items():
            held = tuple(after.get(key) for key in runtime_keys(pool)) if after is not None else ()
            if held == (str(limit), str(limit)):
                if self.in_force.get(pool) != limit:
                    log_event(_log, logging.INFO, "limit.set", pool=pool, limit=limit,
                              before=self.in_force.get(pool), capacity=loads[pool].capacity,
                              saturation=loads[pool].saturation, ingresses=self._ingresses)
                self.in_force[pool] = limit
            else:
                log_event(_log, logging.WARNING, "limit.unconfirmed", pool=pool, limit=limit, envoy=list(held))
                self.in_force.pop(pool, None)

    async def _active(self, pool: str) -> int | None:
        name = f"cluster.{pool}.upstream_rq_active"
        stats = await self._admin.stats(rf"^{re.escape(name)}$")
        value = stats.get(name) if stats is not None else None
        return value if isinstance(value, int) else None


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None
