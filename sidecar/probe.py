"""Probe one worker: its health endpoint and its engine's metrics. aiohttp I/O only.

One `Prober` holds one ClientSession (keep-alive connections, at most `max_concurrency`
of them) and a semaphore bounding probes in flight. A probe is one total deadline
(`asyncio.timeout_at`) shared by the health and the metrics request, covering connect,
headers and body reads; bodies are read up to `body_cap` bytes.

Outcome mapping (what the state machine counts, see sidecar.state):
- health: connection refused -> REFUSED; reset / server disconnected / cut body -> RESET;
  deadline (or an unreachable host, which is what a dead machine looks like) -> TIMEOUT;
  non-2xx -> HTTP_STATUS.
- metrics, asked only when health answered 2xx and the engine has metrics: any failure
  (status, size, reset, deadline, unusable text) -> BAD_METRICS: the worker is alive, its
  load is unknown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import aiohttp

from sidecar.engines import LoadSample, MetricsFormatError, extract, has_metrics
from sidecar.state import Outcome, ProbeResult

__all__ = ["ProbeReport", "Prober", "Target"]

_ACCEPT_METRICS = "text/plain;version=0.0.4"  # OpenMetrics makes prometheus_client mangle ':'


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
    error: str | None  # error kind label (refused, reset, timeout, unreachable, http_status, bad_metrics)
    detail: str
    duration_s: float  # the whole probe, health and metrics


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

    async def __aenter__(self) -> Self:
        connector = aiohttp.TCPConnector(limit=self._max_concurrency, keepalive_timeout=30.0)
        # A backstop only: every request also runs under the probe's own deadline.
        timeout = aiohttp.ClientTimeout(total=self._deadline_s + 1.0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=True)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe(self, target: Target) -> ProbeReport:
        """Probe one endpoint; never raises for anything the endpoint does."""
        async with self._slots:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._deadline_s
            started = self._clock()
            wants_metrics = has_metrics(target.engine)
            health_job = asyncio.ensure_future(self._health(target, deadline))
            metrics_job = asyncio.ensure_future(self._metrics(target, deadline)) if wants_metrics else None
            jobs = [health_job] if metrics_job is None else [health_job, metrics_job]
            await asyncio.gather(*jobs, return_exceptions=True)
            duration = self._clock() - started
            at = self._clock()
            return _report(target, health_job, metrics_job, at, duration)

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Prober used outside its async context")
        return self._session

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        if response.content_length is not None and response.content_length > self._body_cap:
            raise _TooLarge(f"Content-Length {response.content_length} > cap {self._body_cap}")
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
            async with session.get(target.url(target.health_path), headers=headers, allow_redirects=False) as resp:
                await self._read(resp)
                return resp.status, self._clock() - started

    async def _metrics(self, target: Target, deadline: float) -> LoadSample | None:
        session = self._require_session()
        headers = {"Accept": _ACCEPT_METRICS}
        if target.host_header:
            headers["Host"] = target.host_header
        async with asyncio.timeout_at(deadline):
            async with session.get(target.url(target.metrics_path), headers=headers, allow_redirects=False) as resp:
                body = await self._read(resp)
                if not 200 <= resp.status < 300:
                    raise _BadStatus(resp.status)
        return extract(target.engine, body)


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


def _report(
    target: Target,
    health_job: asyncio.Future[tuple[int, float]],
    metrics_job: asyncio.Future[LoadSample | None] | None,
    at: float,
    duration: float,
) -> ProbeReport:
    exc = health_job.exception()
    if exc is not None:
        outcome, kind, detail = _health_failure(exc)
        return ProbeReport(ProbeResult(at, outcome), kind, detail, duration)
    status, latency = health_job.result()
    if not 200 <= status < 300:
        result = ProbeResult(at, Outcome.HTTP_STATUS, health_latency_s=latency, http_status=status)
        return ProbeReport(result, "http_status", f"health answered HTTP {status}", duration)
    if metrics_job is None:
        return ProbeReport(ProbeResult(at, Outcome.OK, health_latency_s=latency), None, "", duration)
    mexc = metrics_job.exception()
    if mexc is None:
        sample = metrics_job.result()
        return ProbeReport(ProbeResult(at, Outcome.OK, health_latency_s=latency, sample=sample), None, "", duration)
    if isinstance(mexc, MetricsFormatError | _TooLarge | _BadStatus | TimeoutError | aiohttp.ClientError
                  | ConnectionError):
        detail = f"metrics: {type(mexc).__name__}: {mexc}"
        return ProbeReport(ProbeResult(at, Outcome.BAD_METRICS, health_latency_s=latency), "bad_metrics",
                           detail, duration)
    raise mexc
