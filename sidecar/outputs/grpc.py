"""The one place that builds a gRPC server (the endpoint picker, the rate-limit service).

    server = GrpcServer(GrpcSettings(host, port))
    server.add(service.add_to, service.name)   # one line per service (sidecar.outputs.service)
    port = await server.start()
    ...
    await server.stop()

Bounded: receive/send message size, concurrent streams per connection, keepalive pings
(and the pace it accepts from clients), idle connections closed, connection age capped
(with a grace for the streams in flight). Plaintext is allowed only on a loopback bind, and
said loudly in the log; any other bind needs TLS (`TlsSettings`: certificate, key and,
for mutual TLS, the CA that signs client certificates), built in `server_credentials`
alone, so adding identity checks later touches one function.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from sidecar.config import ConfigError
from sidecar.logs import log_event

__all__ = ["GrpcLimits", "GrpcServer", "GrpcSettings", "TlsSettings", "is_loopback", "server_credentials"]

_log = logging.getLogger("sidecar.grpc")


@dataclass(frozen=True, slots=True)
class GrpcLimits:
    """Caps every server gets. Envoy's ext_proc messages carry a request body: the
    listener's own body cap (max_request_bytes, default 1 MiB) plus headers fits in 4 MiB."""

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
class TlsSettings:
    """Server certificate and key (PEM files); with `client_ca`, clients must present a
    certificate it signed (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    host: str
    port: int  # 0: the OS picks (tests)
    limits: GrpcLimits = GrpcLimits()
    tls: TlsSettings | None = None


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine ("" and 0.0.0.0 do not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """TLS (mutual when a client CA is given) from PEM files; ConfigError when unreadable."""
    try:
        cert, key = tls.cert.read_bytes(), tls.key.read_bytes()
        ca = tls.client_ca.read_bytes() if tls.client_ca is not None else None
    except OSError as exc:
        raise ConfigError(f"gRPC TLS: cannot read {exc.filename}: {exc.strerror}") from exc
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


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
        try:
            if s.tls is not None:
                bound = self._server.add_secure_port(address, server_credentials(s.tls))
            else:
                bound = self._server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc raises RuntimeError when it cannot bind
            raise ConfigError(f"gRPC listen {address}: {exc}") from exc
        if bound == 0:
            raise ConfigError(f"gRPC listen {address}: cannot bind")
        await self._server.start()
        self.port = bound
        if s.tls is None:
            log_event(_log, logging.WARNING, "grpc.plaintext", listen=f"{s.host}:{bound}", services=self._names,
                      note="plaintext gRPC on loopback only: anything on this machine may call it")
        else:
            log_event(_log, logging.INFO, "grpc.listening", listen=f"{s.host}:{bound}", services=self._names,
                      tls="mutual" if s.tls.client_ca is not None else "server")
        return bound

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
