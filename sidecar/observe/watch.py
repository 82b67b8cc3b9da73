"""Notice when the topology file changes, however it changes.

watchdog watches the file's *directory* (not the file): editors that write a temp file
and rename it, and a Kubernetes ConfigMap mount (where `topology.yaml` is a symlink
through `..data`, swapped atomically to a new timestamped directory) both replace the
inode a file watch would follow. Events arrive on watchdog's thread and are handed to
the event loop with `call_soon_threadsafe`; a burst is debounced, and the callback runs
only when the content hash differs from the last one seen (or the file cannot be read,
so the caller can report it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from sidecar.logs import log_event

__all__ = ["TopologyWatcher"]

_log = logging.getLogger("sidecar.observe.watch")


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class _Bridge(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, poke: Callable[[], None]) -> None:
        self._loop = loop
        self._poke = poke

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return  # reads, including our own
        self._loop.call_soon_threadsafe(self._poke)


class TopologyWatcher:
    """Calls `on_change()` (on the event loop) after the topology's content changed."""

    def __init__(self, path: Path, on_change: Callable[[], Awaitable[object]], debounce_s: float = 0.2) -> None:
        self._path = path
        self._on_change = on_change
        self._debounce_s = debounce_s
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
            await asyncio.gather(self._task, return_exceptions=True)

    def _poke(self) -> None:
        if self._observer is None or self._loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(self._debounce_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
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
