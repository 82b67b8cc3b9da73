"""The topology watcher (sidecar.observe.watch) on a real directory with watchdog's real observer: what it
hands the daemon, and when."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

from sidecar.observe.watch import TopologyWatcher

FULL = b"version: 1\nname: t\n" + b"# padding\n" * 200


def test_a_file_written_in_place_with_pauses_is_read_once_its_writer_closes_it(tmp_path: Path) -> None:
    """Found by review: a topology rewritten in place (truncated, then written in two parts 0.5 s apart) was
    read during the pause, since the pause outlasted the debounce: a half file, adopted when that half was
    valid YAML (an operator's drain was lost with the worker the half left out). It is read once its writer
    closes it: every look the watcher hands on sees the whole file."""
    path = tmp_path / "topology.yaml"
    path.write_bytes(b"version: 1\nname: before\n")
    seen: list[bytes] = []

    async def main() -> None:
        changed = asyncio.Event()

        async def on_change() -> None:
            seen.append(path.read_bytes())
            if seen[-1] == FULL:
                changed.set()

        watcher = TopologyWatcher(path, on_change, debounce_s=0.05)
        watcher.start()
        try:
            def write() -> None:
                with path.open("wb") as fh:  # truncated: the file is empty from here
                    fh.write(FULL[:100])
                    fh.flush()
                    os.fsync(fh.fileno())
                    time.sleep(0.5)  # the writer's pause (the fault under test), ten debounces long
                    fh.write(FULL[100:])

            writer = threading.Thread(target=write)
            writer.start()
            async with asyncio.timeout(15):
                await changed.wait()
            writer.join()
        finally:
            await watcher.stop()

    asyncio.run(main())
    assert seen and all(content == FULL for content in seen), [len(c) for c in seen]


def test_a_fifo_put_at_the_path_is_not_read_and_stop_does_not_hang(tmp_path: Path) -> None:
    """Found by review: a FIFO at the topology's path blocked the watcher's read for good (and the sidecar's
    shutdown with it). Anything but a regular file is unreadable: reported, not read."""
    path = tmp_path / "topology.yaml"
    path.write_bytes(b"version: 1\n")
    calls: list[bool] = []

    async def main() -> None:
        changed = asyncio.Event()

        async def on_change() -> None:
            calls.append(path.is_fifo())
            changed.set()

        watcher = TopologyWatcher(path, on_change, debounce_s=0.05)
        watcher.start()
        try:
            path.unlink()
            os.mkfifo(path)
            async with asyncio.timeout(10):
                await changed.wait()
        finally:
            async with asyncio.timeout(10):
                await watcher.stop()

    asyncio.run(main())
    assert calls and calls[-1]


def test_a_reload_refuses_a_fifo_unread(tmp_path: Path) -> None:
    """The reload the watcher triggers does not open a FIFO either (opening one blocks until someone writes
    it): refused with a reason, so the running topology stays."""
    import pytest

    from confgen.errors import TopologyError
    from sidecar.config import from_argv
    from sidecar.daemon import _load

    path = tmp_path / "topology.yaml"
    os.mkfifo(path)
    config = from_argv(["--topology", str(path), "--serve-xds", "127.0.0.1:18000"])
    with pytest.raises(TopologyError, match="not a regular file"):
        _load(config, path)
