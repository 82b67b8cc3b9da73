"""The transport of the sidecar's gRPC surfaces (TLS file paths, or the Unix sockets' directory)
and what counts as a loopback bind.

Plain data for `SidecarConfig`; what builds the credentials and binds is `sidecar.outputs.tls`,
the servers `sidecar.outputs.grpc`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from confgen.model import is_loopback_host

__all__ = ["DNS", "TlsFiles", "Transport", "is_loopback", "split_dns"]

DNS = "dns:"  # a --picker-peer target naming every address a DNS name resolves to


def split_dns(target: str) -> tuple[str, int] | None:
    """(host, port) of a `dns:HOST:PORT` target; None when `target` is not one or is malformed."""
    if not target.startswith(DNS):
        return None
    host, sep, port = target[len(DNS):].rpartition(":")
    host = host.strip("[]")
    if not sep or not host or "/" in host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    return host, int(port)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: the server's certificate chain and key, and the CA that signs client certificates."""

    cert: Path
    key: Path
    client_ca: Path

    def paths(self) -> tuple[Path, Path, Path]:
        return self.cert, self.key, self.client_ca


@dataclass(frozen=True, slots=True)
class Transport:
    """How every gRPC surface (ADS, the picker, rate limits) is served: mutual TLS on host:port (`tls`),
    Unix sockets in `socket_dir` (the default), or, neither given, plaintext TCP on loopback."""

    tls: TlsFiles | None = None
    socket_dir: Path | None = None

    @property
    def kind(self) -> str:
        return "mtls" if self.tls is not None else "unix" if self.socket_dir is not None else "plaintext"

    def socket(self, name: str) -> Path | None:
        """The path of the socket `name` (confgen.model.GRPC_SOCKET, XDS_SOCKET); None over TCP."""
        return self.socket_dir / name if self.socket_dir is not None and self.tls is None else None


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine ("", 0.0.0.0 and names do not).

    confgen's definition (validate judges where Envoy calls with it): one rule for both sides."""
    return is_loopback_host(host)
