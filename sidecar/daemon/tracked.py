"""What the daemon tracks of each endpoint and pool between cycles, and the steps that update it.

`Tracker` holds the mutable per-endpoint records (`Tracked`) and the per-pool saturation
detectors; the daemon drives it under its lock: `sync` (resolve the topology's workers),
`observe` (one probe report), `decide` (one pool's published endpoints, through
`sidecar.decide.assign`), `loads` (the pools' caps and saturation verdicts) and `endpoints`
(the fleet view's rows).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from confgen.balancing import is_hashing
from confgen.endpoints import Endpoint
from confgen.model import ENVOY_CAP_MAX, Pool, Topology, Worker, split_address
from sidecar.config import SidecarConfig
from sidecar.decide.assign import Member, assign
from sidecar.decide.saturation import Headroom, PoolLoad, PoolSaturation, QueueWatch, assess
from sidecar.decide.state import Decision, EndpointState, Status, decide_pool
from sidecar.decide.weights import Trend
from sidecar.fleet import EndpointKey, EndpointView
from sidecar.logs import log_event
from sidecar.observe.engines import LoadSample
from sidecar.observe.histogram import DurationHistogram, HistogramView
from sidecar.observe.probe import ProbeReport, Target
from sidecar.observe.resolve import Resolver

__all__ = ["Tracked", "Tracker"]

_log = logging.getLogger("sidecar.daemon")


@dataclass(slots=True)
class Tracked:
    state: EndpointState
    capacity: int
    zone: str | None
    engine: str
    share: int = 1  # the worker's static weight: multiplies the computed one
    labels: tuple[tuple[str, str], ...] = ()
    weight: int | None = None  # last weight published
    streak: int = 0  # cycles a weight change has been pending (sidecar.decide.hysteresis)
    sample: LoadSample | None = None
    trend: Trend = field(default_factory=Trend)  # smoothed speed and queue, for the weights
    headroom: Headroom = field(default_factory=Headroom)  # the saturation detector's view
    report: ProbeReport | None = None
    decision: Decision | None = None
    errors: Counter[str] = field(default_factory=Counter)


class Tracker:
    """The endpoints of the topology's EDS pools and what was measured and decided of them."""

    def __init__(self, config: SidecarConfig) -> None:
        self._config = config
        self.tracked: dict[EndpointKey, Tracked] = {}
        self.adopted: dict[EndpointKey, Endpoint] = {}  # published before a restart, not yet seen
        self.watches: dict[str, QueueWatch] = {}  # pool -> its standing-queue detector (sidecar.decide.saturation)
        self.verdicts: dict[str, PoolSaturation] = {}  # pool -> the detector's last verdict
        self.probe_durations: dict[str, DurationHistogram] = {}

    def members(self, pool: str) -> Iterator[tuple[EndpointKey, Tracked]]:
        return ((k, t) for k, t in self.tracked.items() if k.pool == pool)

    def forget(self, pool: str) -> None:
        self.watches.pop(pool, None)
        self.verdicts.pop(pool, None)

    async def sync(self, pools: list[Pool], resolver: Resolver, clock: Callable[[], float]) -> None:
        """Resolve every worker of `pools`; add the endpoints that appeared, drop the ones gone."""
        wanted: dict[EndpointKey, tuple[Pool, Worker]] = {}
        jobs: list[tuple[Pool, Worker, str, int]] = []
        for pool in pools:
            for worker in pool.workers:
                parts = split_address(worker.address)
                assert parts is not None  # checked when the topology was loaded
                jobs.append((pool, worker, *parts))
        answers = await asyncio.gather(*(resolver.resolve(host, port) for _, _, host, port in jobs))
        resolver.forget_except({(host, port) for _, _, host, port in jobs})
        for (pool, worker, _host, port), addresses in zip(jobs, answers, strict=True):
            for address in addresses:
                wanted[EndpointKey(pool.name, worker.address, address, port)] = (pool, worker)
        now = clock()
        for key in list(self.tracked):
            if key not in wanted:
                del self.tracked[key]
                log_event(_log, logging.INFO, "endpoint.removed", pool=key.pool, worker=key.worker,
                          address=key.address)
        for key, (pool, worker) in wanted.items():
            self._track(key, pool, worker, now)

    def _track(self, key: EndpointKey, pool: Pool, worker: Worker, now: float) -> None:
        capacity = pool.capacity_of(worker)
        labels = tuple(sorted(worker.labels.items()))
        tracked = self.tracked.get(key)
        if tracked is not None:
            tracked.capacity, tracked.zone, tracked.engine = capacity, worker.zone, pool.engine
            tracked.share, tracked.labels = worker.weight, labels
            return
        adopted = self.adopted.pop(key, None)
        state: EndpointState | None = None
        if adopted is not None:
            try:
                state = EndpointState.adopt(adopted.health, now)
            except ValueError as exc:  # a file on disk with a health no publisher writes: start afresh
                log_event(_log, logging.WARNING, "endpoint.not_adopted", pool=key.pool, worker=key.worker,
                          reason=str(exc)[:200])
        if adopted is not None and state is not None:
            self.tracked[key] = Tracked(state, capacity, worker.zone, pool.engine, worker.weight, labels,
                                        weight=adopted.weight)
        else:
            self.tracked[key] = Tracked(EndpointState.new(now), capacity, worker.zone, pool.engine,
                                        worker.weight, labels)
            log_event(_log, logging.INFO, "endpoint.added", pool=key.pool, worker=key.worker,
                      address=key.address)

    @staticmethod
    def target(key: EndpointKey, topo: Topology) -> Target:
        pool = topo.pool(key.pool)
        host = split_address(key.worker)
        host_header = key.worker if host is not None and host[0] != key.address else None
        return Target(key.address, key.port, pool.engine, pool.health_path, pool.metrics_path, host_header)

    def observe(self, key: EndpointKey, report: ProbeReport) -> None:
        config = self._config
        tracked = self.tracked[key]
        before = tracked.state.published
        tracked.state = tracked.state.observe(report.result, config.health)
        tracked.report = report
        self.probe_durations.setdefault(key.pool, DurationHistogram()).observe(report.duration_s)
        if report.result.metrics_checked:  # else a quiet engine's last sample stands (sidecar.decide.state)
            tracked.sample = report.result.sample
            tracked.trend = tracked.trend.observe(report.result.sample, report.result.at, config.weights)
            tracked.headroom = tracked.headroom.observe(report.result.sample, report.result.at, tracked.capacity,
                                                        config.saturation)
        if report.error is not None:
            tracked.errors[report.error] += 1
            log_event(_log, logging.DEBUG, "probe.failed", pool=key.pool, worker=key.worker,
                      address=key.address, kind=report.error, detail=report.detail)
        if tracked.state.published is not before:
            log_event(_log, logging.INFO, "endpoint.status", pool=key.pool, worker=key.worker,
                      address=key.address, before=str(before), after=str(tracked.state.published),
                      reason=tracked.state.reason)

    def decide(self, pool: Pool, now: float, *, shedding: bool) -> list[Endpoint]:
        """The pool's endpoints as published this cycle (decisions and weights recorded)."""
        members = dict(self.members(pool.name))
        decisions = decide_pool({k: t.state for k, t in members.items()}, self._config.health, now)
        inputs = {k: Member(t.capacity, t.share, t.weight, t.streak, t.sample, t.trend.queue, t.trend.token_latency_s)
                  for k, t in members.items()}
        weights = assign(inputs, decisions, hashing=is_hashing(pool.balancing.policy), shedding=shedding,
                         weights=self._config.weights, hysteresis=self._config.hysteresis)
        out: list[Endpoint] = []
        for key, decision in decisions.items():
            tracked = members[key]
            tracked.decision = decision
            tracked.weight, tracked.streak = weights[key]
            out.append(Endpoint(key.address, key.port, weight=tracked.weight, health=decision.status.value,
                                zone=tracked.zone, worker=key.worker, labels=tracked.labels))
        return out

    def loads(self, pools: list[Pool], topo: Topology, now: float) -> dict[str, PoolLoad]:
        """Each pool's safety cap and saturation verdict: the per-worker headroom rule over the
        endpoints in rotation, then the pool's standing queue (`QueueWatch`)."""
        policy = self._config.saturation
        out = {}
        for pool in pools:
            rotation = {k: t for k, t in self.members(pool.name) if t.decision is not None
                        and t.decision.status in (Status.HEALTHY, Status.DEGRADED)}
            serving = {k: t for k, t in rotation.items() if t.decision is not None and not t.decision.min_weight}
            counted = serving or rotation  # all failing: the sidecar stands back, as with ejections
            saturation = assess(((t.headroom, t.capacity) for t in counted.values()), now, policy,
                                topo.backpressure.max_utilization)
            watch = self.watches.get(pool.name, QueueWatch()).observe(saturation, now, policy)
            self.watches[pool.name] = watch
            out[pool.name] = PoolLoad(topo.in_flight_cap(pool, ENVOY_CAP_MAX), watch.apply(saturation))
            self.verdicts[pool.name] = out[pool.name].saturation
        return out

    def endpoints(self, pool: str) -> tuple[EndpointView, ...]:
        """The fleet view's rows for `pool`, sorted."""
        return tuple(_view(k, t) for k, t in sorted(self.members(pool)))

    def durations(self, pool: str) -> HistogramView | None:
        h = self.probe_durations.get(pool)
        return h.view() if h is not None else None

    def by_key(self, pool: str) -> Mapping[EndpointKey, Tracked]:
        """The pool's tracked endpoints, sorted by key."""
        return dict(sorted(self.members(pool)))


def _view(k: EndpointKey, t: Tracked) -> EndpointView:
    return EndpointView(
        key=k,
        status=(t.decision.status if t.decision else t.state.published).value,
        reason=t.decision.reason if t.decision else t.state.reason,
        weight=t.weight,
        sample=t.sample,
        probe_latency_s=t.report.duration_s if t.report else None,
        last_outcome=t.report.result.outcome.value if t.report else None,
        last_error=t.report.detail if t.report and t.report.error else None,
        errors=dict(t.errors),
        serving=(t.decision.status in (Status.HEALTHY, Status.DEGRADED) and not t.decision.min_weight)
        if t.decision else t.state.published in (Status.HEALTHY, Status.DEGRADED),
        token_latency_s=t.trend.token_latency_s,
        capacity=t.capacity,
        failing=t.state.status is Status.UNHEALTHY and not t.state.drained,
    )
