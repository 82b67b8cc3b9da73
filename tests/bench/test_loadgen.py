"""The bench's load generator and workloads: latency from the scheduled send time, conversation
turns in order, identical arrivals from one seed. No performance figure is asserted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench import _stats, _workload, loadgen


@contextlib.asynccontextmanager
async def _server(delay_s: float) -> AsyncIterator[str]:
    """A loopback server that answers every POST after `delay_s` (not streaming)."""
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(delay_s)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _req(i: int, t: float, after: int | None = None) -> dict[str, Any]:
    return {"i": i, "t": t, "body": {"prompt": "x", "max_tokens": 1}, "headers": {}, "after": after}


def test_a_held_back_turn_is_measured_from_its_scheduled_time() -> None:
    """A turn that must wait for the previous turn of its conversation is sent after that turn
    ends, and its latency counts from its scheduled time (the wait is charged, no coordinated
    omission); a request scheduled after the deadline is recorded as not sent."""
    async def run() -> list[dict[str, Any]]:
        async with _server(0.3) as url:
            job = {"targets": [url], "requests": [_req(0, 0.0), _req(1, 0.05, after=0), _req(2, 5.0)],
                   "deadline_s": 1.0, "timeout_s": 10.0}
            return await loadgen.run_job(job)

    first, second, late = asyncio.run(run())
    assert first["status"] == second["status"] == 200
    assert second["start"] >= first["end"]
    summary = _stats.summarize([first, second])
    assert summary["p99_ms"] == (second["end"] - second["sched"]) * 1000
    assert second["end"] - second["sched"] > second["end"] - second["start"]
    assert late["error"] == "not sent" and late["start"] is None
    assert _stats.summarize([first, second, late])["errors"] == 1


def test_bursty_arrivals_keep_the_mean_rate_and_bunch_up() -> None:
    """Bursty arrivals offer the same mean rate as Poisson but most of them in the on-phases."""
    spec = _workload.WorkloadSpec(rate=20.0, count=2000, seed=3, session_share=0.0, arrivals="bursty")
    reqs = _workload.build(spec)
    span = reqs[-1]["t"]
    assert 0.85 < len(reqs) / span / 20.0 < 1.15
    on = sum(1 for r in reqs if (r["t"] % spec.burst_period_s) < spec.burst_period_s / 2)
    assert on / len(reqs) > 0.75


def test_a_load_generator_started_ahead_waits_for_its_targets(tmp_path: Path) -> None:
    """Started with "targets": None, the load generator process sends nothing until `go` hands it
    the targets; then it runs the job and `collect` returns one record per request."""
    async def serve_and_run() -> list[dict[str, Any]]:
        async with _server(0.01) as url:
            job = {"targets": None, "requests": [_req(0, 0.0), _req(1, 0.05)], "deadline_s": 1.0, "timeout_s": 10.0}
            proc, out = loadgen.start(job, tmp_path, "ahead")
            await asyncio.sleep(0.2)
            assert proc.poll() is None and not out.exists()
            loadgen.go(proc, [url])
            return await asyncio.to_thread(loadgen.collect, proc, out, 60.0)

    records = asyncio.run(serve_and_run())
    assert [r["status"] for r in records] == [200, 200]


def test_the_timeline_counts_each_second_what_was_offered_shed_completed_and_in_flight() -> None:
    """`_stats.timeline` (the overload report's second-by-second table): a request counts where it was
    scheduled (offered, shed) and where it ended (completed); in flight at a second's end are the
    admitted requests started before it and not ended by it."""
    def rec(sched: float, start: float, end: float | None, status: int, ttft: float | None = None) -> dict[str, Any]:
        return {"sched": sched, "start": start, "end": end, "status": status, "error": None, "ttft": ttft}

    records = [rec(0.1, 0.1, 1.5, 200, 0.4), rec(0.2, 0.2, 0.21, 429), rec(0.9, 0.9, 2.5, 200, 0.2),
               rec(1.2, 1.2, 1.3, 200, 0.05), rec(1.7, 1.7, None, 0)]
    line = _stats.timeline(records, 0.0, 3.0)
    assert [(s["t"], s["offered"], s["shed"], s["completed"], s["in_flight"]) for s in line] == [
        (0.0, 3, 1, 0, 2),  # two admitted still running at 1.0, the 429 counted shed, not in flight
        (1.0, 2, 0, 2, 2),  # 1.5 and 1.3 ended; 0.9's (to 2.5) and the unanswered one run on
        (2.0, 0, 0, 1, 1),  # 0.9's ends at 2.5; the one never answered is still counted in flight
    ]
    # the served requests scheduled in each second: their TTFT and end-to-end P90 (nearest rank)
    assert [(s["ttft_p90_ms"], s["e2e_p90_ms"]) for s in line] == [
        (pytest.approx(400.0), pytest.approx(1600.0)), (pytest.approx(50.0), pytest.approx(100.0)), (None, None)]
