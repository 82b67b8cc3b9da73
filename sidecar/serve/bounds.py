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
- Connections: at most `max_connections` open at once, and at most `max_per_peer` from one address (one
  client cannot hold every slot: the kubelet's probes and Prometheus come from other addresses); one beyond
  is closed at accept.
- Sending: a connection whose client stops reading (its answers pile up: the transport paused writing) for
  `send_timeout_s` is aborted, whatever the route (pipelined requests never read held a slot for good).
- Errors: every error the app answers is JSON `{"error": ...}`; an unexpected exception is
  logged as one line (type, message, where) and answered 500 `{"error": "internal error"}`,
  never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
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
    max_per_peer: int = 32  # from one address (loopback is one: the local Envoy's /v1/models and any local user)
    send_timeout_s: float = 5.0  # an answer the client does not read for this long: the connection is aborted
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
    """aiohttp's protocol for one connection, counted from accept to close, per site and per peer address;
    aborted when its client leaves its answers unread for the site's send timeout.

    (aiohttp's own list of connections fills a moment after the accept: a burst of connects
    would pass a cap read from it.)"""

    def __init__(self, inner: asyncio.Protocol, site: CappedSite) -> None:
        self._inner, self._site = inner, site
        self._lost = False
        self._made = False
        self._peer: str | None = None
        self._transport: asyncio.Transport | None = None
        self._stalled: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if not self._site.admit(self._peer):
            self._peer = None  # not counted for it
            transport.close()
            return
        self._made = True
        self._transport = transport if isinstance(transport, asyncio.Transport) else None
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._made:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._made else None

    def pause_writing(self) -> None:
        if self._stalled is None and self._transport is not None:
            self._stalled = asyncio.get_running_loop().call_later(self._site.send_timeout_s, self._abort)
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        self._inner.resume_writing()

    def _abort(self) -> None:
        """The client has read nothing of its answers for the send timeout: the connection goes."""
        self._stalled = None
        self._site.stalled += 1
        if self._transport is not None:
            sock = self._transport.get_extra_info("socket")
            if sock is not None:  # a reset, and the kernel drops what it still queued: not a close that sends it
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        if not self._lost:
            self._lost = True
            self._site.release(self._peer)
        if self._made:
            self._inner.connection_lost(exc)


class CappedSite(web.BaseSite):
    """A TCP site that accepts at most `max_connections` connections at once, `max_per_peer` of them from one
    address, and aborts a connection whose answers go unread for `send_timeout_s`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int,
                 max_per_peer: int | None = None, send_timeout_s: float = 5.0) -> None:
        super().__init__(runner)
        self._host, self._port, self._cap = host, port, max_connections
        self._per_peer_cap = max_per_peer if max_per_peer is not None else max_connections
        self.send_timeout_s = send_timeout_s
        self.open = 0
        self.refused = 0
        self.stalled = 0  # connections aborted for answers left unread
        self._per_peer: dict[str, int] = {}

    def admit(self, peer: str | None) -> bool:
        """Count a new connection from `peer` (an address), or refuse it over the peer's share."""
        if peer is None:
            return True
        held = self._per_peer.get(peer, 0)
        if held >= self._per_peer_cap:
            self.refused += 1
            return False
        self._per_peer[peer] = held + 1
        return True

    def release(self, peer: str | None) -> None:
        self.open -= 1
        if peer is not None:
            left = self._per_peer.get(peer, 1) - 1
            if left > 0:
                self._per_peer[peer] = left
            else:
                self._per_peer.pop(peer, None)

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
    site = CappedSite(runner, host, port, bounds.max_connections, bounds.max_per_peer, bounds.send_timeout_s)
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
