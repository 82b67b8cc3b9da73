"""The one place that builds a gRPC server for the sidecar's services (picker, rate limits).

Bounded: message size, concurrent streams, keepalive and idle limits, a connection age.
Plaintext only on a loopback address (logged loudly); any other address needs TLS material
(cert, key, client CA: mutual TLS), which the security work plugs in here.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from confgen.errors import ConfgenError
from sidecar.logs import log_event

__all__ = ["GrpcError", "Registrar", "TlsFiles", "serve"]

_log = logging.getLogger("sidecar.grpc")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_CONCURRENT_STREAMS = 1024
OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
    # Envoy pings idle connections (its cluster's keepalive); allow one per 5 s at most.
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_connection_idle_ms", 10 * 60 * 1000),
    ("grpc.max_connection_age_ms", 60 * 60 * 1000),
    ("grpc.max_connection_age_grace_ms", 60 * 1000),
]


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (a name may resolve to anything)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class GrpcError(ConfgenError):
    """The gRPC server cannot be built as asked (plaintext beyond loopback, unreadable TLS files)."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path


class Registrar(Protocol):
    def add_to(self, server: grpc.aio.Server) -> None: ...


async def serve(services: Sequence[Registrar], host: str, port: int,
                tls: TlsFiles | None = None) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server with every service registered; (server, bound port)."""
    if tls is None and not is_loopback(host):
        raise GrpcError(f"the gRPC server on {host}:{port} would be plaintext beyond loopback; "
                        "bind it to 127.0.0.1 or give it TLS files")
    server = grpc.aio.server(options=OPTIONS, maximum_concurrent_rpcs=MAX_CONCURRENT_STREAMS)
    for service in services:
        service.add_to(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls is None:
        log_event(_log, logging.WARNING, "grpc.plaintext", address=address,
                  note="plaintext gRPC, allowed on loopback only")
        bound = server.add_insecure_port(address)
    else:
        try:
            creds = grpc.ssl_server_credentials(
                [(tls.key.read_bytes(), tls.cert.read_bytes())],
                root_certificates=tls.client_ca.read_bytes(), require_client_auth=True)
        except OSError as exc:
            raise GrpcError(f"cannot read the gRPC TLS files: {exc}") from exc
        bound = server.add_secure_port(address, creds)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server, bound
