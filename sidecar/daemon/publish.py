"""The daemon's outputs for one cycle: the publisher (EDS, the whole tree when due) and the limiter."""

from __future__ import annotations

from collections.abc import Callable

from confgen.model import Pool, Topology
from sidecar.daemon.drains import Drains
from sidecar.daemon.tracked import Tracker
from sidecar.fleet import Cycle, EndpointKey
from sidecar.outputs.publisher import Limiter, NoLimiter, Publisher

__all__ = ["Publishing", "eds_pools"]


def eds_pools(topo: Topology) -> list[Pool]:
    return [p for p in topo.pools if p.discovery == "eds"]


class Publishing:
    """Feeds each cycle's decisions to the publisher and the limiter, and remembers what it published."""

    def __init__(self, publisher: Publisher, limiter: Limiter | None) -> None:
        self.publisher = publisher
        self.limiter: Limiter = limiter if limiter is not None else NoLimiter()
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
        self.publisher.forget(pool)
        self.limiter.forget(pool)

    async def run(self, topo: Topology, tracker: Tracker, drains: Drains, clock: Callable[[], float]) -> Cycle | None:
        """Decide every EDS pool's endpoints, publish them, then apply the pools' loads to the
        limiter; the cycle's result, or None when nothing was publishable yet (retried next cycle)."""
        now = clock()
        drains.apply(topo, tracker.tracked.items(), now)
        pools = eds_pools(topo)
        per_pool = {pool.name: tracker.decide(pool, now, shedding=self.limiter.shedding(pool.name))
                    for pool in pools}
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
        loads = tracker.loads(pools, topo, now)
        await self.limiter.apply(loads, now)
        return Cycle(topo, {name: tuple(eps) for name, eps in per_pool.items()}, loads, now)

    def saturated(self, pool: str, tracker: Tracker) -> tuple[bool, str]:
        """The pool's verdict as of the last cycle, and why: the engines' rules, else the
        limiter's in-flight watch (which also runs between cycles)."""
        verdict = tracker.verdicts.get(pool)
        if verdict is not None and verdict.saturated:
            return True, verdict.reason
        if self.limiter.inflight_saturated(pool):
            return True, "inflight"
        return False, ""
