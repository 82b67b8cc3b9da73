"""The daemon's cycle: topology -> endpoints -> probes -> states -> decisions -> weights -> publish.

One `Daemon` owns the mutable picture of the fleet and is driven by `main` (the loop,
signals) and `server` (admin drain calls). It runs on one event loop, so nothing here
needs a lock. Readers (the metrics collector, /state) get an immutable `Snapshot`
rebuilt after every change, so a scrape never sees a half-updated cycle and an endpoint
that left the topology leaves every view with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from confgen import envoy
from confgen.envoy import Endpoint, layout
from confgen.errors import SecretError, TopologyError
from confgen.model import Pool, Topology, Worker, split_address
from confgen.secrets import resolve as resolve_secrets
from confgen.topology import load as load_topology
from sidecar.backpressure import InflightLimiter, PoolLoad
from sidecar.config import ConfigError, SidecarConfig
from sidecar.engines import LoadSample
from sidecar.histogram import DurationHistogram, HistogramView
from sidecar.logs import log_event
from sidecar.nginx_publish import NginxPublisher
from sidecar.probe import Prober, ProbeReport, Target
from sidecar.publish import EdsPublisher, read_published
from sidecar.resolve import Resolver
from sidecar.state import Decision, EndpointState, Status, decide_pool
from sidecar.tree import LdsSource, config_dir_for_tree, keys_for_reload, render_tree
from sidecar.weights import Trend, pool_saturation, queue_depth, relative_speeds, weight
from sidecar.xds.limits import RtdsLimiter
from sidecar.xds.publisher import AdsPublisher, XdsView

__all__ = ["Daemon", "EndpointKey", "EndpointView", "PoolView", "Snapshot", "config_dir_for", "xds_dir_for"]

_log = logging.getLogger("sidecar.daemon")


@dataclass(frozen=True, order=True, slots=True)
class EndpointKey:
    """One published endpoint: a worker of a pool at one of its IP addresses."""

    pool: str
    worker: str  # as written in the topology (host:port)
    address: str  # IP literal
    port: int


@dataclass(slots=True)
class _Tracked:
    state: EndpointState
    capacity: int
    zone: str | None
    engine: str
    share: int = 1  # the worker's static weight: multiplies the computed one
    labels: tuple[tuple[str, str], ...] = ()
    weight: int | None = None  # last weight published
    sample: LoadSample | None = None
    trend: Trend = field(default_factory=Trend)  # smoothed speed and queue, for the weights
    report: ProbeReport | None = None
    decision: Decision | None = None
    errors: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class EndpointView:
    key: EndpointKey
    status: str  # published EDS status
    reason: str
    weight: int | None
    sample: LoadSample | None
    probe_latency_s: float | None
    last_outcome: str | None
    last_error: str | None
    errors: Mapping[str, int]
    serving: bool = True  # in rotation and not known to be failing (one kept in only by the ejection cap is not)


@dataclass(frozen=True, slots=True)
class PoolView:
    name: str
    engine: str
    saturation: float
    queue_depth: float
    publishes: int
    rejections: int
    rejected: bool
    endpoints: tuple[EndpointView, ...]
    inflight_limit: int | None = None  # Envoy's confirmed circuit-breaker override
    probe_durations: HistogramView | None = None  # every probe of the pool's endpoints since start


@dataclass(frozen=True, slots=True)
class Snapshot:
    topology: str
    pools: tuple[PoolView, ...]
    reloads: Mapping[str, int]
    cycles: int
    not_ready: tuple[str, ...]  # reasons; empty when ready
    last_reload_error: str | None
    xds: XdsView | None = None  # --serve-xds: the control plane and its connected Envoys


def xds_dir_for(config: SidecarConfig, topo: Topology) -> Path:
    """Where the sidecar writes: --xds-dir, else the topology's envoy.config_dir."""
    if config.xds_dir is not None:
        return config.xds_dir.absolute()
    if topo.envoy.config_dir:
        return Path(topo.envoy.config_dir).absolute()
    raise ConfigError("no xDS directory: pass --xds-dir or set envoy.config_dir in the topology")


