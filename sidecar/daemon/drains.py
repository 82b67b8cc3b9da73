"""The admin drains (POST /drain): kept, persisted beside the published files, applied each cycle."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from confgen.model import Topology
from confgen.output import atomic_write
from sidecar.config import SidecarConfig, drains_file_for
from sidecar.daemon.tracked import Tracked
from sidecar.fleet import EndpointKey
from sidecar.logs import log_event

__all__ = ["Drains"]

_log = logging.getLogger("sidecar.daemon")
_MAX_DRAINS_FILE = 4 * 1024 * 1024


class Drains:
    """The workers drained through the admin API, and what the drains file holds of them."""

    def __init__(self, config: SidecarConfig) -> None:
        self._config = config
        self._admin: set[tuple[str, str]] = set()
        self._saved: frozenset[tuple[str, str]] = frozenset()  # what the drains file holds

    def load(self, topo: Topology) -> int:
        """Blocking: the drains set through POST /drain before a restart (`drains_file_for`); the count kept.

        Entries for workers no longer in the topology are dropped; an unreadable file is logged and
        ignored (it is rewritten at the next drain call)."""
        path = drains_file_for(self._config, topo)
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
        known = {(p.name, w.address) for p in topo.pools for w in p.workers}
        self._admin = pairs & known
        self._saved = frozenset(pairs)
        log_event(_log, logging.INFO, "drains.restored", file=str(path), drains=len(self._admin),
                  dropped=sorted(f"{p}/{w}" for p, w in pairs - known)[:20])
        return len(self._admin)

    def unsaved(self) -> bool:
        """The admin drains differ from what the file holds (a drain call, or a reload dropped a worker)."""
        return frozenset(self._admin) != self._saved

    def save(self, topo: Topology) -> None:
        """Blocking: write the admin drains when they changed (atomically, beside the published files)."""
        path = drains_file_for(self._config, topo)
        current = frozenset(self._admin)
        if path is None or current == self._saved:
            return
        body = {"version": 1, "drains": [{"pool": p, "worker": w} for p, w in sorted(current)]}
        try:
            atomic_write(path, json.dumps(body, indent=1).encode() + b"\n", mode=0o600)
        except OSError as exc:
            log_event(_log, logging.ERROR, "drains.write_failed", file=str(path), error=str(exc),
                      note="the drain is in force but will not survive a restart")
            return
        self._saved = current

    def set(self, topo: Topology, pool: str, worker: str, drained: bool) -> bool:
        """Admin drain/undrain of a worker as written in the topology; False when unknown (an undrain of a
        drain still held, for a worker the topology no longer has, is done: it would come back drained)."""
        if not drained and (pool, worker) in self._admin:
            self._admin.discard((pool, worker))
            log_event(_log, logging.INFO, "worker.undrain", pool=pool, worker=worker)
            return True
        try:
            known = any(w.address == worker for w in topo.pool(pool).workers)
        except KeyError:
            return False
        if not known:
            return False
        if drained:
            self._admin.add((pool, worker))
        else:
            self._admin.discard((pool, worker))
        log_event(_log, logging.INFO, "worker.drain" if drained else "worker.undrain", pool=pool, worker=worker)
        return True

    def apply(self, topo: Topology, tracked: Iterable[tuple[EndpointKey, Tracked]], now: float) -> None:
        """Drain the endpoints the topology or the admin drains, undrain the others."""
        # One pass over the topology, not one per endpoint (thousands of endpoints per cycle).
        planned = {(p.name, w.address) for p in topo.pools for w in p.workers if w.drain}
        if self._admin:  # a worker the topology dropped takes its drain with it (as a restart's load() does)
            self._admin &= {(p.name, w.address) for p in topo.pools for w in p.workers}
        for key, t in tracked:
            wanted = (key.pool, key.worker) in planned or (key.pool, key.worker) in self._admin
            if wanted and not t.state.drained:
                t.state = t.state.drain()
            elif not wanted and t.state.drained:
                t.state = t.state.undrain(now)
