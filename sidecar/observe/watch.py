"""Notice when the topology file changes, however it changes.

watchdog watches the file's *directory* (not the file): editors that write a temp file
and rename it, and a Kubernetes ConfigMap mount (where `topology.yaml` is a symlink
through `..data`, swapped atomically to a new timestamped directory) both replace the
inode a file watch would follow. Events arrive on watchdog's thread and are handed to
the event loop with `call_soon_threadsafe`; a burst is debounced, and the callback runs
only when the content hash differs from the last one seen (or the file cannot be read,
so the caller can report it).

A file written in place (truncated, then written, perhaps in pauses) is looked at once its
writer closes it (inotify's close-after-write), not while it is half written: a pause longer
than the debounce used to get a half file adopted when that half was valid YAML. Without a
close (a writer that keeps it open, a platform without close events) it is looked at
`write_grace_s` after its last write. Writing by rename (editors, ConfigMaps) is atomic anyway.
Anything but a regular file at the path (a FIFO, a device) is not read: unreadable.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from confgen._yaml import MAX_BYTES
from sidecar.logs import log_event

__all__ = ["TopologyWatcher"]

_log = logging.getLogger("sidecar.observe.watch")


_MAX_READ = MAX_BYTES + 1  # the loader's own cap and one byte more


def _digest(path: Path) -> str | None:
    """The content's hash; None when it is not a regular file (a FIFO would block the read for good, a device
    never end) or cannot be read."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        with path.open("rb") as fh:
            return hashlib.sha256(fh.read(_MAX_READ)).hexdigest()
    except OSError:
        return None


class _Bridge(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, poke: Callable[[str, str], None]) -> None:
        self._loop = loop
        self._poke = poke

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return  # reads, including our own
        path = event.src_path if isinstance(event.src_path, str) else bytes(event.src_path).decode(errors="replace")
        self._loop.call_soon_threadsafe(self._poke, event.event_type, Path(path).name)


class TopologyWatcher:
    """Calls `on_change()` (on the event loop) after the topology's content changed."""

    def __init__(self, path: Path, on_change: Callable[[], Awaitable[object]], debounce_s: float = 0.2,
                 write_grace_s: float = 5.0) -> None:
        self._path = path
        self._on_change = on_change
        self._debounce_s = debounce_s
        self._write_grace_s = write_grace_s
        self._writing = False  # the file was written in place and its writer has not closed it yet
        self._observer: BaseObserver | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._digest: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start watching (call from the event loop's thread)."""
        self._loop = asyncio.get_running_loop()
        self._digest = _digest(self._path)
        observer = Observer()
        directory = self._path.absolute().parent
        observer.schedule(_Bridge(self._loop, self._poke), str(directory), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer
        log_event(_log, logging.INFO, "watch.started", directory=str(directory), file=self._path.name)

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            await asyncio.to_thread(observer.join, 5.0)
        if self._task is not None:
            # a reload in progress (its reading is bounded: no FIFO or device is read) finishes; not waited for ever
            _done, pending = await asyncio.wait([self._task], timeout=5.0)
            for task in pending:
                task.cancel()

    def _poke(self, kind: str = "", name: str = "") -> None:
        if self._observer is None or self._loop is None:
            return
        if name == self._path.name:
            if kind == "modified":
                self._writing = True  # written in place: wait for its writer to close it
            elif kind in ("closed", "moved", "created", "deleted"):
                self._writing = False
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(self._write_grace_s if self._writing else self._debounce_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._writing = False  # closed, or the grace passed without a close
        if self._task is not None and not self._task.done():
            self._again = True  # a check is running; check once more after it
            return
        self._task = asyncio.ensure_future(self._check())

    async def _check(self) -> None:
        while True:
            self._again = False
            digest = await asyncio.to_thread(_digest, self._path)
            if digest is None or digest != self._digest:
                self._digest = digest
                log_event(_log, logging.INFO, "watch.changed", file=str(self._path), readable=digest is not None)
                await self._on_change()
            if not self._again:
                return
