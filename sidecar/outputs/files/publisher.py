"""Put endpoints where Envoy reads them, and make sure Envoy took them.

- EDS: one file per pool (`confgen.envoy.layout.eds_path`), built only by confgen's EDS
  builder (`render_eds`), replaced atomically (`confgen.output.atomic_write`: temp file in
  the same directory, fsync, rename, fsync the directory), only when the bytes change, at
  most once per pool per `debounce_s` (the newest content wins); rendered in a thread.
- After each write the publisher polls Envoy's admin stats for the pool's cluster:
  `version_text` equal to the file's version_info confirms it; `update_rejected` moving
  means Envoy refused it and keeps the previous endpoints (file xDS has no ACK). A
  rejection is logged at error level, counted, and keeps the pool in `rejected` (the
  daemon reports not-ready) until a write of that pool is confirmed.
- The whole tree (first cycle, topology reload): rendered by `confgen.envoy.render` in a
  thread, each pool's EDS file replaced by the endpoints the daemon decided (or the file
  already written, never by none), then written with `confgen.output.write_tree` in
  Envoy's order (EDS before CDS before LDS); skipped entirely when the disk already holds
  it, since any rename in a watched directory makes Envoy reload everything watching it.
- An empty endpoint list is never published for a pool (Envoy would drop every host).

Disk writes run in a thread (fsync blocks) under one lock, so a tree write and a pool
write never interleave.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from confgen.endpoints import Endpoint
from confgen.envoy import layout, parse_eds, render_eds
from confgen.errors import OutputError
from confgen.model import Topology
from confgen.output import atomic_write, diff_tree, write_tree
from confgen.plan import sheddable_pools
from sidecar.config import xds_dir_for
from sidecar.logs import log_event
from sidecar.outputs.contract import Built, OutputStatus, Wiring, published
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.files.limiter import InflightLimiter
from sidecar.outputs.files.tree import LdsSource, config_dir_for_tree, keys_for_reload, render_tree

if TYPE_CHECKING:
    from sidecar.fleet import Cycle, Snapshot

__all__ = ["EdsPublisher", "build", "read_published"]

_log = logging.getLogger("sidecar.outputs.files.publisher")
_POLL_S = 0.02


def _int(stats: Mapping[str, int | str], name: str) -> int:
    value = stats.get(name, 0)
    return value if isinstance(value, int) else 0


def read_published(xds_dir: Path, pool: str) -> tuple[bytes, list[Endpoint]] | None:
    """The pool's EDS file as on disk and its endpoints, or None when absent or unreadable.

    Reading is the inverse of `render_eds`; the endpoints are only returned when
    re-rendering them reproduces the file byte for byte, so nothing is guessed.
    """
    path = xds_dir / layout.eds_path(pool)
    try:
        data = path.read_bytes()
        _, endpoints = parse_eds(data)
    except OSError as exc:
        log_event(_log, logging.WARNING, "eds.adopt_unreadable", pool=pool, file=str(path), error=str(exc))
        return None
    except ValueError as exc:
        log_event(_log, logging.WARNING, "eds.adopt_mismatch", pool=pool, file=str(path),
                  note=f"endpoints not adopted: {exc}")
        return None
    return data, endpoints


class EdsPublisher:
    """Writes EDS files and the whole tree; confirms through the admin stats (a `Publisher`)."""

    name = "envoy"

    def __init__(self, xds_dir: Path, admin: EnvoyAdmin, *, debounce_s: float, confirm_timeout_s: float) -> None:
        self.xds_dir = xds_dir
        self._admin = admin
        self._debounce_s = debounce_s
        self._confirm_timeout_s = confirm_timeout_s
        self._written: dict[str, bytes] = {}
        self._offers: dict[str, list[Endpoint]] = {}  # newest endpoints per pool, not rendered yet
        self._pending: dict[str, bytes] = {}
        self._last_write_at: dict[str, float] = {}
        self._flushers: dict[str, asyncio.Task[None]] = {}
        self._write_lock = asyncio.Lock()
        self.publishes: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()
        self.rejected: set[str] = set()  # pools (or "cds"/"lds") whose last write Envoy refused
        self.versions: dict[str, str] = {}
        self._lds: LdsSource = "try"  # where the next tree write takes LDS from (sidecar.outputs.files.tree)
        # Writes that failed (read-only or full disk...), by pool or "tree"; `failing` holds
        # the ones whose last attempt failed, with why (cleared by the next good write).
        self.write_failures: Counter[str] = Counter()
        self.failing: dict[str, str] = {}
        # Files changed on disk by someone else (restored), by pool or file.
        self.external_changes: Counter[str] = Counter()
        self._stamps: dict[str, tuple[int, int, int]] = {}  # relative path -> (inode, mtime_ns, size) we left
        self._rejected_seen: dict[str, int] = {}  # pool -> Envoy's update_rejected at our last look

    def adopt(self, pool: str) -> list[Endpoint]:
        """The endpoints of `pool`'s EDS file on disk, kept as written (no write needed to reach it)."""
        found = read_published(self.xds_dir, pool)
        if found is None:
            return []
        self._written[pool] = found[0]
        self._stamp(layout.eds_path(pool))
        return found[1]

    def _stamp(self, rel: str) -> None:
        try:
            st = (self.xds_dir / rel).stat()
        except OSError:
            self._stamps.pop(rel, None)
            return
        self._stamps[rel] = (st.st_ino, st.st_mtime_ns, st.st_size)

    def _written_ok(self, files: Mapping[str, bytes]) -> None:
        """The disk holds `files`: no write of the tree or of its pools is failing any more."""
        self.failing.pop("tree", None)
        for rel in files:
            pool = _eds_pool(rel)
            if pool is not None:
                self.failing.pop(pool, None)

    def _stamp_all(self, files: Mapping[str, bytes]) -> None:
        for rel in files:
            self._stamp(rel)

    def _write_stamped(self, rel: str, data: bytes) -> None:
        atomic_write(self.xds_dir / rel, data)
        self._stamp(rel)

    async def check_published(self) -> bool:
        """Whether the files we wrote are still ours (`changed_on_disk`, in a thread, never while
        a write of ours is half done). False: a tree file was replaced, publish_all is due."""
        async with self._write_lock:
            changed = await asyncio.to_thread(self.changed_on_disk)
        return all(rel.startswith("eds/") for rel in changed)

    def changed_on_disk(self) -> list[str]:
        """Files we wrote that someone else replaced since (blocking: stats).

        An EDS file found changed is forgotten as written, so the next offer rewrites it;
        the caller rewrites the tree for the others. Each is counted and logged.
        """
        changed = []
        for rel, stamp in list(self._stamps.items()):
            try:
                st = (self.xds_dir / rel).stat()
                now: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                now = None
            if now == stamp:
                continue
            changed.append(rel)
            del self._stamps[rel]
            pool = _eds_pool(rel)
            self.external_changes[pool or rel] += 1
            if pool is not None:
                self._written.pop(pool, None)
            log_event(_log, logging.ERROR, "file.changed_on_disk", file=str(self.xds_dir / rel),
                      note="not written by the sidecar; restoring its own content")
        return changed

    async def start(self) -> None:
        """Nothing to open (files are written on demand); remove the temp files a predecessor
        killed mid-write left behind (found by the fault campaign: SIGKILL between mkstemp
        and rename leaves `.endpoints.json.XXXXXXXX.tmp`)."""
        removed = await asyncio.to_thread(_sweep_temp_files, self.xds_dir)
        if removed:
            log_event(_log, logging.WARNING, "startup.temp_files_removed", dir=str(self.xds_dir), files=removed,
                      note="left by a write that was killed before its rename; the files Envoy reads are whole")

    def problems(self) -> list[str]:
        return ([f"last {name} update rejected by Envoy" for name in sorted(self.rejected)]
                + [f"write failing: {why}" for _, why in sorted(self.failing.items())])

    def status(self) -> OutputStatus:
        return OutputStatus(problems=tuple(self.problems()),
                            pools=published(self.publishes, self.rejections, self.rejected),
                            write_failures=dict(self.write_failures), external_changes=dict(self.external_changes))

    async def apply(self, cycle: Cycle) -> None:
        """Nothing more: the cycle's endpoints came through `offer` / `publish_all`."""

    def update(self, fleet: Snapshot) -> None:
        """Nothing: it publishes what the daemon decided, not the fleet view."""

    def forget(self, pool: str) -> None:
        """A pool left the topology: drop its bookkeeping (its file goes with the tree)."""
        for table in (self._written, self._offers, self._pending, self._last_write_at, self.versions, self.failing,
                      self._rejected_seen):
            table.pop(pool, None)
        self._stamps.pop(layout.eds_path(pool), None)
        self.rejected.discard(pool)
        self.publishes.pop(pool, None)
        self.rejections.pop(pool, None)

    def offer(self, pool: str, endpoints: Sequence[Endpoint]) -> None:
        """Publish `endpoints` for `pool` if they differ from what is on disk (debounced)."""
        if not endpoints:
            log_event(_log, logging.WARNING, "eds.empty_refused", pool=pool,
                      note="no endpoint to publish; keeping the current file")
            return
        self._offers[pool] = list(endpoints)  # rendered by the pool's flusher, in a thread
        # A flusher that has returned but whose done callback has not run yet is still listed:
        # it will not see this offer, so a new one starts (else the offer waits for the next).
        running = self._flushers.get(pool)
        if running is None or running.done():
            task = asyncio.create_task(self._flush(pool), name=f"eds-flush-{pool}")
            self._flushers[pool] = task
            task.add_done_callback(functools.partial(self._flushed, pool))

    def _flushed(self, pool: str, task: asyncio.Task[None]) -> None:
        if self._flushers.get(pool) is task:
            del self._flushers[pool]
        if not task.cancelled() and (exc := task.exception()) is not None:
            log_event(_log, logging.ERROR, "eds.write_failed", pool=pool, error=f"{type(exc).__name__}: {exc}")

    async def _flush(self, pool: str) -> None:
        loop = asyncio.get_running_loop()
        while pool in self._offers or pool in self._pending:
            if pool in self._offers:  # the newest offer wins; rendering 10k endpoints takes ~0.2 s
                self._pending[pool] = await asyncio.to_thread(render_eds, pool, self._offers.pop(pool))
                continue
            wait = self._last_write_at.get(pool, -1e9) + self._debounce_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # offers made meanwhile are rendered first
            data = self._pending.pop(pool, None)
            if data is None or data == self._written.get(pool):
                continue
            before = await self._admin.stats(_eds_pattern(pool))
            self._note_foreign_rejection(pool, before)
            path = self.xds_dir / layout.eds_path(pool)
            try:
                async with self._write_lock:
                    await asyncio.to_thread(self._write_stamped, layout.eds_path(pool), data)
            except OSError as exc:
                self.write_failures[pool] += 1
                self.failing[pool] = f"cannot write {path}: {exc.strerror or exc}"
                log_event(_log, logging.ERROR, "eds.write_failed", pool=pool, file=str(path),
                          error=exc.strerror or str(exc), note="the previous file stays; retried next cycle")
                return
            self.failing.pop(pool, None)
            self._written[pool] = data
            self._last_write_at[pool] = loop.time()
            self.publishes[pool] += 1
            version = json.loads(data)["version_info"]
            self.versions[pool] = version
            log_event(_log, logging.INFO, "eds.published", pool=pool, version=version, file=str(path))
            await self._confirm_eds(pool, version, before)

    def _note_foreign_rejection(self, pool: str, stats: dict[str, int | str] | None) -> None:
        """Count a rejection Envoy made of a file we did not write (seen before our next write)."""
        if stats is None:
            return
        now = _int(stats, f"cluster.{pool}.update_rejected")
        seen = self._rejected_seen.get(pool)
        self._rejected_seen[pool] = now
        if seen is not None and now > seen:
            self.rejections[pool] += 1
            log_event(_log, logging.ERROR, "eds.rejected", pool=pool, update_rejected=now,
                      note="Envoy refused a file the sidecar did not write; it kept its previous endpoints")

    async def _confirm_eds(self, pool: str, version: str, before: dict[str, int | str] | None) -> None:
        prefix = f"cluster.{pool}."
        rejected_before = _int(before, prefix + "update_rejected") if before is not None else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._confirm_timeout_s
        seen: dict[str, int | str] | None = None
        while loop.time() < deadline:
            seen = await self._admin.stats(_eds_pattern(pool))
            if seen is not None:
                self._rejected_seen[pool] = _int(seen, prefix + "update_rejected")
                if str(seen.get(prefix + "version_text", "")).strip('"') == version:
                    self.rejected.discard(pool)
                    return
                if rejected_before is None:
                    rejected_before = _int(seen, prefix + "update_rejected")
                elif _int(seen, prefix + "update_rejected") > rejected_before:
                    self.rejections[pool] += 1
                    self.rejected.add(pool)
                    log_event(_log, logging.ERROR, "eds.rejected", pool=pool, version=version,
                              envoy_version=str(seen.get(prefix + "version_text", "")).strip('"'),
                              update_rejected=_int(seen, prefix + "update_rejected"),
                              file=str(self.xds_dir / layout.eds_path(pool)),
                              note="Envoy refused the file and keeps its previous endpoints; see its log")
                    return
            await asyncio.sleep(_POLL_S)
        log_event(_log, logging.WARNING, "eds.unconfirmed", pool=pool, version=version,
                  admin=self._admin.base_url, reachable=seen is not None, timeout_s=self._confirm_timeout_s)

    def check_reload(self, old: Topology, new: Topology) -> Callable[[], None]:
        """Where the next tree write takes LDS from (sidecar.outputs.files.tree.keys_for_reload: the keys are
        read only when listeners or auth change); SecretError when they are needed and unreadable."""
        lds = keys_for_reload(old, new)

        def adopt() -> None:
            if not isinstance(lds, str) or self._lds == "keep":
                self._lds = lds  # a pending LDS render (keys read) survives a reload that keeps LDS

        return adopt

    async def publish_all(self, topo: Topology, endpoints: Mapping[str, Sequence[Endpoint]]) -> bool:
        """Render the whole tree for `topo` (in a thread: sidecar.outputs.files.tree.render_tree), each pool's EDS
        file holding `endpoints` (or what is written, never none), and write what changed."""
        config_dir = await asyncio.to_thread(config_dir_for_tree, self.xds_dir, topo)
        files, lds, why = await asyncio.to_thread(render_tree, topo, xds_dir=self.xds_dir, config_dir=config_dir,
                                                  lds=self._lds)
        self._lds = "keep"  # the keys (if any were read) are dropped with this call
        if lds == "absent":
            log_event(_log, logging.ERROR, "tree.lds_absent", dir=str(self.xds_dir), note=why)
        elif lds == "kept":
            log_event(_log, logging.INFO, "tree.lds_kept", dir=str(self.xds_dir), note=why)
        kept = dict(self._written)
        eds = await asyncio.to_thread(_render_eds_files, endpoints, kept)
        files.update(eds)
        try:
            await self.write_tree(files, mode=0o600 if topo.auth is not None else 0o644)
        except OutputError:
            return False  # counted and logged; the files on disk stay; the daemon retries next cycle
        return True

    async def write_tree(self, files: Mapping[str, bytes], mode: int) -> bool:
        """Write the whole rendered output if it differs from the disk; False when it did not.

        Raises OutputError when the disk refuses (counted in write_failures["tree"]).
        """
        async with self._write_lock:
            changed = await asyncio.to_thread(_changed_files, files, self.xds_dir)
            if not changed:
                self._written_ok(files)
                await asyncio.to_thread(self._stamp_all, files)
                return False
            eds_before = {pool: await self._admin.stats(_eds_pattern(pool))
                          for pool in (_eds_pool(rel) for rel in changed) if pool is not None}
            before = await self._admin.stats(_XDS_PATTERN)
            try:
                await asyncio.to_thread(functools.partial(write_tree, files, self.xds_dir, mode,
                                                          rank=layout.write_rank))
            except OutputError as exc:
                self.write_failures["tree"] += 1
                self.failing["tree"] = str(exc)
                log_event(_log, logging.ERROR, "tree.write_failed", dir=str(self.xds_dir), error=str(exc),
                          note="the files on disk stay as they were; retried next cycle")
                raise
            self._written_ok(files)
            await asyncio.to_thread(self._stamp_all, files)
        loop = asyncio.get_running_loop()
        for rel, data in files.items():
            pool = _eds_pool(rel)
            if pool is not None:
                self._written[pool] = data
                if rel in changed:
                    self._last_write_at[pool] = loop.time()
                    self.publishes[pool] += 1
                    self.versions[pool] = json.loads(data)["version_info"]
        log_event(_log, logging.INFO, "tree.written", dir=str(self.xds_dir), changed=sorted(changed))
        kinds = {kind for kind, rel in (("cds", layout.CDS), ("lds", layout.LDS)) if rel in changed}
        await self._confirm_tree(before, kinds)
        for pool, pool_before in eds_before.items():
            await self._confirm_eds(pool, self.versions[pool], pool_before)
        return True

    async def _confirm_tree(self, before: dict[str, int | str] | None, kinds: set[str]) -> None:
        if not kinds:
            return
        if before is None:
            log_event(_log, logging.WARNING, "tree.unconfirmed", admin=self._admin.base_url, reachable=False)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._confirm_timeout_s
        prefixes = {"cds": "cluster_manager.cds.", "lds": "listener_manager.lds."}
        pending = {kind: prefixes[kind] for kind in kinds}
        while pending and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
            seen = await self._admin.stats(_XDS_PATTERN)
            if seen is None:
                continue
            for kind, prefix in list(pending.items()):
                if _int(seen, prefix + "update_rejected") > _int(before, prefix + "update_rejected"):
                    self.rejections[kind] += 1
                    self.rejected.add(kind)
                    log_event(_log, logging.ERROR, f"{kind}.rejected",
                              note="Envoy refused the file and keeps its previous config; see its log")
                    del pending[kind]
                elif _int(seen, prefix + "update_success") > _int(before, prefix + "update_success"):
                    self.rejected.discard(kind)
                    del pending[kind]
        if pending:
            log_event(_log, logging.WARNING, "tree.unconfirmed", admin=self._admin.base_url,
                      kinds=sorted(pending), timeout_s=self._confirm_timeout_s)

    async def close(self, grace_s: float = 2.0) -> None:
        """Let a write in progress finish (never leave one half done), then stop."""
        tasks = list(self._flushers.values())
        if tasks:
            _done, still = await asyncio.wait(tasks, timeout=grace_s)
            for task in still:
                task.cancel()
            await asyncio.gather(*still, return_exceptions=True)


