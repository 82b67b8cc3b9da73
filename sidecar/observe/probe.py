"""Probe one worker: its health endpoint and its engine's metrics. aiohttp I/O only.

One `Prober` holds one ClientSession (keep-alive connections, at most `max_concurrency`
of them) and a semaphore bounding probes in flight. A probe is one total deadline
(`asyncio.timeout_at`) shared by the health and the metrics request, covering connect,
headers and body reads; bodies are read up to `body_cap` bytes. The two requests run one
after the other in the probe's own task, so they share one keep-alive connection per
endpoint (run concurrently they needed two connections and two extra tasks: about 1.0 ms
of CPU per probe instead of 0.6 ms on the bench's 40 KB body), and a failed /health
spares the metrics request.

Outcome mapping (what the state machine counts, see sidecar.decide.state):
- health: connection refused -> REFUSED; reset / server disconnected / cut body -> RESET;
  deadline (or an unreachable host, which is what a dead machine looks like) -> TIMEOUT;
  non-2xx -> HTTP_STATUS.
- metrics, asked only when health answered 2xx and the engine has metrics: any failure
  (status, size, reset, deadline, unusable text) -> BAD_METRICS: the worker is alive, its
  load is unknown.

Metrics only (`probe(..., health=False)`, when the state machine holds the engine's
progress as proof of life): one request instead of two. If it does not yield a sample,
the probe falls back to the full health + metrics probe under a fresh deadline, so a
failure is classified by /health exactly as above (such a probe may take up to two
deadlines).

Health only (`probe(..., metrics=False)`, when the state machine finds the engine quiet:
nothing to weigh): one request, awaited directly (no task per request). An ok answer
is reported with `metrics_checked=False` so the caller keeps its last sample; a failure
is reported exactly as above.

The sidecar's own event loop: a picker, a publish or anything else that holds the loop
makes every deadline pass without the worker being at fault. A `LoopLag` monitor (a timer
every 50 ms) sums how late the loop ran its callbacks; a probe that timed out while the
loop lost at least half of its deadline is reported as LOOP_LATE ("loop_late"), which
the state machine does not count, and the loop's lateness is taken out of a successful
probe's health latency (a late loop must not make a worker look slow). A stalled loop can
delay verdicts, never make a healthy worker UNHEALTHY or DEGRADED.

Cost (1,000 endpoints a second): bodies are asked for uncompressed (`Accept-Encoding:
identity`: no inflate here, no gzip on the engine; a server that compresses anyway is
still decoded), and the session has no per-request timer of its own: the probe's
deadline bounds every request, the session only bounds connecting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import aiohttp
from yarl import URL

from confgen.model import HEALTH_FLOOR_MARGIN_S, health_floor_s
from sidecar.observe.engines import LoadSample, MetricsFormatError, extract, has_metrics
from sidecar.observe.result import Outcome, ProbeResult

__all__ = ["LoopLag", "ProbeReport", "Prober", "Target"]

_ACCEPT_METRICS = "text/plain;version=0.0.4"  # OpenMetrics makes prometheus_client mangle ':'
_HEADERS = {"Accept-Encoding": "identity"}
_URL_CACHE = 65_536


@dataclass(frozen=True, slots=True)
class Target:
    """One endpoint to probe: an IP literal and port, and what the engine serves."""

    address: str
    port: int
    engine: str
    health_path: str
    metrics_path: str
    host_header: str | None = None  # the worker's DNS name, when it has one

    def url(self, path: str) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}{path}"


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """A ProbeResult for the state machine plus what the metrics and logs want to know."""

    result: ProbeResult
    error: str | None  # error kind label (refused, reset, timeout, unreachable, http_status, bad_metrics, loop_late)
    detail: str
    duration_s: float  # the whole probe, health and metrics


class LoopLag:
    """How late the running event loop has run its callbacks, summed since `start`.

    One timer every `interval_s`; each firing adds how far past its due time it ran."""

    __slots__ = ("_due", "_handle", "_interval", "_late", "_loop")

    def __init__(self, interval_s: float = 0.05) -> None:
        self._interval = interval_s
        self._late = 0.0
        self._due = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + self._interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self._late += max(0.0, now - self._due)
        self._due = now + self._interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def late_s(self) -> float:
        """Seconds late so far, the pending timer's lateness included (it may not have run yet)."""
        if self._loop is None:
            return 0.0
        return self._late + max(0.0, self._loop.time() - self._due)

    def behind_s(self) -> float:
        """How late the loop runs right now: how long its next due timer has waited (0 when on time)."""
        if self._loop is None:
            return 0.0
        return max(0.0, self._loop.time() - self._due)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _TooLarge(Exception):
    pass


