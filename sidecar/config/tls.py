"""The settings of a TLS listener (file paths) and what counts as a loopback bind.

Plain data for `SidecarConfig`; what builds the credentials from them is
`sidecar.outputs.tls`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from confgen.model import is_loopback_host

__all__ = ["TlsFiles", "is_loopback"]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: the server's certificate chain and key, and the CA that signs client certificates."""

    cert: Path
    key: Path
    client_ca: Path

    def paths(self) -> tuple[Path, Path, Path]:
        return self.cert, self.key, self.client_ca


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine ("", 0.0.0.0 and names do not).

    confgen's definition (validate judges where Envoy calls with it): one rule for both sides."""
    return is_loopback_host(host)
