"""What one HTTP client can make the sidecar's aiohttp server hold, and how errors are answered.

    runner = web.AppRunner(app, **runner_options(bounds))
    site = await start_site(runner, host, port, bounds)      a TCP site with a connection cap

- Header read and idle: a connection must complete its request head within
  `header_timeout_s` of opening (or of its previous response), else it is closed (aiohttp's
  keep-alive timer runs from the connection's start and is not reset by partial data).
- Body: read within `body_timeout_s` (408 otherwise); a body over the route's limit is
  refused from its Content-Length before reading, or after reading just past the limit when
  chunked (413); what the client still sends is discarded for at most `linger_s`, then the
  connection is closed.
- Connections: at most `max_connections` open at once; one beyond is closed at accept.
- Errors: every error the app answers is JSON `{"error": ...}`; an unexpected exception is
  logged as one line (type, message, where) and answered 500 `{"error": "internal error"}`,
  never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from sidecar.logs import LogBudget, clip

__all__ = ["HttpBounds", "errors_as_json", "runner_options", "start_site"]

_log = logging.getLogger("sidecar.http")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class HttpBounds:
    header_timeout_s: float = 10.0  # request head complete within this of connecting (and idle keep-alive)
    body_timeout_s: float = 5.0
    linger_s: float = 1.0  # discard what a refused body still sends for at most this long
    max_connections: int = 256  # Prometheus, the kubelet, the proxies' /v1/models, an operator
    max_line: int = 8190
    max_headers: int = 64


def runner_options(bounds: HttpBounds) -> dict[str, Any]:
    """The AppRunner keyword arguments that apply `bounds` (aiohttp's RequestHandler settings)."""
    return {"keepalive_timeout": bounds.header_timeout_s, "lingering_time": bounds.linger_s,
            "max_line_size": bounds.max_line, "max_field_size": bounds.max_line,
            "max_headers": bounds.max_headers}


class _Refuse(asyncio.Protocol):
    """A connection over the cap: closed as soon as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted from accept to close.

    (aiohttp's own list of connections fills a moment after the accept: a burst of connects
    would pass a cap read from it.)"""

    def __init__(self, inner: asyncio.Protocol, site: CappedSite) -> None:
        self._inner, self._site = inner, site
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost:
            self._lost = True
            self._site.open -= 1
        self._inner.connection_lost(exc)


class CappedSite(web.BaseSite):
    """A TCP site that accepts at most `max_connections` connections at once."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int) -> None:
        super().__init__(runner)
        self._host, self._port, self._cap = host, port, max_connections
        self.open = 0
        self.refused = 0

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # the runner was set up

        def factory() -> asyncio.Protocol:
            if self.open >= self._cap:
                self.refused += 1
                return _Refuse()
            self.open += 1
            return _Counted(server(), self)

        self._server = await asyncio.get_running_loop().create_server(
            factory, self._host, self._port, reuse_address=True)


async def start_site(runner: web.AppRunner, host: str, port: int, bounds: HttpBounds) -> CappedSite:
    site = CappedSite(runner, host, port, bounds.max_connections)
    await site.start()
    return site


def errors_as_json(budget: LogBudget) -> Middleware:
    """Middleware: aiohttp's HTTP errors (404, 405, 413...) as JSON; an unexpected exception as a
    logged line and a JSON 500, never a traceback."""

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
            return web.json_response({"error": exc.reason}, status=exc.status, headers=headers)
        except Exception as exc:  # noqa: BLE001 - the last answer of a server: nothing may escape as a traceback
            frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            budget.log(_log, logging.ERROR, "http.internal_error", "http.internal_error", path=clip(request.path, 100),
                       error=clip(f"{type(exc).__name__}: {exc}", 300),
                       where=f"{frame.filename}:{frame.lineno}" if frame else "?")
            return web.json_response({"error": "internal error"}, status=500)

    return middleware