class _BadStatus(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class Prober:
    """Probes endpoints; use as an async context manager (it owns the HTTP session)."""

    def __init__(
        self,
        *,
        max_concurrency: int,
        deadline_s: float,
        body_cap: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._deadline_s = deadline_s
        self._body_cap = body_cap
        self._clock = clock
        self._slots = asyncio.Semaphore(max_concurrency)
        self._max_concurrency = max_concurrency
        self._session: aiohttp.ClientSession | None = None
        self._lag = LoopLag()
        self._urls: dict[tuple[str, int, str], URL] = {}  # parsed once, not on every request

    async def __aenter__(self) -> Self:
        connector = aiohttp.TCPConnector(limit=self._max_concurrency, keepalive_timeout=30.0)
        # Every request runs under the probe's deadline (asyncio.timeout_at); a session-wide
        # total would add a second timer per request. Connecting is bounded here as well.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._deadline_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=True,
                                              headers=_HEADERS)
        self._lag.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lag.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe(self, target: Target, *, health: bool = True, metrics: bool = True) -> ProbeReport:
        """Probe one endpoint; never raises for anything the endpoint does.

        `health=False` asks only for the metrics, `metrics=False` only for the health (see
        the module docstring); `health=False` is ignored for engines without metrics, and
        at least one of the two is always asked.
        """
        async with self._slots:
            loop = asyncio.get_running_loop()
            started = self._clock()
            lag_at_start = self._lag.late_s()
            has = has_metrics(target.engine)
            wants_metrics = has and (metrics or not health)
            if not health and wants_metrics:
                try:
                    sample = await self._metrics(target, loop.time() + self._deadline_s)
                except (MetricsFormatError, _TooLarge, _BadStatus, TimeoutError, aiohttp.ClientError,
                        ConnectionError):
                    sample = None
                if sample is not None:
                    at = self._clock()
                    return ProbeReport(ProbeResult(at, Outcome.OK, sample=sample, health_checked=False),
                                       None, "", at - started)
            # an engine whose healthy answer takes a fixed time by design (SGLang's one-second poll) gets that
            # time beyond the deadline, and only what exceeds it counts as its latency
            floor = health_floor_s(target.engine, target.health_path)
            deadline = loop.time() + max(self._deadline_s, floor + HEALTH_FLOOR_MARGIN_S)
            lag_at_health = self._lag.late_s()
            try:
                status, latency = await self._health(target, deadline)
            except (TimeoutError, _TooLarge, aiohttp.ClientError, ConnectionError) as exc:
                at = self._clock()
                outcome, kind, detail = _health_failure(exc)
                lost = self._lag.late_s() - lag_at_start
                if outcome is Outcome.TIMEOUT and lost >= self._deadline_s / 2:
                    # the deadline passed because the sidecar's loop was held, not because of the worker
                    return ProbeReport(ProbeResult(at, Outcome.LOOP_LATE, health_checked=False, metrics_checked=False),
                                       "loop_late", f"the sidecar's event loop ran {lost:.2f} s late during the probe",
                                       at - started)
                return ProbeReport(ProbeResult(at, outcome), kind, detail, at - started)
            latency = max(0.0, latency - (self._lag.late_s() - lag_at_health) - floor)  # the worker's part of it
            if not 200 <= status < 300:
                at = self._clock()
                result = ProbeResult(at, Outcome.HTTP_STATUS, health_latency_s=latency, http_status=status)
                return ProbeReport(result, "http_status", f"health answered HTTP {status}", at - started)
            if not wants_metrics:
                at = self._clock()
                return ProbeReport(ProbeResult(at, Outcome.OK, health_latency_s=latency, metrics_checked=not has),
                                   None, "", at - started)
            try:
                sample = await self._metrics(target, deadline)
            except (MetricsFormatError, _TooLarge, _BadStatus, TimeoutError, aiohttp.ClientError,
                    ConnectionError) as exc:
                at = self._clock()
                return ProbeReport(ProbeResult(at, Outcome.BAD_METRICS, health_latency_s=latency), "bad_metrics",
                                   f"metrics: {type(exc).__name__}: {exc}", at - started)
            at = self._clock()
            return ProbeReport(ProbeResult(at, Outcome.OK, health_latency_s=latency, sample=sample),
                               None, "", at - started)

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Prober used outside its async context")
        return self._session

    def _url(self, target: Target, path: str) -> URL:
        key = (target.address, target.port, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) >= _URL_CACHE:
                self._urls.clear()  # endpoints come and go: start over rather than grow forever
            url = self._urls[key] = URL(target.url(path))
        return url

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        if response.content_length is not None and response.content_length > self._body_cap:
            raise _TooLarge(f"Content-Length {response.content_length} > cap {self._body_cap}")
        if response.content_length is not None and aiohttp.hdrs.CONTENT_ENCODING not in response.headers:
            return await response.read()  # bounded by the length just checked: one read, one join
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await response.content.read(self._body_cap + 1 - size)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > self._body_cap:
                raise _TooLarge(f"body over the cap of {self._body_cap} bytes")

    async def _health(self, target: Target, deadline: float) -> tuple[int, float]:
        """(status, latency) of the health request, body read included."""
        session = self._require_session()
        headers = {"Host": target.host_header} if target.host_header else {}
        started = self._clock()
        async with asyncio.timeout_at(deadline):
            url = self._url(target, target.health_path)
            async with session.get(url, headers=headers, allow_redirects=False) as resp:
                await self._read(resp)
                return resp.status, self._clock() - started

    async def _metrics(self, target: Target, deadline: float) -> LoadSample | None:
        session = self._require_session()
        headers = {"Accept": _ACCEPT_METRICS}
        if target.host_header:
            headers["Host"] = target.host_header
        async with asyncio.timeout_at(deadline):
            url = self._url(target, target.metrics_path)
            async with session.get(url, headers=headers, allow_redirects=False) as resp:
                body = await self._read(resp)
                if not 200 <= resp.status < 300:
                    raise _BadStatus(resp.status)
        return extract(target.engine, body, openmetrics=resp.content_type == "application/openmetrics-text")


def _health_failure(exc: BaseException) -> tuple[Outcome, str, str]:
    """(outcome, error kind, detail) for a health request that raised."""
    if isinstance(exc, TimeoutError):  # aiohttp's timeouts subclass it too
        return Outcome.TIMEOUT, "timeout", "deadline passed"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return Outcome.REFUSED, "refused", "connection refused"
        return Outcome.TIMEOUT, "unreachable", str(exc.os_error)
    if isinstance(exc, _TooLarge):
        return Outcome.RESET, "body_too_large", str(exc)
    if isinstance(exc, aiohttp.ClientError | ConnectionError):
        # ServerDisconnected, ClientOSError (reset), ClientPayloadError (cut body), bad HTTP
        return Outcome.RESET, "reset", f"{type(exc).__name__}: {exc}"
    raise exc  # a bug of ours, not a worker failure: let it surface