def config_dir_for(config: SidecarConfig, topo: Topology) -> str:
    """The directory Envoy reads (paths inside the files); may differ from where we write.

    As the bootstrap on disk names it, else envoy.config_dir, else the xDS directory made
    absolute (sidecar.tree.config_dir_for_tree).
    """
    return config_dir_for_tree(xds_dir_for(config, topo), topo)


class Daemon:
    """The fleet as the sidecar sees it, and the cycle that updates and publishes it."""

    def __init__(
        self,
        config: SidecarConfig,
        topo: Topology,
        *,
        prober: Prober,
        resolver: Resolver,
        publisher: EdsPublisher | NginxPublisher | AdsPublisher,
        clock: Callable[[], float],
        limiter: InflightLimiter | RtdsLimiter | None = None,
    ) -> None:
        self.config = config
        self._topo = topo
        self._prober = prober
        self._resolver = resolver
        self._publisher = publisher
        self._clock = clock
        self._limiter = limiter
        self._tracked: dict[EndpointKey, _Tracked] = {}
        self._adopted: dict[EndpointKey, Endpoint] = {}
        self._admin_drains: set[tuple[str, str]] = set()
        self._reloads: Counter[str] = Counter()
        self._last_reload_error: str | None = None
        self._cycles = 0
        self._probe_durations: dict[str, DurationHistogram] = {}
        self._tree_due = True  # write the whole tree on the first cycle (changes made while we were down)
        self._lds: LdsSource = "try"  # where the next tree write takes LDS from (sidecar.tree)
        self._ads_keys_missing: str | None = None  # ADS: why the listeners cannot be served yet
        self._lock = asyncio.Lock()  # one cycle at a time (loop, reload and admin calls)

    @property
    def topology(self) -> Topology:
        return self._topo

    # -- startup -----------------------------------------------------------------------

    def adopt_published(self) -> int:
        """Seed states and weights from the EDS files on disk, so a restart changes nothing."""
        if not isinstance(self._publisher, EdsPublisher):
            return 0  # nginx: its files hold health only, which the first probe cycle re-derives
        count = 0
        for pool in self._eds_pools():
            found = read_published(self._publisher.xds_dir, pool.name)
            if found is None:
                continue
            data, endpoints = found
            self._publisher.adopt(pool.name, data)
            for ep in endpoints:
                self._adopted[EndpointKey(pool.name, ep.worker, ep.address, ep.port)] = ep
                count += 1
        log_event(_log, logging.INFO, "startup.adopted", endpoints=count)
        return count

    # -- the cycle ------------------------------------------------------------------------

    async def cycle(self) -> None:
        """Resolve, probe every endpoint once, decide and publish."""
        async with self._lock:
            await self._sync_endpoints()
            keys = list(self._tracked)
            now, policy = self._clock(), self.config.health
            reports = await asyncio.gather(*(
                self._prober.probe(self._target(k), health=self._tracked[k].state.needs_health(now, policy))
                for k in keys))
            for key, report in zip(keys, reports, strict=True):
                self._observe(key, report)
            await self._publish()
            self._cycles += 1

    async def republish(self) -> None:
        """Decide and publish from the current states, without probing (after a drain call)."""
        async with self._lock:
            await self._publish()

    async def reload(self) -> bool:
        """Load the topology again; on success adopt it and publish CDS/LDS/EDS, else keep the old."""
        path = self.config.topology
        lds: LdsSource = "keep"
        try:
            topo, warnings = await asyncio.to_thread(load_topology, path)
            # nginx: the sidecar writes upstream files only; ADS: it serves resources, no tree
            if self.config.nginx is None and self.config.serve_xds is None:
                xds_dir_for(self.config, topo)
                lds = await asyncio.to_thread(keys_for_reload, self._topo, topo)
            elif self.config.serve_xds is not None and topo.auth is not None:
                await asyncio.to_thread(resolve_secrets, topo)  # ADS serves the listeners: keys needed
        except SecretError as exc:
            # Listeners or auth changed and the keys are not here: LDS cannot be rendered, so
            # nothing of this topology is applied (CDS without its LDS would be half of it).
            problems = [f"{field}: {reason}" for field, reason in exc.problems]
            self._reloads["needs_keys"] += 1
            self._last_reload_error = ("listeners or auth changed and the API keys cannot be read "
                                       "(keeping the running configuration): " + "; ".join(problems[:5]))
            log_event(_log, logging.ERROR, "topology.reload_needs_keys", file=str(path), errors=problems,
                      note="listeners or auth changed; the sidecar needs the API keys to render LDS. "
                      "Keeping the previous configuration; render with `confgen render` where the keys are")
            return False
        except (TopologyError, ConfigError) as exc:
            diagnostics = [str(d) for d in getattr(exc, "diagnostics", ())] or [str(exc)]
            self._reloads["error"] += 1
            self._last_reload_error = "; ".join(diagnostics[:5])
            log_event(_log, logging.ERROR, "topology.reload_failed", file=str(path), errors=diagnostics,
                      note="keeping the previous configuration")
            return False
        for w in warnings:
            log_event(_log, logging.WARNING, "topology.warning", diagnostic=str(w))
        async with self._lock:
            for gone in {p.name for p in self._topo.pools} - {p.name for p in topo.pools}:
                self._publisher.forget(gone)
                if self._limiter is not None:
                    self._limiter.forget(gone)
            self._topo = topo
            self._tree_due = True
            if not isinstance(lds, str) or self._lds == "keep":
                self._lds = lds  # a pending LDS render (keys read) survives a reload that keeps LDS
            self._reloads["ok"] += 1
            self._last_reload_error = None
        log_event(_log, logging.INFO, "topology.reloaded", file=str(path), name=topo.name, pools=len(topo.pools))
        await self.cycle()
        return True

    def set_drain(self, pool: str, worker: str, drained: bool) -> bool:
        """Admin drain/undrain of a worker as written in the topology; False when unknown."""
        try:
            known = any(w.address == worker for w in self._topo.pool(pool).workers)
        except KeyError:
            return False
        if not known:
            return False
        if drained:
            self._admin_drains.add((pool, worker))
        else:
            self._admin_drains.discard((pool, worker))
        log_event(_log, logging.INFO, "worker.drain" if drained else "worker.undrain", pool=pool, worker=worker)
        return True

    # -- steps ----------------------------------------------------------------------------

    def _eds_pools(self) -> list[Pool]:
        return [p for p in self._topo.pools if p.discovery == "eds"]

    async def _sync_endpoints(self) -> None:
        wanted: dict[EndpointKey, tuple[Pool, Worker]] = {}
        jobs: list[tuple[Pool, Worker, str, int]] = []
        for pool in self._eds_pools():
            for worker in pool.workers:
                parts = split_address(worker.address)
                assert parts is not None  # checked when the topology was loaded
                jobs.append((pool, worker, *parts))
        answers = await asyncio.gather(*(self._resolver.resolve(host, port) for _, _, host, port in jobs))
        self._resolver.forget_except({(host, port) for _, _, host, port in jobs})
        for (pool, worker, _host, port), addresses in zip(jobs, answers, strict=True):
            for address in addresses:
                wanted[EndpointKey(pool.name, worker.address, address, port)] = (pool, worker)
        now = self._clock()
        for key in list(self._tracked):
            if key not in wanted:
                del self._tracked[key]
                log_event(_log, logging.INFO, "endpoint.removed", pool=key.pool, worker=key.worker,
                          address=key.address)
        for key, (pool, worker) in wanted.items():
            capacity = worker.capacity or pool.capacity
            labels = tuple(sorted(worker.labels.items()))
            tracked = self._tracked.get(key)
            if tracked is not None:
                tracked.capacity, tracked.zone, tracked.engine = capacity, worker.zone, pool.engine
                tracked.share, tracked.labels = worker.weight, labels
                continue
            adopted = self._adopted.pop(key, None)
            if adopted is not None:
                state = EndpointState.adopt(adopted.health, now)
                self._tracked[key] = _Tracked(state, capacity, worker.zone, pool.engine, worker.weight, labels,
                                              weight=adopted.weight)
            else:
                self._tracked[key] = _Tracked(EndpointState.new(now), capacity, worker.zone, pool.engine,
                                              worker.weight, labels)
                log_event(_log, logging.INFO, "endpoint.added", pool=key.pool, worker=key.worker,
                          address=key.address)

    def _target(self, key: EndpointKey) -> Target:
        pool = self._topo.pool(key.pool)
        host = split_address(key.worker)
        host_header = key.worker if host is not None and host[0] != key.address else None
        return Target(key.address, key.port, pool.engine, pool.health_path, pool.metrics_path, host_header)

    def _observe(self, key: EndpointKey, report: ProbeReport) -> None:
        tracked = self._tracked[key]
        before = tracked.state.published
        tracked.state = tracked.state.observe(report.result, self.config.health)
        tracked.report = report
        self._probe_durations.setdefault(key.pool, DurationHistogram()).observe(report.duration_s)
        tracked.sample = report.result.sample
        tracked.trend = tracked.trend.observe(report.result.sample, report.result.at, self.config.weights)
        if report.error is not None:
            tracked.errors[report.error] += 1
            log_event(_log, logging.DEBUG, "probe.failed", pool=key.pool, worker=key.worker,
                      address=key.address, kind=report.error, detail=report.detail)
        if tracked.state.published is not before:
            log_event(_log, logging.INFO, "endpoint.status", pool=key.pool, worker=key.worker,
                      address=key.address, before=str(before), after=str(tracked.state.published),
                      reason=tracked.state.reason)

    def _apply_drains(self, now: float) -> None:
        # One pass over the topology, not one per endpoint (thousands of endpoints per cycle).
        planned = {(p.name, w.address) for p in self._topo.pools for w in p.workers if w.drain}
        for key, tracked in self._tracked.items():
            wanted = (key.pool, key.worker) in planned or (key.pool, key.worker) in self._admin_drains
            if wanted and not tracked.state.drained:
                tracked.state = tracked.state.drain()
            elif not wanted and tracked.state.drained:
                tracked.state = tracked.state.undrain(now)

    def _endpoints(self, pool: Pool, now: float) -> list[Endpoint]:
        members = {k: t for k, t in self._tracked.items() if k.pool == pool.name}
        decisions = decide_pool({k: t.state for k, t in members.items()}, self.config.health, now)
        speeds = relative_speeds({k: t.trend.token_latency_s for k, t in members.items()})
        out: list[Endpoint] = []
        for key, decision in decisions.items():
            tracked = members[key]
            tracked.decision = decision
            if decision.status is Status.UNHEALTHY or decision.min_weight:
                w = 1  # out of rotation or failing: a return starts from the bottom of the ramp
            elif decision.status is Status.DRAINING:
                w = tracked.weight or 1
            else:
                w = weight(tracked.sample, tracked.capacity, tracked.weight, self.config.weights,
                           ramp=decision.ramp, share=tracked.share, speed=speeds[key], queue=tracked.trend.queue)
            tracked.weight = w
            out.append(Endpoint(key.address, key.port, weight=w, health=decision.status.value,
                                zone=tracked.zone, worker=key.worker, labels=tracked.labels))
        return out

    async def _publish(self) -> None:
        now = self._clock()
        self._apply_drains(now)
        per_pool = {pool.name: self._endpoints(pool, now) for pool in self._eds_pools()}
        if self._tree_due and isinstance(self._publisher, EdsPublisher):
            await self._write_tree(per_pool)
        elif self._tree_due and isinstance(self._publisher, AdsPublisher):
            topo = self._topo
            try:
                secrets = await asyncio.to_thread(resolve_secrets, topo) if topo.auth is not None else {}
            except SecretError as exc:  # startup without the keys: say so each cycle, never die
                self._ads_keys_missing = str(exc)
                log_event(_log, logging.ERROR, "ads.needs_keys", error=str(exc),
                          note="the listeners (LDS) cannot be served without the API keys; retrying every cycle")
                return
            self._ads_keys_missing = None
            served = await asyncio.to_thread(envoy.ads.resources, topo, secrets)
            await self._publisher.publish_tree(served, per_pool)
            self._tree_due = False
        else:
            for pool_name, endpoints in per_pool.items():
                self._publisher.offer(pool_name, endpoints)
        if self._limiter is not None:
            await self._limiter.apply({pool.name: self._pool_load(pool) for pool in self._eds_pools()})

    def _pool_load(self, pool: Pool) -> PoolLoad:
        """Capacity and saturation of the endpoints that serve (sidecar.backpressure's rule)."""
        rotation = {k: t for k, t in self._tracked.items() if k.pool == pool.name and t.decision is not None
                    and t.decision.status in (Status.HEALTHY, Status.DEGRADED)}
        serving = {k: t for k, t in rotation.items() if t.decision is not None and not t.decision.min_weight}
        counted = serving or rotation  # all failing: the sidecar stands back, as with ejections
        samples = {k: t.sample for k, t in counted.items()}
        capacities = {k: t.capacity for k, t in counted.items()}
        sampled = any(sample is not None for sample in samples.values())
        saturation = pool_saturation(samples, capacities, self.config.weights.kv_knee) if sampled else None
        return PoolLoad(sum(capacities.values()), saturation, self._topo.backpressure.max_utilization)

    async def _write_tree(self, per_pool: Mapping[str, list[Endpoint]]) -> None:
        assert isinstance(self._publisher, EdsPublisher)  # only the Envoy target writes a tree
        topo = self._topo
        xds_dir = self._publisher.xds_dir
        config_dir = await asyncio.to_thread(config_dir_for_tree, xds_dir, topo)
        files, lds, why = await asyncio.to_thread(render_tree, topo, xds_dir=xds_dir, config_dir=config_dir,
                                                  lds=self._lds)
        self._lds = "keep"  # the keys (if any were read) are dropped with this call
        if lds == "absent":
            log_event(_log, logging.ERROR, "tree.lds_absent", dir=str(xds_dir), note=why)
        elif lds == "kept":
            log_event(_log, logging.INFO, "tree.lds_kept", dir=str(xds_dir), note=why)
        for pool_name, endpoints in per_pool.items():
            rel = layout.eds_path(pool_name)
            if endpoints:
                files[rel] = self._publisher.render(pool_name, endpoints)
            elif (kept := self._publisher.written(pool_name)) is not None:
                files[rel] = kept  # nothing resolved yet: never replace endpoints by none
        await self._publisher.write_tree(files, mode=0o600 if topo.auth is not None else 0o644)
        self._tree_due = False

    # -- views ----------------------------------------------------------------------------

    def stale(self) -> str | None:
        """Why the running configuration is older than the topology file (None when current)."""
        return self._last_reload_error

    def not_ready(self) -> list[str]:
        reasons = []
        if self._cycles == 0:
            reasons.append("first probe cycle not done")
        if isinstance(self._publisher, NginxPublisher):
            reasons += self._publisher.problems()
        else:
            reasons += [f"last {name} update rejected by Envoy" for name in sorted(self._publisher.rejected)]
        if self._ads_keys_missing is not None:
            reasons.append(f"nothing served over ADS yet: {self._ads_keys_missing}")
        return reasons

    def view(self) -> Snapshot:
        """An immutable picture of the fleet now (built per call: cheap, never stale)."""
        pools: list[PoolView] = []
        for pool in self._eds_pools():
            members = sorted((k, t) for k, t in self._tracked.items() if k.pool == pool.name)
            views = tuple(
                EndpointView(
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
                )
                for k, t in members
            )
            samples = {k: t.sample for k, t in members}
            pools.append(PoolView(
                name=pool.name,
                engine=pool.engine,
                saturation=pool_saturation(samples, {k: t.capacity for k, t in members},
                                           self.config.weights.kv_knee),
                queue_depth=queue_depth(samples),
                publishes=self._publisher.publishes[pool.name],
                rejections=self._publisher.rejections[pool.name],
                rejected=pool.name in self._publisher.rejected,
                endpoints=views,
                inflight_limit=self._limiter.in_force.get(pool.name) if self._limiter is not None else None,
                probe_durations=h.view() if (h := self._probe_durations.get(pool.name)) is not None else None,
            ))
        return Snapshot(
            topology=self._topo.name,
            pools=tuple(pools),
            reloads=dict(self._reloads),
            cycles=self._cycles,
            not_ready=tuple(self.not_ready()),
            last_reload_error=self._last_reload_error,
            xds=self._publisher.view() if isinstance(self._publisher, AdsPublisher) else None,
        )
