"""The in-flight limits in ADS mode: one RTDS layer every Envoy gets (no `--ingresses`).

The same rule as `sidecar.outputs.files.limiter.InflightLimiter` (`sidecar.decide.saturation`): below
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

Sheddable first: the same layer carries `confgen.envoy.shed_runtime_key(pool)` for the pools
the render gives sheddable traffic (`sidecar.decide.priority`, from the same `refused` and
in-flight share), so every Envoy refuses the same share of sheddable requests at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Protocol

from confgen.envoy import breaker_runtime_keys, shed_runtime_key
from sidecar.decide.admission import Admissions
from sidecar.decide.priority import ShedSharePolicy, ShedShares
from sidecar.decide.saturation import PoolLoad, SaturationPolicy
from sidecar.logs import log_event
from sidecar.outputs.contract import OutputStatus, PoolStatus

if TYPE_CHECKING:
    from sidecar.fleet import Cycle, Snapshot

__all__ = ["RtdsLimiter", "RuntimeLayer"]

_log = logging.getLogger("sidecar.outputs.xds")


class CountedNodes(Protocol):
    def counted(self) -> int: ...


class RuntimeLayer(Protocol):
    """What the limiter needs of the ADS publisher: the Envoys that apply the limits, and the RTDS layer."""

    @property
    def nodes(self) -> CountedNodes: ...

    def set_runtime(self, values: Mapping[str, int]) -> bool: ...


class RtdsLimiter:
    """Same role as `sidecar.outputs.files.limiter.InflightLimiter`, through RTDS instead of the admin API
    (a `sidecar.outputs.contract.Output`)."""

    name = "rtds"

    def __init__(self, publisher: RuntimeLayer, policy: SaturationPolicy | None = None,
                 sheddable: Callable[[], Collection[str]] = tuple,
                 share_policy: ShedSharePolicy | None = None) -> None:
        self._publisher = publisher
        self._admissions = Admissions(policy, _log)
        self._sheddable = sheddable  # the pools the current render gives sheddable traffic
        self._shares = ShedShares(share_policy)
        self.in_force: dict[str, int] = {}  # pool -> limit served (every Envoy gets it)
        self.sheddable_share: dict[str, int] = {}  # pool -> percent of sheddable requests refused (served)

    async def start(self) -> None:
        """Nothing to open: the layer is served by the ADS publisher."""

    async def close(self) -> None:
        """Nothing to stop."""

    async def apply(self, cycle: Cycle) -> None:
        await self.set_limits(cycle.loads, cycle.now)

    def update(self, fleet: Snapshot) -> None:
        """Nothing: the limits follow the cycle's loads."""

    def status(self) -> OutputStatus:
        """The limits and shares served; no `shed` (the control plane cannot see the Envoys' refusals)."""
        known = {*self._admissions.pools(), *self.in_force, *self.sheddable_share}
        return OutputStatus(pools={pool: PoolStatus(inflight_limit=self.in_force.get(pool),
                                                    shedding=self.shedding(pool),
                                                    sheddable_share=self.sheddable_share.get(pool)) for pool in known})

    def forget(self, pool: str) -> None:
        self.in_force.pop(pool, None)
        self._admissions.forget(pool)
        self._shares.forget(pool)
        self.sheddable_share.pop(pool, None)

    def shedding(self, pool: str) -> bool:
        return self._admissions.shedding(pool)

    async def set_limits(self, loads: Mapping[str, PoolLoad], now: float) -> None:
        """Every pool's limit (and shed share) for this cycle, into the RTDS layer. The control plane
        has no Envoy's own in-flight count to watch between probes: the engines' reports, once per
        cycle, are what it sees."""
        for gone in [pool for pool in self._admissions.pools() if pool not in loads]:
            self.forget(gone)  # no longer limited (strict_dns now, or removed): the layer below leaves it out
        ingresses = max(1, self._publisher.nodes.counted())
        wanted: dict[str, int] = {}
        shares: dict[str, int] = {}
        sheddable = set(self._sheddable())
        for pool, load in loads.items():
            previous = self._admissions.previous(pool)
            share = round(load.saturation.in_flight / ingresses) if load.saturation.fresh_capacity else None
            refused = (previous is not None and share is not None
                       and share >= previous.limit - max(1, previous.limit // 20))
            wanted[pool] = self._admissions.step(pool, load, share, refused, ingresses, now)
            if pool in sheddable:
                shares[pool] = self._shares.step(pool, shedding=self._admissions.shedding(pool), refused=refused,
                                                 in_flight=share, limit=wanted[pool], now=now)
        values = {key: limit for pool, limit in wanted.items() for key in breaker_runtime_keys(pool)}
        values.update({shed_runtime_key(pool): percent for pool, percent in shares.items()})
        if self._publisher.set_runtime(values):
            log_event(_log, logging.INFO, "limit.served", limits=wanted, sheddable_share=shares, ingresses=ingresses)
        self.in_force = wanted
        self.sheddable_share = shares
