"""The daemon's outputs for one cycle: the publisher (EDS, the whole tree when due), then every output."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from confgen.model import Pool, Topology
from sidecar.daemon.drains import Drains
from sidecar.daemon.tracked import Tracker
from sidecar.fleet import Cycle, EndpointKey, Snapshot
from sidecar.outputs.contract import Output, OutputStatus, Publisher, combine

__all__ = ["Publishing", "eds_pools"]


def eds_pools(topo: Topology) -> list[Pool]:
    return [p for p in topo.pools if p.discovery == "eds"]


class Publishing:
    """Feeds each cycle's decisions to the publisher, then the cycle and the fleet view to every
    output (the publisher first, then `others` in their order); remembers whether it published."""

    def __init__(self, publisher: Publisher, others: Sequence[Output] = ()) -> None:
        self.publisher = publisher
        self.outputs: tuple[Output, ...] = (publisher, *others)
        self.published = False  # publish_all succeeded once: the proxy has a whole config from us
        self.tree_due = True  # write the whole tree on the first cycle (changes made while we were down)

    def adopt(self, topo: Topology, tracker: Tracker) -> int:
        """Seed the tracker with what is published already, so a restart changes nothing."""
        count = 0
        for pool in eds_pools(topo):
            for ep in self.publisher.adopt(pool.name):
                tracker.adopted[EndpointKey(pool.name, ep.worker, ep.address, ep.port)] = ep
                count += 1
        return count

    def forget(self, pool: str) -> None:
        for output in self.outputs:
            output.forget(pool)

    def status(self) -> OutputStatus:
        """Every output's status, combined in their order."""
        return combine(output.status() for output in self.outputs)

    async def run(self, topo: Topology, tracker: Tracker, drains: Drains, clock: Callable[[], float]) -> Cycle | None:
        """Decide every EDS pool's endpoints (a pool the outputs shed for weighs by throughput),
        publish them, then apply the cycle to every output; the cycle's result, or None when
        nothing was publishable yet (retried next cycle; no output applies it)."""
        now = clock()
        drains.apply(topo, tracker.tracked.items(), now)
        pools = eds_pools(topo)
        status = self.status()
        per_pool = {pool.name: tracker.decide(pool, now, shedding=status.pool(pool.name).shedding) for pool in pools}
        if not await self.publisher.check_published():
            self.tree_due = True  # someone replaced a file we wrote: put ours back
        if self.tree_due:
            if not await self.publisher.publish_all(topo, per_pool):
                return None  # not publishable yet (e.g. ADS without the API keys)
            self.tree_due = False
            self.published = True
        else:
            for pool_name, endpoints in per_pool.items():
                self.publisher.offer(pool_name, endpoints)
        cycle = Cycle(topo, {name: tuple(eps) for name, eps in per_pool.items()}, tracker.loads(pools, topo, now), now)
        for output in self.outputs:
            await output.apply(cycle)
        return cycle

    def update(self, fleet: Snapshot) -> None:
        """The fleet view after a cycle, to every output."""
        for output in self.outputs:
            output.update(fleet)