def build(wiring: Wiring) -> Built:
    """The file-xDS publisher (`OUTPUTS["envoy"]`), and its limits through Envoy's admin runtime."""
    config = wiring.config
    publisher = EdsPublisher(xds_dir_for(config, wiring.topo), wiring.admin, debounce_s=config.publish_debounce_s,
                             confirm_timeout_s=config.confirm_timeout_s)
    topology = wiring.topology
    limiter = InflightLimiter(wiring.admin, config.ingresses, config.saturation,
                              sheddable=lambda: sheddable_pools(topology()))
    admin = wiring.admin

    async def write(values: Mapping[str, int]) -> bool:
        """Other outputs' runtime values, into Envoy's admin layer; read back to confirm."""
        wanted = {key: str(value) for key, value in values.items()}
        if not await admin.set_runtime(wanted):
            return False
        held = await admin.runtime()
        return held is not None and all(held.get(key) == value for key, value in wanted.items())

    wiring.runtime.writer = write
    return Built((limiter,), publisher=publisher)


def _render_eds_files(endpoints: Mapping[str, Sequence[Endpoint]], kept: Mapping[str, bytes]) -> dict[str, bytes]:
    """Each pool's EDS file holding `endpoints`, or the file already written when there are none
    (never replace endpoints by none); blocking: run in a thread."""
    files: dict[str, bytes] = {}
    for pool, members in endpoints.items():
        if members:
            files[layout.eds_path(pool)] = render_eds(pool, members)
        elif pool in kept:
            files[layout.eds_path(pool)] = kept[pool]
    return files


