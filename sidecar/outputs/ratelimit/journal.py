"""Charges kept for a store that is away: a bounded journal on disk (sqlite3, fsync'd).

An answer's charge (its usage, or its estimate) that cannot reach Redis, and the requests a
sidecar admitted on its local floor, are appended here with the time they happened; the
service replays them, oldest first, once Redis answers again (each with its own time, so a
reservation's deadline is judged as it was). The file survives a sidecar restart: a new
process replays what the old one kept. At most `max_entries` are kept; past that a charge
is dropped and counted (the caller's metric), never blocking the request.

Every call runs on one worker thread (sqlite3 blocks): the event loop only awaits it.
Commits use synchronous=FULL, so an entry acknowledged is on disk.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sidecar.outputs.ratelimit.store import Op

__all__ = ["Entry", "Journal"]

Entry = tuple[int, float, list[Op]]  # (row id, wall time it happened, the ops to apply)


class Journal:
    """Append, read oldest first, remove; `path` None keeps it in memory (nothing to survive)."""

    def __init__(self, path: Path | None, max_entries: int = 20_000) -> None:
        self.path = path
        self.max_entries = max_entries
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ratelimit-journal")
        self._db: sqlite3.Connection | None = None
        self.size = 0

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(self.path) if self.path is not None else ":memory:", timeout=1.0)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, at REAL, ops TEXT)")
            db.commit()
            self._db = db
            self.size = int(db.execute("SELECT COUNT(*) FROM charges").fetchone()[0])
        return self._db

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def open(self) -> int:
        """Open (creating) the file; the entries it already holds."""
        await self._run(self._open)
        return self.size

    def _append(self, at: float, ops: list[Op]) -> bool:
        db = self._open()
        if self.size >= self.max_entries:
            return False
        db.execute("INSERT INTO charges (at, ops) VALUES (?, ?)", (at, json.dumps([asdict(op) for op in ops])))
        db.commit()
        self.size += 1
        return True

    async def append(self, at: float, ops: list[Op]) -> bool:
        """Keep ops that happened at `at`; False when the journal is full (dropped)."""
        result: bool = await self._run(self._append, at, ops)
        return result

    def _oldest(self, limit: int) -> list[Entry]:
        db = self._open()
        rows = db.execute("SELECT id, at, ops FROM charges ORDER BY id LIMIT ?", (limit,)).fetchall()
        out: list[Entry] = []
        for row_id, at, text in rows:
            try:
                ops = [Op(**item) for item in json.loads(text)]
            except (ValueError, TypeError):
                ops = []  # unreadable (not ours): removed with the batch
            out.append((int(row_id), float(at), ops))
        return out

    async def oldest(self, limit: int = 200) -> list[Entry]:
        result: list[Entry] = await self._run(self._oldest, limit)
        return result

    def _remove(self, ids: list[int]) -> None:
        db = self._open()
        db.executemany("DELETE FROM charges WHERE id = ?", [(i,) for i in ids])
        db.commit()
        self.size = int(db.execute("SELECT COUNT(*) FROM charges").fetchone()[0])

    async def remove(self, ids: list[int]) -> None:
        if ids:
            await self._run(self._remove, ids)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    async def close(self) -> None:
        await self._run(self._close)
        self._executor.shutdown(wait=True)
