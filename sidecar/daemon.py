"""The daemon's cycle: topology -> endpoints -> probes -> states -> decisions -> weights -> publish.

One `Daemon` owns the mutable picture of the fleet and is driven by `main` (the loop,
signals), the topology watcher (reloads) and `server` (admin drain calls). It runs on one
event loop, but a cycle awaits (probes, publishing), so one lock keeps a cycle, a reload
and a republish from interleaving. It talks to its publisher only through the
`sidecar.outputs.publisher.Publisher` interface. Readers (the metrics collector, /state) get an
immutable `Snapshot` rebuilt after every change, so a scrape never sees a half-updated
cycle and an endpoint that left the topology leaves every view with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from confgen.balancing import is_hashing
from confgen.envoy import Endpoint
from confgen.envoy.eds import static_weight
from confgen.errors import Diagnostic, SecretError, TopologyError
from confgen.model import ENVOY_CAP_MAX, Pool, Topology, Worker, split_address
from confgen.output import atomic_write
from confgen.topology import load as load_topology
from sidecar.config import ConfigError, SidecarConfig, drains_file_for, xds_dir_for
from sidecar.decide.hysteresis import gate
from sidecar.decide.saturation import Headroom, PoolLoad, PoolSaturation, QueueWatch, assess
from sidecar.decide.state import Decision, EndpointState, Status, decide_pool
from sidecar.decide.weights import Trend, pool_saturation, queue_depth, relative_speeds, smooth, target
from sidecar.fleet import EndpointKey, EndpointView, PoolView, Snapshot
from sidecar.logs import log_event
from sidecar.observe.engines import LoadSample
from sidecar.observe.histogram import DurationHistogram
from sidecar.observe.probe import Prober, ProbeReport, Target
from sidecar.observe.resolve import Resolver
from sidecar.outputs.publisher import Limiter, Publisher

__all__ = ["Daemon"]

_log = logging.getLogger("sidecar.daemon")


@dataclass(slots=True)
class _Tracked:
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


_MAX_DRAINS_FILE = 4 * 1024 * 1024


class Daemon:
    """The fleet as the sidecar sees it, and the cycle that updates and publishes it."""

    def __init__(
        self,
        config: SidecarConfig,
        topo: Topology,
        *,
        prober: Prober,
        resolver: Resolver,
        publisher: Publisher,
        clock: Callable[[], float],
        limiter: Limiter | None = None,
    ) -> None:
        self.config = config
        self._topo = topo
        self._prober = prober
        self._resolver = resolver
        self._publisher = publisher
        self._clock = clock
        self._limiter = limiter
        self._watches: dict[str, QueueWatch] = {}  # pool -> its standing-queue detector (sidecar.decide.saturation)
        self._verdicts: dict[str, PoolSaturation] = {}  # pool -> the detector's last verdict
        self._tracked: dict[EndpointKey, _Tracked] = {}
        self._adopted: dict[EndpointKey, Endpoint] = {}
        self._admin_drains: set[tuple[str, str]] = set()
        self._drains_saved: frozenset[tuple[str, str]] = frozenset()  # what the drains file holds
        self._reloads: Counter[str] = Counter()
        self._last_reload_error: str | None = None
        self._cycles = 0
        self._published = False  # publish_all succeeded once: the proxy has a whole config from us
        self._probe_durations: dict[str, DurationHistogram] = {}
        self._tree_due = True  # write the whole tree on the first cycle (changes made while we were down)
        self._lock = asyncio.Lock()  # one cycle at a time (loop, reload and admin calls)

    @property
    def topology(self) -> Topology:
        return self._topo

    # -- startup -----------------------------------------------------------------------

    def adopt_published(self) -> int:
        """Seed states and weights from what is published already, so a restart changes nothing."""
        count = 0
        for pool in self._eds_pools():
            for ep in self._publisher.adopt(pool.name):
                self._adopted[EndpointKey(pool.name, ep.worker, ep.address, ep.port)] = ep
                count += 1
        log_event(_log, logging.INFO, "startup.adopted", endpoints=count)
        return count

    def load_drains(self) -> int:
        """Blocking: the drains set through POST /drain before a restart (`drains_file_for`); the count kept.

        Entries for workers no longer in the topology are dropped; an unreadable file is logged and
        ignored (it is rewritten at the next drain call)."""
        path = drains_file_for(self.config, self._topo)
        if path is None:
            return 0
        try:
            with path.open("rb") as f:
                raw = f.read(_MAX_DRAINS_FILE + 1)
            if len(raw) > _MAX_DRAINS_FILE:
                raise ValueError(f"larger than {_MAX_DRAINS_FILE} bytes")
            entries = json.loads(raw)["drains"]
            pairs = {(str(e["pool"]), str(e["worker"])) for e in entries}
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            log_event(_log, logging.ERROR, "drains.unreadable", file=str(path), error=str(exc),
                      note="starting without the drains set before the restart")
            return 0
        known = {(p.name, w.address) for p in self._topo.pools for w in p.workers}
        self._admin_drains = pairs & known
        self._drains_saved = frozenset(pairs)
        log_event(_log, logging.INFO, "drains.restored", file=str(path), drains=len(self._admin_drains),
                  dropped=sorted(f"{p}/{w}" for p, w in pairs - known)[:20])
        return len(self._admin_drains)

    def _save_drains(self) -> None:
        """Blocking: write the admin drains when they changed (atomically, beside the published files)."""
        path = drains_file_for(self.config, self._topo)
        current = frozenset(self._admin_drains)
        if path is None or current == self._drains_saved:
            return
        body = {"version": 1, "drains": [{"pool": p, "worker": w} for p, w in sorted(current)]}
        try:
            atomic_write(path, json.dumps(body, indent=1).encode() + b"\n", mode=0o600)
        except OSError as exc:
            log_event(_log, logging.ERROR, "drains.write_failed", file=str(path), error=str(exc),
                      note="the drain is in force but will not survive a restart")
            return
        self._drains_saved = current

    # -- the cycle ------------------------------------------------------------------------

    async def cycle(self) -> None:
        """Resolve, probe every endpoint once, decide and publish."""
        async with self._lock:
            await self._sync_endpoints()
            keys = list(self._tracked)
            now, policy = self._clock(), self.config.health
            reports = await asyncio.gather(*(
                self._prober.probe(self._target(k), health=(st := self._tracked[k].state).needs_health(now, policy),
                                   metrics=st.needs_metrics(now, policy))
                for k in keys))
            for key, report in zip(keys, reports, strict=True):
                self._observe(key, report)
            await self._publish()
            self._cycles += 1

    async def republish(self) -> None:
        """Decide and publish from the current states, without probing (after a drain call); the
        admin drains are saved first, so a restart keeps them."""
        async with self._lock:
            await asyncio.to_thread(self._save_drains)
            await self._publish()

    async def reload(self) -> bool:
        """Load the topology again; on success adopt it and publish CDS/LDS/EDS, else keep the old."""
        path = self.config.topology
        try:
            topo, warnings = await asyncio.to_thread(self._load, path)
            adopt = await asyncio.to_thread(self._publisher.check_reload, self._topo, topo)
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
                self._watches.pop(gone, None)
                self._verdicts.pop(gone, None)
            self._topo = topo
            self._tree_due = True
            adopt()
            self._reloads["ok"] += 1
            self._last_reload_error = None
        log_event(_log, logging.INFO, "topology.reloaded", file=str(path), name=topo.name, pools=len(topo.pools))
        await self.cycle()
        return True

    def _load(self, path: Path) -> tuple[Topology, list[Diagnostic]]:
        """Load a topology for a reload (blocking: run in a thread)."""
        topo, warnings = load_topology(path)
        if self.config.nginx is None and self.config.serve_xds is None:
            xds_dir_for(self.config, topo)  # the file target needs somewhere to write
        return topo, warnings

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
        if report.result.metrics_checked:  # else a quiet engine's last sample stands (sidecar.decide.state)
            tracked.sample = report.result.sample
            tracked.trend = tracked.trend.observe(report.result.sample, report.result.at, self.config.weights)
            tracked.headroom = tracked.headroom.observe(report.result.sample, report.result.at, tracked.capacity,
                                                        self.config.saturation)
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
        # Hashing pools (ring_hash, maglev) keep the rendered weights: Envoy builds the ring or
        # table from the weights, so every weight change re-maps sessions onto other workers and
        # throws their KV cache away (measured: chat sessions' P99 2.5x worse with moving weights).
        # Health still changes, and the pool's hash_balance_factor bounds the load per worker.
        hashing = is_hashing(pool.balancing.policy)
        shedding = self._limiter is not None and self._limiter.shedding(pool.name)
        for key, decision in decisions.items():
            tracked = members[key]
            tracked.decision = decision
            if hashing:
                w, streak = static_weight(tracked.capacity, tracked.share, self.config.weights.max_weight), 0
            elif decision.status is Status.UNHEALTHY or decision.min_weight:
                w, streak = 1, 0  # out of rotation or failing: a return starts from the bottom of the ramp
            elif decision.status is Status.DRAINING:
                w, streak = tracked.weight or 1, 0
            else:
                policy = self.config.weights
                if shedding:  # under overload weights follow throughput (WeightPolicy.shedding_speed_exponent)
                    policy = replace(policy, speed_exponent=policy.shedding_speed_exponent)
                goal = target(tracked.sample, tracked.capacity, policy, ramp=decision.ramp, share=tracked.share,
                              speed=speeds[key], queue=tracked.trend.queue)
                gated = gate(smooth(goal, tracked.weight, policy), tracked.weight, tracked.streak,
                             self.config.hysteresis, max_weight=policy.max_weight, immediate=decision.ramp < 1)
                w, streak = gated.weight, gated.streak
            tracked.weight, tracked.streak = w, streak
            out.append(Endpoint(key.address, key.port, weight=w, health=decision.status.value,
                                zone=tracked.zone, worker=key.worker, labels=tracked.labels))
        return out

    async def _publish(self) -> None:
        now = self._clock()
        self._apply_drains(now)
        per_pool = {pool.name: self._endpoints(pool, now) for pool in self._eds_pools()}
        if not await self._publisher.check_published():
            self._tree_due = True  # someone replaced a file we wrote: put ours back
        if self._tree_due:
            if not await self._publisher.publish_all(self._topo, per_pool):
                return  # not publishable yet (e.g. ADS without the API keys): retried next cycle
            self._tree_due = False
            self._published = True
        else:
            for pool_name, endpoints in per_pool.items():
                self._publisher.offer(pool_name, endpoints)
        loads = {}
        for pool in self._eds_pools():
            load = self._pool_load(pool, now)
            watch = self._watches.get(pool.name, QueueWatch()).observe(load.saturation, now, self.config.saturation)
            self._watches[pool.name] = watch
            loads[pool.name] = PoolLoad(load.cap, watch.apply(load.saturation))
            self._verdicts[pool.name] = loads[pool.name].saturation
        if self._limiter is not None:
            await self._limiter.apply(loads, now)

    def _saturated(self, pool: str) -> tuple[bool, str]:
        """The pool's verdict as of the last cycle, and why: the engines' rules, else the
        limiter's in-flight watch (which also runs between cycles)."""
        verdict = self._verdicts.get(pool)
        if verdict is not None and verdict.saturated:
            return True, verdict.reason
        if self._limiter is not None and self._limiter.inflight_saturated(pool):
            return True, "inflight"
        return False, ""

    def _pool_load(self, pool: Pool, now: float) -> PoolLoad:
        """The render's safety cap and the per-worker headroom verdict over the endpoints in
        rotation (the pool's standing queue, `QueueWatch`, is added once per cycle in `_publish`)."""
        rotation = {k: t for k, t in self._tracked.items() if k.pool == pool.name and t.decision is not None
                    and t.decision.status in (Status.HEALTHY, Status.DEGRADED)}
        serving = {k: t for k, t in rotation.items() if t.decision is not None and not t.decision.min_weight}
        counted = serving or rotation  # all failing: the sidecar stands back, as with ejections
        saturation = assess(((t.headroom, t.capacity) for t in counted.values()), now, self.config.saturation,
                            self._topo.backpressure.max_utilization)
        return PoolLoad(self._topo.in_flight_cap(pool, ENVOY_CAP_MAX), saturation)

    # -- views ----------------------------------------------------------------------------

    def stale(self) -> str | None:
        """Why the running configuration is older than the topology file (None when current)."""
        return self._last_reload_error

    def not_ready(self) -> list[str]:
        """Why this sidecar cannot serve its proxy yet: before its first cycle and first whole
        publish. Nothing else: a refused update or a failing write (`problems`) is the same on
        every replica reading the same topology, and the proxy keeps serving its last good
        config; failing readiness for it would empty the Service of every proxy pod at once."""
        reasons = []
        if self._cycles == 0:
            reasons.append("first probe cycle not done")
        elif not self._published:
            reasons.append("nothing published to the proxy yet")
        return reasons

    def problems(self) -> list[str]:
        """What the proxy does not run of the sidecar's decisions, and why (/state, /readyz's
        body, confgen_sidecar_problems): an update the proxy refused, a write failing."""
        return self._publisher.problems()

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
                    token_latency_s=t.trend.token_latency_s,
                )
                for k, t in members
            )
            samples = {k: t.sample for k, t in members}
            saturated, reason = self._saturated(pool.name)
            pools.append(PoolView(
                name=pool.name,
                engine=pool.engine,
                model=pool.models[0],
                saturation=pool_saturation(samples, {k: t.capacity for k, t in members}),
                queue_depth=queue_depth(samples),
                publishes=self._publisher.publishes[pool.name],
                rejections=self._publisher.rejections[pool.name],
                rejected=pool.name in self._publisher.rejected,
                endpoints=views,
                inflight_limit=self._limiter.in_force.get(pool.name) if self._limiter is not None else None,
                saturated=saturated,
                saturated_reason=reason,
                queue_per_slot=self._watches[pool.name].signal if pool.name in self._watches else None,
                inflight_past_batch=self._limiter.inflight_signal(pool.name) if self._limiter is not None else None,
                shed=dict(self._limiter.shed.get(pool.name, {})) if self._limiter is not None else {},
                shedding=self._limiter.shedding(pool.name) if self._limiter is not None else False,
                sheddable_share=self._limiter.sheddable_share.get(pool.name) if self._limiter is not None else None,
                probe_durations=h.view() if (h := self._probe_durations.get(pool.name)) is not None else None,
            ))
        return Snapshot(
            topology=self._topo.name,
            pools=tuple(pools),
            reloads=dict(self._reloads),
            cycles=self._cycles,
            not_ready=tuple(self.not_ready()),
            problems=tuple(self.problems()),
            last_reload_error=self._last_reload_error,
            xds=self._publisher.xds_view(),
            write_failures=dict(self._publisher.write_failures),
            external_changes=dict(self._publisher.external_changes),
        )
