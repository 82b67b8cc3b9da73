"""The one place that builds a gRPC server (the endpoint picker, the rate-limit service).

    server = GrpcServer(GrpcSettings(host, port))
    server.add(service.add_to, service.name)   # one line per service (sidecar.outputs.service)
    port = await server.start()
    ...
    await server.stop()

Bounded: receive/send message size, concurrent streams per connection, keepalive pings
(and the pace it accepts from clients), idle connections closed, connection age capped
(with a grace for the streams in flight). The transport is ADS's (`sidecar.outputs.tls`):
mutual TLS from `TlsFiles` (certificate, key, the CA that signs client certificates; the
client's certificate names in `peer_identities(context)`), or plaintext on a loopback bind
only, said loudly in the log; any other bind without TLS is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from sidecar.config import ConfigError
from sidecar.config.tls import TlsFiles, is_loopback
from sidecar.logs import log_event
from sidecar.outputs.tls import InsecureBindError, TlsError, bind

__all__ = ["GrpcLimits", "GrpcServer", "GrpcSettings", "TlsFiles", "is_loopback"]

_log = logging.getLogger("sidecar.grpc")


@dataclass(frozen=True, slots=True)
class GrpcLimits:
    """Caps every server gets. Envoy's ext_proc messages carry a request body: the
    listener's own body cap (max_request_bytes: default 2 MiB, at most 4 MiB less 64 KiB before a picker) fits."""

    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 4096  # per connection: Envoy multiplexes every request on a few
    keepalive_time_s: float = 30.0  # ping an idle connection this often
    keepalive_timeout_s: float = 10.0  # ... and drop it when the ping is not answered in this long
    min_client_ping_s: float = 10.0  # refuse clients that ping faster
    max_connection_idle_s: float = 600.0
    max_connection_age_s: float = 3600.0  # connections are re-made (spreads load after restarts)
    max_connection_age_grace_s: float = 600.0  # streams in flight may finish (a generation's length)

    def options(self) -> list[tuple[str, Any]]:
        def ms(seconds: float) -> int:
            return int(seconds * 1000)

        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_s)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)),
            ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
            ("grpc.so_reuseport", 0),  # a second sidecar on the same port must fail, not share it
        ]


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    host: str
    port: int  # 0: the OS picks (tests)
    limits: GrpcLimits = GrpcLimits()
    tls: TlsFiles | None = None  # mutual TLS (sidecar.outputs.tls); None: plaintext, loopback only


class GrpcServer:
    """A grpc.aio server with the caps above; services are added before `start`."""

    def __init__(self, settings: GrpcSettings) -> None:
        if settings.tls is None and not is_loopback(settings.host):
            raise ConfigError(
                f"gRPC listen {settings.host}:{settings.port}: plaintext gRPC is allowed only on a loopback "
                "address (anyone who reaches the port could steer routing); bind 127.0.0.1 or configure TLS")
        self.settings = settings
        self._server: grpc.aio.Server | None = None  # made in start(), on the loop that will run it
        self._services: list[Callable[[grpc.aio.Server], None]] = []
        self._names: list[str] = []
        self.port: int | None = None

    def add(self, register: Callable[[grpc.aio.Server], None], name: str) -> None:
        """Add one service: `register` puts its servicers on the server (a Service's `add_to`, or
        `lambda s: pb2_grpc.add_FooServicer_to_server(servicer, s)`)."""
        if self._server is not None:
            raise RuntimeError("services must be added before the server starts")
        self._services.append(register)
        self._names.append(name)

    async def start(self) -> int:
        """Bind and start; the bound port. ConfigError when the address cannot be bound."""
        s = self.settings
        self._server = grpc.aio.server(options=s.limits.options())
        for register in self._services:
            register(self._server)
        address = f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}"
        try:  # the transport ADS uses too: mTLS, or plaintext on loopback (logged loudly there)
            bound = bind(self._server, s.host, s.port, s.tls, what=f"grpc ({', '.join(self._names)})")
        except (TlsError, InsecureBindError) as exc:
            raise ConfigError(f"gRPC listen {address}: {exc}") from exc
        except (RuntimeError, OSError) as exc:  # grpc raises RuntimeError when it cannot bind
            raise ConfigError(f"gRPC listen {address}: {exc}") from exc
        await self._server.start()
        self.port = bound
        log_event(_log, logging.INFO, "grpc.listening", listen=f"{s.host}:{bound}", services=self._names,
                  tls="mutual" if s.tls is not None else "plaintext (loopback)")
        return bound

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
