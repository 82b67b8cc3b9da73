"""Probes end within their deadline against workers that misbehave on purpose (real servers
on loopback: an aiohttp app whose handlers dribble, flood or lie, and a raw TCP server that
answers garbage or nothing), and each misbehaviour is classified as what it is.

Every probe here has a 0.5 s deadline; it must end within deadline + 2 s of slack (a
machine under load), where a probe without a bound would hang until the test's own
10 s cut-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from confgen.runtime import free_port
from sidecar.observe.probe import Prober, ProbeReport, Target
from sidecar.observe.result import Outcome

DEADLINE_S = 0.5
SLACK_S = 2.0
CAP = 64 * 1024
GOOD = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _good_metrics(request: web.Request) -> web.Response:
    return web.Response(body=GOOD, content_type="text/plain")


async def _dribble(request: web.Request) -> web.StreamResponse:
    """Slow loris: headers at once, then one byte every 100 ms for up to 30 s."""
    resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await resp.prepare(request)
    for _ in range(300):
        await resp.write(b"v")
        await asyncio.sleep(0.1)
    return resp


async def _no_answer(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(30)
    return web.Response(text="late")


async def _huge_declared(request: web.Request) -> web.StreamResponse:
    """Declares 10 GB, sends a little, then stalls."""
    resp = web.StreamResponse(headers={"Content-Type": "text/plain", "Content-Length": str(10 * 1024**3)})
    await resp.prepare(request)
    await resp.write(b"x" * 1024)
    await asyncio.sleep(30)
    return resp


async def _huge_chunked(request: web.Request) -> web.StreamResponse:
    """No length, an endless stream of megabytes (bounded at 64 MB here)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await resp.prepare(request)
    chunk = b"vllm:num_requests_running 1\n" * 40_000
    for _ in range(64):
        await resp.write(chunk)
    return resp


async def _garbage_metrics(request: web.Request) -> web.Response:
    return web.Response(body=random.Random(7).randbytes(20_000), content_type="text/plain")


async def _inf_metrics(request: web.Request) -> web.Response:
    return web.Response(body=b"vllm:num_requests_running +Inf\nvllm:num_requests_waiting 0\n",
                        content_type="text/plain")


async def _openmetrics_cut(request: web.Request) -> web.Response:
    return web.Response(body=GOOD, headers={"Content-Type": "application/openmetrics-text; version=1.0.0"})


@contextlib.asynccontextmanager
async def _app(health: Handler, metrics: Handler) -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _raw(answer: bytes | None) -> AsyncIterator[int]:
    """A TCP server that writes `answer` (None: nothing) and keeps the connection open."""
    writers: list[asyncio.StreamWriter] = []
    stop = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            if answer is not None:
                writer.write(answer)
                await writer.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(30):
                    await stop.wait()
        except ConnectionError:
            pass
        finally:
            writer.close()

    port = free_port()
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield port
    finally:
        stop.set()
        server.close()
        for writer in writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await server.wait_closed()


async def _probe(port: int, *, health: bool = True) -> tuple[ProbeReport, float]:
    async with Prober(max_concurrency=4, deadline_s=DEADLINE_S, body_cap=CAP) as prober:
        started = time.monotonic()
        async with asyncio.timeout(10):
            report = await prober.probe(Target("127.0.0.1", port, "vllm", "/health", "/metrics"), health=health)
        return report, time.monotonic() - started


def _run(server: contextlib.AbstractAsyncContextManager[int], *, health: bool = True) -> tuple[ProbeReport, float]:
    async def go() -> tuple[ProbeReport, float]:
        async with server as port:
            return await _probe(port, health=health)

    return asyncio.run(go())


CASES: list[tuple[str, Any, Outcome, str | None]] = [
    ("health slow loris", lambda: _app(_dribble, _good_metrics), Outcome.TIMEOUT, "timeout"),
    ("health never answers", lambda: _app(_no_answer, _good_metrics), Outcome.TIMEOUT, "timeout"),
    ("health declares 10 GB", lambda: _app(_huge_declared, _good_metrics), Outcome.RESET, "body_too_large"),
    ("health endless body", lambda: _app(_huge_chunked, _good_metrics), Outcome.RESET, "body_too_large"),
    ("metrics slow loris", lambda: _app(_ok, _dribble), Outcome.BAD_METRICS, "bad_metrics"),
    ("metrics never answer", lambda: _app(_ok, _no_answer), Outcome.BAD_METRICS, "bad_metrics"),
    ("metrics declare 10 GB", lambda: _app(_ok, _huge_declared), Outcome.BAD_METRICS, "bad_metrics"),
    ("metrics endless body", lambda: _app(_ok, _huge_chunked), Outcome.BAD_METRICS, "bad_metrics"),
    ("metrics garbage bytes", lambda: _app(_ok, _garbage_metrics), Outcome.BAD_METRICS, "bad_metrics"),
    ("metrics +Inf gauge", lambda: _app(_ok, _inf_metrics), Outcome.BAD_METRICS, "bad_metrics"),
    ("metrics OpenMetrics without EOF", lambda: _app(_ok, _openmetrics_cut), Outcome.BAD_METRICS, "bad_metrics"),
    ("TCP accepts, says nothing", lambda: _raw(None), Outcome.TIMEOUT, "timeout"),
    ("TCP answers garbage", lambda: _raw(random.Random(3).randbytes(4096)), Outcome.RESET, "reset"),
    ("status line then silence", lambda: _raw(b"HTTP/1.1 200 OK\r\nContent-"), Outcome.TIMEOUT, "timeout"),
]


@pytest.mark.parametrize(("name", "server", "outcome", "kind"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("health", [True, False], ids=["full", "metrics-only"])
def test_hostile_answers_end_within_the_deadline(name: str, server: Any, outcome: Outcome, kind: str | None,
                                                  health: bool) -> None:
    """Each misbehaviour: the probe ends within its deadline (a metrics-only probe that
    fails falls back to a full one: within two deadlines) and is classified as expected. A
    metrics-only probe does not ask /health, so a misbehaving /health beside good metrics
    is OK there (by design: the engine's progress is the proof of life)."""
    report, took = _run(server(), health=health)
    bound = DEADLINE_S * (1 if health else 2) + SLACK_S
    assert took < bound, f"{name}: probe took {took:.2f} s (bound {bound} s)"
    if not health and name.startswith("health "):
        outcome, kind = Outcome.OK, None
    assert (report.result.outcome, report.error) == (outcome, kind), (name, report)


def test_invalid_gauge_and_missing_eof_say_what_they_are() -> None:
    """The +Inf gauge is reported as an invalid value, the cut OpenMetrics body as truncated."""
    report, _ = _run(_app(_ok, _inf_metrics))
    assert "invalid value +Inf for vllm:num_requests_running" in report.detail
    report, _ = _run(_app(_ok, _openmetrics_cut))
    assert "truncated OpenMetrics body" in report.detail
