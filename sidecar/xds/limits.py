"""The in-flight limits in ADS mode: one RTDS layer every Envoy gets (no `--ingresses`).

The control plane knows how many Envoys share the fleet: the nodes connected to it. Each
pool's limit per Envoy follows `sidecar.backpressure.inflight_limit` with
ingresses = connected nodes (at least 1), so the fleet as a whole admits
u x capacity in rotation. An Envoy's own in-flight count is not visible here (no admin
access to the Envoys); above the saturation threshold the limit in force stands for it:
limit = floor(previous x u / s), a multiplicative decrease that reaches the same fixed
point when the Envoys are at their limits and is only slower when they are not.

Every Envoy gets the same values; when Envoys connect or leave, the next cycle resizes the
shares. Until the first value arrives Envoy applies the cluster's own circuit breakers
(floor(u x declared capacity)), and a disconnected Envoy keeps its last values.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sidecar.backpressure import PoolLoad, inflight_limit, runtime_keys
from sidecar.logs import log_event
from sidecar.xds.publisher import AdsPublisher

__all__ = ["RtdsLimiter"]

_log = logging.getLogger("sidecar.xds")


class RtdsLimiter:
    """Same role as `sidecar.backpressure.InflightLimiter`, through RTDS instead of the admin API."""

    def __init__(self, publisher: AdsPublisher) -> None:
        self._publisher = publisher
        self.in_force: dict[str, int] = {}  # pool -> limit served (every Envoy gets it)

    def forget(self, pool: str) -> None:
        self.in_force.pop(pool, None)

    async def apply(self, loads: Mapping[str, PoolLoad]) -> None:
        ingresses = max(1, len(self._publisher.nodes))
        wanted: dict[str, int] = {}
        for pool, load in loads.items():
            previous = self.in_force.get(pool)
            saturated = load.saturation is not None and load.saturation > load.max_utilization
            wanted[pool] = inflight_limit(load, ingresses, previous if saturated else None, previous)
        values = {key: limit for pool, limit in wanted.items() for key in runtime_keys(pool)}
        if self._publisher.set_runtime(values):
            log_event(_log, logging.INFO, "limit.served", limits=wanted, ingresses=ingresses)
        self.in_force = wanted
