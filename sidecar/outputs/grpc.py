"""The one place that builds a gRPC server: ADS, the endpoint picker, the rate limit service.

    server = GrpcServer(GrpcSettings(host, port, tls=files))         mTLS over TCP
    server = GrpcServer(GrpcSettings(socket=Path(".../grpc.sock")))  a Unix socket, 0600
    server.add(register, name)   # one line per service: `register(grpc_server)` adds its servicers
    port = await server.start()
    ...
    await server.stop()

Bounded (`GrpcLimits`): receive/send message size, concurrent streams per connection,
keepalive pings (and the pace it accepts from clients), idle connections closed, connection
age capped (with a grace for the streams in flight); optionally connections, handshake time,
RPCs in flight on the server and a fixed HTTP/2 window (ADS's profile, `ADS_LIMITS` in
`sidecar.outputs.xds.server`). grpc's caps are per server, so ADS (8 streams a connection, one
per Envoy) and the services (one stream per request in flight, thousands a connection) are two
servers from this one builder, on one transport (`sidecar.outputs.tls`):
- mutual TLS from `TlsFiles` (certificate, key, the CA that signs client certificates; the
  client's certificate names in `peer_identities(context)`), on any address;
- a Unix socket (`socket`): created 0600 in a directory only the sidecar's user may enter
  (`sidecar.outputs.tls.prepare_socket`): only a process of that user (the local Envoy) connects;
- plaintext TCP on a loopback bind only, said loudly in the log; any other bind without TLS is
  refused. Whether plaintext TCP is wanted at all is the configuration's explicit choice
  (`SidecarConfig.grpc_plaintext_loopback`), never a default.

The outputs that answer the proxy per request (the picker, the rate limit service) add their
servicers at build time to the `Servicers` of their `Wiring`; `sidecar.main` puts them all on the
sidecar's one services server once every output has started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from confgen.model import join_address
from sidecar.config import ConfigError
from sidecar.config.tls import TlsFiles, Transport, is_loopback
from sidecar.logs import log_event
from sidecar.outputs.tls import InsecureBindError, TlsError, bind, bind_unix, prepare_socket

__all__ = ["GrpcLimits", "GrpcServer", "GrpcSettings", "Servicers", "TlsFiles", "Transport", "is_loopback",
           "settings_for"]

_log = logging.getLogger("sidecar.grpc")


@dataclass(frozen=True, slots=True)
class GrpcLimits:
    """Caps every server gets. Envoy's ext_proc messages carry a request body: the
    listener's own body cap (max_request_bytes: default 2 MiB, at most 4 MiB less 64 KiB before a picker) fits."""

    max_message_bytes: int = 4 * 1024 * 1024  # received (and sent, unless max_send_bytes says otherwise)
    max_send_bytes: int | None = None
    max_concurrent_streams: int = 4096  # per connection: Envoy multiplexes every request on a few
    keepalive_time_s: float = 30.0  # ping an idle connection this often
    keepalive_timeout_s: float = 10.0  # ... and drop it when the ping is not answered in this long
    min_client_ping_s: float = 10.0  # refuse clients that ping faster
    max_connection_idle_s: float = 600.0
    max_connection_age_s: float | None = 3600.0  # connections are re-made (spreads load after restarts)
    max_connection_age_grace_s: float = 600.0  # streams in flight may finish (a generation's length)
    # Connections accepted at once, and the TCP + TLS handshake then the HTTP/2 preface: before a
    # client proves anything it holds a descriptor, so both are bounded on every server (grpc's own
    # defaults: no cap, 120 s). Envoys hold a few connections each (one per worker thread at most).
    max_connections: int | None = 4096
    handshake_timeout_s: float | None = 10.0
    max_concurrent_rpcs: int | None = None  # on the whole server (RESOURCE_EXHAUSTED beyond)
    # What a client may send ahead of what the server reads, per stream: a fixed window (no
    # BDP growth), so a stream that is not read holds at most that much. None: grpc's BDP.
    fixed_window_bytes: int | None = None

    def options(self) -> list[tuple[str, Any]]:
        def ms(seconds: float) -> int:
            return int(seconds * 1000)

        send = self.max_send_bytes if self.max_send_bytes is not None else self.max_message_bytes
        out: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", send),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_s)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)),
            ("grpc.so_reuseport", 0),  # a second sidecar on the same port must fail, not share it
        ]
        if self.max_connection_age_s is not None:
            out += [("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s))]
        if self.max_connections is not None:
            out.append(("grpc.max_allowed_incoming_connections", self.max_connections))
        if self.handshake_timeout_s is not None:
            out.append(("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)))
        if self.fixed_window_bytes is not None:
            out += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", self.fixed_window_bytes)]
        return out


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks (tests)
    limits: GrpcLimits = GrpcLimits()
    tls: TlsFiles | None = None  # mutual TLS (sidecar.outputs.tls) on host:port
    socket: Path | None = None  # without tls: this Unix socket (host and port unused)

    @property
    def address(self) -> str:
        if self.socket is not None:
            return f"unix:{self.socket}"
        return join_address(self.host, self.port)

    @property
    def transport(self) -> str:
        return "mtls" if self.tls is not None else "unix" if self.socket is not None else "plaintext"


def settings_for(transport: Transport, listen: tuple[str, int], socket: str) -> GrpcSettings:
    """One server's settings on the sidecar's one transport: its Unix socket `socket` (a name in the
    socket directory), or host:port `listen` with mTLS (or plaintext on loopback)."""
    path = transport.socket(socket)
    if path is not None:
        return GrpcSettings(socket=path)
    return GrpcSettings(listen[0], listen[1], tls=transport.tls)


class GrpcServer:
    """A grpc.aio server with the caps above; services are added before `start`."""

    def __init__(self, settings: GrpcSettings) -> None:
        if settings.tls is not None and settings.socket is not None:
            raise ConfigError("gRPC: a server is either mutual TLS on host:port or a Unix socket, not both")
        if settings.transport == "plaintext" and not is_loopback(settings.host):
            raise ConfigError(
                f"gRPC listen {settings.address}: plaintext gRPC is allowed only on a loopback "
                "address (anyone who reaches the port could steer routing); use a Unix socket or configure TLS")
        self.settings = settings
        self._server: grpc.aio.Server | None = None  # made in start(), on the loop that will run it
        self._services: list[Callable[[grpc.aio.Server], None]] = []
        self._names: list[str] = []
        self.port: int | None = None

    @property
    def listen(self) -> str:
        """Where it serves: host:port (the bound port once started) or unix:<path>."""
        s = self.settings
        if s.socket is not None:
            return s.address
        return f"{s.host}:{self.port if self.port is not None else s.port}"

    def add(self, register: Callable[[grpc.aio.Server], None], name: str) -> None:
        """Add one service: `register` puts its servicers on the server (a Service's `add_to`, or
        `lambda s: pb2_grpc.add_FooServicer_to_server(servicer, s)`)."""
        if self._server is not None:
            raise RuntimeError("services must be added before the server starts")
        self._services.append(register)
        self._names.append(name)

    async def start(self) -> int:
        """Bind and start; the bound port (0 for a Unix socket). ConfigError when the address cannot
        be bound, the certificates are unusable or the socket's directory is not private."""
        s = self.settings
        what = f"grpc ({', '.join(self._names)})"
        try:
            if s.socket is not None:
                await prepare_socket(s.socket)
        except (InsecureBindError, OSError) as exc:
            raise ConfigError(f"gRPC listen {s.address}: {exc}") from exc
        opts = s.limits
        self._server = grpc.aio.server(options=opts.options(), maximum_concurrent_rpcs=opts.max_concurrent_rpcs)
        for register in self._services:
            register(self._server)
        try:
            if s.socket is not None:
                bound = bind_unix(self._server, s.socket, what=what)
            else:  # mTLS, or plaintext on loopback (logged loudly there)
                bound = bind(self._server, s.host, s.port, s.tls, what=what)
        except (TlsError, InsecureBindError) as exc:
            raise ConfigError(f"gRPC listen {s.address}: {exc}") from exc
        except (RuntimeError, OSError) as exc:  # grpc raises RuntimeError when it cannot bind
            raise ConfigError(f"gRPC listen {s.address}: {exc}") from exc
        await self._server.start()
        self.port = bound
        log_event(_log, logging.INFO, "grpc.listening", listen=self.listen, services=self._names,
                  transport=s.transport)
        return bound

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self.settings.socket is not None and self.port is not None:
            self.port = None  # ours (checked at start): the next start finds no stale one
            await asyncio.to_thread(self.settings.socket.unlink, missing_ok=True)


class Servicers:
    """The servicers outputs add for the sidecar's services server (`Wiring.grpc`), before it exists:
    `sidecar.main` builds that server only when one was added."""

    def __init__(self) -> None:
        self._added: list[tuple[Callable[[grpc.aio.Server], None], str]] = []

    def add(self, register: Callable[[grpc.aio.Server], None], name: str) -> None:
        """As `GrpcServer.add`: `register` puts the output's servicers on the server."""
        self._added.append((register, name))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for _, name in self._added)

    def onto(self, server: GrpcServer) -> GrpcServer:
        """`server` with every servicer added (before it starts)."""
        for register, name in self._added:
            server.add(register, name)
        return server
