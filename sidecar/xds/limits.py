"""The in-flight limits in ADS mode: one RTDS layer every Envoy gets (no `--ingresses`).

The same rule as `sidecar.backpressure.InflightLimiter` (`sidecar.saturation`): below
saturation every Envoy holds the render's safety cap; while a pool is saturated the
shedding controller sets the limit. The control plane knows how many Envoys share the
fleet (the nodes connected to it that ACKed the runtime layer, at least 1, at most
`--xds-max-nodes`: a client that never applies the limits does not shrink anyone's share)
but not their own in-flight counts (no admin access to them), so an Envoy's in-flight is
taken as its share of what the engines report running and waiting (exact when all the
load comes through these Envoys), and "the limit refused requests" as that share being at
the limit.

Every Envoy gets the same values; when Envoys connect or leave, the next cycle resizes the
shares. Until the first value arrives Envoy applies the cluster's own circuit breakers
(the safety cap), and a disconnected Envoy keeps its last values.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sidecar.backpressure import PoolLoad, runtime_keys
from sidecar.logs import log_event
from sidecar.saturation import Admission, SaturationPolicy, admit
from sidecar.xds.publisher import AdsPublisher

__all__ = ["RtdsLimiter"]

_log = logging.getLogger("sidecar.xds")


class RtdsLimiter:
    """Same role as `sidecar.backpressure.InflightLimiter`, through RTDS instead of the admin API."""

    def __init__(self, publisher: AdsPublisher, policy: SaturationPolicy | None = None) -> None:
        self._publisher = publisher
        self._policy = policy or SaturationPolicy()
        self._state: dict[str, Admission] = {}
        self.in_force: dict[str, int] = {}  # pool -> limit served (every Envoy gets it)

    def forget(self, pool: str) -> None:
        self.in_force.pop(pool, None)
        self._state.pop(pool, None)

    def shedding(self, pool: str) -> bool:
        state = self._state.get(pool)
        return state is not None and state.shedding

    async def apply(self, loads: Mapping[str, PoolLoad], now: float) -> None:
        ingresses = max(1, self._publisher.nodes.counted())
        wanted: dict[str, int] = {}
        for pool, load in loads.items():
            previous = self._state.get(pool)
            share = round(load.saturation.in_flight / ingresses) if load.saturation.fresh_capacity else None
            refused = (previous is not None and share is not None
                       and share >= previous.limit - max(1, previous.limit // 20))
            state = admit(previous, load.saturation, share, refused, load.cap, ingresses, now, self._policy)
            if state.shedding != (previous is not None and previous.shedding):
                log_event(_log, logging.WARNING if state.shedding else logging.INFO,
                          "shed.start" if state.shedding else "shed.stop", pool=pool, limit=state.limit,
                          cap=load.cap, ingresses=ingresses)
            self._state[pool] = state
            wanted[pool] = state.limit
        values = {key: limit for pool, limit in wanted.items() for key in runtime_keys(pool)}
        if self._publisher.set_runtime(values):
            log_event(_log, logging.INFO, "limit.served", limits=wanted, ingresses=ingresses)
        self.in_force = wanted
