"""Envoy's in-flight limit per pool: the render's safety cap, lowered only while the pool is saturated.

confgen renders each pool's circuit breakers (`max_requests`, `max_pending_requests`) at
the safety cap, `backpressure.safety_cap` x the pool's declared capacity
(`confgen.model.in_flight_cap`): room for every slot and the engines' own queues, so
neither Envoy nor nginx queues or sheds at normal load. The sidecar decides saturation
from what the engines report (`sidecar.decide.saturation`: waiting queue per slot and its trend,
KV-cache use, fresh metrics only) and, while a pool is saturated, lowers this Envoy's
limit to what the shedding controller admits: new requests past it get 429 `overloaded`
with retry-after at once (Envoy overflows instead of queueing), the ones in flight are
never cancelled. Below saturation the limit is the safety cap.

The limit is set through Envoy's admin runtime layer,
`circuit_breakers.<cluster>.default.max_requests` and `...max_pending_requests` (checked
against Envoy 1.40: POST /runtime_modify takes effect on the next request), posted only
when it differs from what Envoy's /runtime shows (read every cycle, so an Envoy restart
that lost the admin layer is repaired), and read back; `in_force` is what Envoy confirmed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from confgen.envoy import breaker_runtime_keys
from sidecar.decide.admission import Admissions
from sidecar.decide.saturation import PoolLoad, SaturationPolicy
from sidecar.logs import log_event
from sidecar.outputs.envoy_admin import EnvoyAdmin

__all__ = ["InflightLimiter"]

_log = logging.getLogger("sidecar.outputs.files.limiter")


class InflightLimiter:
    """Applies the shedding controller (`sidecar.decide.saturation.admit`) to Envoy's runtime layer."""

    def __init__(self, admin: EnvoyAdmin, ingresses: int, policy: SaturationPolicy | None = None) -> None:
        if ingresses < 1:
            raise ValueError(f"ingresses must be >= 1, got {ingresses}")
        self._admin = admin
        self._ingresses = ingresses
        self._admissions = Admissions(policy, _log)
        self._overflows: dict[str, int] = {}  # pool -> Envoy's overflow counter at the last read
        self.in_force: dict[str, int] = {}  # pool -> limit Envoy confirmed

    def forget(self, pool: str) -> None:
        self.in_force.pop(pool, None)
        self._admissions.forget(pool)
        self._overflows.pop(pool, None)

    def shedding(self, pool: str) -> bool:
        """True while the pool's limit follows the controller rather than the safety cap."""
        return self._admissions.shedding(pool)

    async def apply(self, loads: Mapping[str, PoolLoad], now: float) -> None:
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
            needs_active = load.saturation.saturated or self._admissions.shedding(pool)
            active, refused = await self._stats(pool) if needs_active else (None, False)
            wanted[pool] = self._admissions.step(
                pool, load, active, refused, self._ingresses, now, active=active,
                full_share=round(load.saturation.full_share, 3), waiting=round(load.saturation.waiting, 1),
                capacity=load.saturation.capacity)
        changes = {key: str(limit) for pool, limit in wanted.items() for key in breaker_runtime_keys(pool)
                   if runtime.get(key) != str(limit)}
        if changes and not await self._admin.set_runtime(changes):
            log_event(_log, logging.ERROR, "limit.refused", admin=self._admin.base_url, keys=sorted(changes))
        after = await self._admin.runtime() if changes else runtime
        for pool, limit in wanted.items():
            held = tuple(after.get(key) for key in breaker_runtime_keys(pool)) if after is not None else ()
            if held == (str(limit), str(limit)):
                if self.in_force.get(pool) != limit:
                    log_event(_log, logging.DEBUG, "limit.set", pool=pool, limit=limit,
                              before=self.in_force.get(pool), cap=loads[pool].cap,
                              saturated=loads[pool].saturation.saturated, ingresses=self._ingresses)
                self.in_force[pool] = limit
            else:
                log_event(_log, logging.WARNING, "limit.unconfirmed", pool=pool, limit=limit, envoy=list(held))
                self.in_force.pop(pool, None)

    async def _stats(self, pool: str) -> tuple[int | None, bool]:
        """This Envoy's requests in flight to the pool, and whether its breakers refused any
        since the previous call (Envoy counts a max_requests overflow as a pending overflow)."""
        active_name = f"cluster.{pool}.upstream_rq_active"
        overflow_name = f"cluster.{pool}.upstream_rq_pending_overflow"
        stats = await self._admin.stats(rf"^({re.escape(active_name)}|{re.escape(overflow_name)})$")
        active = stats.get(active_name) if stats is not None else None
        overflow = stats.get(overflow_name) if stats is not None else None
        if not isinstance(overflow, int):
            return (active if isinstance(active, int) else None), False
        before = self._overflows.get(pool)
        self._overflows[pool] = overflow
        return (active if isinstance(active, int) else None), before is not None and overflow > before
