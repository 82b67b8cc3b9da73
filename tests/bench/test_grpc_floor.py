"""bench.grpc_floor measures what it says: only the checked half calls the server, every call answered."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import grpc_floor


@pytest.mark.parametrize(("kind", "calls"), [("aio", 200), ("none", 0), ("extproc", 200)])
def test_only_the_checked_half_calls_the_server(tmp_path: Path, kind: str, calls: int) -> None:
    row = grpc_floor._round(kind, rate=200.0, count=400, workdir=tmp_path)
    assert row["failed"] == 0
    # one ShouldRateLimit call (or one ext_proc stream) per checked request (odd i), none for `none`
    assert row["calls_ok"] == calls
    assert row["checks_failed_open"] == 0
    assert row["p50_free_ms"] > 0 and row["p50_checked_ms"] > 0
