"""The daemon's cycle: topology -> endpoints -> probes -> states -> decisions -> weights -> publish.

One `Daemon` owns the mutable picture of the fleet and is driven by `main` (the loop,
signals), the topology watcher (reloads) and `server` (admin drain calls). It runs on one
event loop, but a cycle awaits (probes, publishing), so one lock keeps a cycle, a reload
and a republish from interleaving. It talks to its outputs only through
`sidecar.outputs.contract` (`publish.Publishing`): the publisher's interface for the endpoints,
the one `Output` contract for the rest (each cycle applied, the fleet view handed over, a pool
that left forgotten), and it keeps nothing of theirs: what the view shows of them is their
`status`. The per-endpoint records and steps are in `tracked`, the admin drains in `drains`.
A cycle returns one `sidecar.fleet.Cycle`. Readers (the metrics collector, /state, the outputs
answering per request) get an immutable `Snapshot` rebuilt after every change, so nobody sees a
half-updated cycle and an endpoint that left the topology leaves every view with it.
"""

from __future__ import annotations

import asyncio
import logging
import stat
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from confgen.errors import Diagnostic, SecretError, TopologyError
from confgen.model import Topology
from confgen.topology import load as load_topology
from sidecar.config import ConfigError, SidecarConfig, publisher_mismatch, xds_dir_for
from sidecar.daemon.drains import Drains
from sidecar.daemon.publish import Publishing, eds_pools
from sidecar.daemon.tracked import Tracker
from sidecar.daemon.view import pool_view
from sidecar.fleet import Cycle, Snapshot
from sidecar.logs import log_event
from sidecar.observe.probe import Prober
from sidecar.observe.resolve import Resolver
from sidecar.outputs.contract import Output, Publisher

__all__ = ["Daemon"]

_log = logging.getLogger("sidecar.daemon")


def _load(config: SidecarConfig, path: Path) -> tuple[Topology, list[Diagnostic]]:
    """Load a topology for a reload (blocking: run in a thread); a FIFO or device put at the path is refused
    unread (opening a FIFO blocks until someone writes it)."""
    try:
        regular = stat.S_ISREG(path.stat().st_mode)
    except OSError:
        regular = True  # the loader says why it cannot read it
    if not regular:
        raise TopologyError([Diagnostic(str(path), 0, 0, "", "not a regular file (a FIFO, a device?): not read")])
    topo, warnings = load_topology(path)
    if (problem := publisher_mismatch(config, topo)) is not None:
        raise ConfigError(problem)  # the reload is refused; the running topology stays
    if config.nginx is None and config.serve_xds is None:
        xds_dir_for(config, topo)  # the file target needs somewhere to write
    return topo, warnings


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
        outputs: Sequence[Output] = (),
    ) -> None:
        """`publisher` carries the endpoints; `outputs` are the others (limiter, services), applied
        after it in their order."""
        self.config = config
        self._topo = topo
        self._prober = prober
        self._resolver = resolver
        self._clock = clock
        self._outputs = Publishing(publisher, outputs)
        self._tracker = Tracker(config)
        self._drains = Drains(config)
        self._reloads: Counter[str] = Counter()
        self._last_reload_error: str | None = None
        self._cycles = 0
        self._lock = asyncio.Lock()  # one cycle at a time (loop, reload and admin calls)

    @property
    def topology(self) -> Topology:
        return self._topo

    # -- startup -----------------------------------------------------------------------

    def restore(self) -> tuple[int, int]:
        """Blocking (reads files): what a restart must not change. The states and weights already
        published (the endpoints seeded), then the drains set through POST /drain before it
        (`drains_file_for`; the count kept)."""
        count = self._outputs.adopt(self._topo, self._tracker)
        log_event(_log, logging.INFO, "startup.adopted", endpoints=count)
        return count, self._drains.load(self._topo)

    # -- the cycle ------------------------------------------------------------------------

    async def cycle(self) -> Cycle | None:
        """Resolve, probe every endpoint once, decide, publish and apply; then the fleet view to
        every output. The cycle's result (None when nothing was publishable yet)."""
        async with self._lock:
            tracker = self._tracker
            await tracker.sync(eds_pools(self._topo), self._resolver, self._clock)
            keys = list(tracker.tracked)
            now, policy = self._clock(), self.config.health
            reports = await asyncio.gather(*(
                self._prober.probe(tracker.target(k, self._topo),
                                   health=(st := tracker.tracked[k].state).needs_health(now, policy),
                                   metrics=st.needs_metrics(now, policy))
                for k in keys))
            for key, report in zip(keys, reports, strict=True):
                tracker.observe(key, report)
            result = await self._outputs.run(self._topo, tracker, self._drains, self._clock)
            if self._drains.unsaved():  # a reload dropped a drained worker: a restart must not drain it again
                await asyncio.to_thread(self._drains.save, self._topo)
            self._cycles += 1
            self._outputs.update(self.view())
            return result

    async def republish(self) -> None:
        """Decide and publish from the current states, without probing (after a drain call); the
        admin drains are saved first, so a restart keeps them."""
        async with self._lock:
            await asyncio.to_thread(self._drains.save, self._topo)
            await self._outputs.run(self._topo, self._tracker, self._drains, self._clock)

    async def reload(self) -> bool:
        """Load the topology again; on success adopt it and publish CDS/LDS/EDS, else keep the old."""
        path = self.config.topology
        try:
            topo, warnings = await asyncio.to_thread(_load, self.config, path)
            adopt = await asyncio.to_thread(self._outputs.publisher.check_reload, self._topo, topo)
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
                self._outputs.forget(gone)
                self._tracker.forget(gone)
            self._topo = topo
            self._outputs.tree_due = True
            adopt()
            self._reloads["ok"] += 1
            self._last_reload_error = None
        log_event(_log, logging.INFO, "topology.reloaded", file=str(path), name=topo.name, pools=len(topo.pools))
        await self.cycle()
        return True

    def drained_by_topology(self, pool: str, worker: str) -> bool:
        """The topology itself drains this worker (`drain: true`): no admin call undrains it."""
        try:
            return any(w.address == worker and w.drain for w in self._topo.pool(pool).workers)
        except KeyError:
            return False

    def set_drain(self, pool: str, worker: str, drained: bool) -> bool:
        """Admin drain/undrain of a worker as written in the topology; False when unknown."""
        return self._drains.set(self._topo, pool, worker, drained)

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
        elif not self._outputs.published:
            reasons.append("nothing published to the proxy yet")
        return reasons

    def problems(self) -> list[str]:
        """What the proxy does not run of the sidecar's decisions, and why (/state, /readyz's
        body, confgen_sidecar_problems): every output's own, the publisher's first (an update the
        proxy refused, a write failing), then the others' ("picker: ..."). Never a readiness
        failure (see `not_ready`)."""
        return list(self._outputs.status().problems)

    def view(self) -> Snapshot:
        """An immutable picture of the fleet now (built per call: cheap, never stale)."""
        status = self._outputs.status()
        return Snapshot(
            topology=self._topo.name,
            pools=tuple(pool_view(pool, self._tracker, status.pool(pool.name)) for pool in eds_pools(self._topo)),
            reloads=dict(self._reloads),
            cycles=self._cycles,
            not_ready=tuple(self.not_ready()),
            problems=status.problems,
            last_reload_error=self._last_reload_error,
            xds=status.xds,
            write_failures=dict(status.write_failures),
            external_changes=dict(status.external_changes),
            refused=dict(status.refused),
        )