_XDS_PATTERN = r"^(cluster_manager\.cds|listener_manager\.lds)\.update_(success|rejected)$"


_TEMP_NAME = re.compile(r"\..+\.[A-Za-z0-9_]{8}\.tmp")  # confgen.output.atomic_write's mkstemp names


def _sweep_temp_files(xds_dir: Path) -> list[str]:
    """Remove atomic_write's leftover temp files under `xds_dir` (blocking); their relative paths."""
    if not xds_dir.is_dir():
        return []
    removed = []
    for path in sorted(xds_dir.rglob(".*.tmp")):
        if _TEMP_NAME.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(str(path.relative_to(xds_dir)))
    return removed


def _eds_pattern(pool: str) -> str:
    return rf"^cluster\.{re.escape(pool)}\.(update_(success|rejected)|version_text)$"


def _eds_pool(rel: str) -> str | None:
    parts = rel.split("/")
    return parts[1] if len(parts) == 3 and rel == layout.eds_path(parts[1]) else None


def _changed_files(files: Mapping[str, bytes], out_dir: Path) -> set[str]:
    """Files whose bytes on disk differ from `files` (missing ones included)."""
    if not out_dir.is_dir():
        return set(files)
    return {line.split(":", 1)[1].strip() for line in diff_tree(files, out_dir) if not line.startswith("extra:")}
