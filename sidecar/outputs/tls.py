"""The transport of every gRPC surface the sidecar serves: mutual TLS, or plaintext on loopback.

    files = TlsFiles(cert, key, client_ca)        (None: plaintext)
    port = bind(server, host, port, files, what="xds")   mTLS, or plaintext on loopback only
    names = peer_identities(context)              the client certificate's SANs and CN

One module so that ADS and the shared gRPC builder (`sidecar.outputs.grpc`) build the same
thing. Rules:
- With files: the server presents `cert`/`key` and requires a client certificate signed by
  `client_ca` (`require_client_auth`): a client without one fails the handshake, before any
  request is read. The files are read again when they change (cert-manager renews them in
  place): checked on each new handshake.
- Without files: plaintext, allowed only on a loopback bind and logged at warning level on
  every start; a non-loopback bind without TLS raises `InsecureBindError` (the daemon refuses
  to start).
- A client's identity is what its verified certificate says: every subjectAltName (DNS, URI,
  IP, email) and the subject's CN. `peer_identities` is None on a plaintext connection.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from confgen.errors import ConfgenError
from sidecar.config.tls import TlsFiles, is_loopback
from sidecar.logs import log_event

__all__ = [
    "InsecureBindError",
    "TlsError",
    "TlsFiles",
    "bind",
    "is_loopback",
    "node_bound",
    "peer_identities",
    "server_credentials",
]

_log = logging.getLogger("sidecar.tls")
MAX_PEM_BYTES = 1024 * 1024  # a certificate chain or key larger than this is not one


class TlsError(ConfgenError, ValueError):
    """A certificate, key or CA file that cannot be used."""


class InsecureBindError(ConfgenError, ValueError):
    """Plaintext asked for on an address other machines can reach."""


def _read(path: Path, what: str) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise TlsError(f"{what} {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_PEM_BYTES:
        raise TlsError(f"{what} {path}: larger than {MAX_PEM_BYTES} bytes")
    if b"-----BEGIN " not in data:
        raise TlsError(f"{what} {path}: not PEM")
    return data


def _load(files: TlsFiles) -> tuple[bytes, bytes, bytes]:
    return (_read(files.cert, "server certificate"), _read(files.key, "server key"),
            _read(files.client_ca, "client CA"))


class _Reloader:
    """grpc's certificate fetcher: new files on the next handshake after they change (else None).

    Compared by content (three small reads per handshake): a renewal that keeps the size
    within the file system's timestamp granularity is still seen."""

    def __init__(self, files: TlsFiles, loaded: tuple[bytes, bytes, bytes]) -> None:
        self._files = files
        self._loaded = loaded
        self._lock = threading.Lock()  # grpc calls it from its own threads

    def __call__(self) -> Any:
        with self._lock:
            try:
                loaded = _load(self._files)
            except TlsError as exc:  # half-renewed or gone: keep serving with the files in force
                log_event(_log, logging.WARNING, "tls.reload_failed", error=str(exc))
                return None
            if loaded == self._loaded:
                return None
            cert, key, ca = loaded
            self._loaded = loaded
            log_event(_log, logging.INFO, "tls.reloaded", cert=str(self._files.cert))
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """mTLS credentials: the server's certificate, client certificates required and checked against
    `files.client_ca`; the files re-read when they change. TlsError when a file is unusable."""
    loaded = _load(files)
    cert, key, ca = loaded
    try:
        initial = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
    except (ValueError, TypeError) as exc:  # pragma: no cover - grpc validates lazily
        raise TlsError(str(exc)) from exc
    return grpc.dynamic_ssl_server_credentials(initial, _Reloader(files, loaded),
                                               require_client_authentication=True)


def bind(server: grpc.aio.Server, host: str, port: int, files: TlsFiles | None, *, what: str) -> int:
    """Add host:port to `server`, mTLS with `files`, else plaintext on loopback only; the bound port.

    InsecureBindError for plaintext beyond loopback, TlsError for unusable files, OSError when
    the address cannot be bound."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if files is None:
        if not is_loopback(host):
            raise InsecureBindError(
                f"{what}: refusing to serve plaintext on {address}, reachable from other machines; "
                "give the server certificate, key and client CA (mTLS), or bind a loopback address")
        bound = server.add_insecure_port(address)
        if bound:
            log_event(_log, logging.WARNING, "tls.plaintext", service=what, listen=f"{host}:{bound}",
                      note="PLAINTEXT gRPC without client authentication: any local process can connect "
                      "and " + ("read what ADS serves (the API keys)" if what == "xds" else
                                "steer the picks and spend the rate limits") + "; loopback only")
    else:
        bound = server.add_secure_port(address, server_credentials(files))
        if bound:
            log_event(_log, logging.INFO, "tls.serving", service=what, listen=f"{host}:{bound}",
                      cert=str(files.cert), client_ca=str(files.client_ca), client_auth="required")
    if bound == 0:
        raise OSError(f"{what}: cannot listen on {address}")
    return bound


_IDENTITY_KEYS = ("x509_subject_alternative_name", "x509_common_name")


def identities_of(auth: Mapping[str, Sequence[bytes]]) -> frozenset[str] | None:
    """The verified client certificate's names from a gRPC auth context; None when not TLS."""
    kind = auth.get("transport_security_type") or ()
    if b"ssl" not in kind:
        return None
    names: set[str] = set()
    for key in _IDENTITY_KEYS:
        for value in auth.get(key) or ():
            names.add(value.decode("utf-8", "replace"))
    return frozenset(names)


def peer_identities(context: Any) -> frozenset[str] | None:
    """The names of the client certificate on this call (a grpc ServicerContext); None on plaintext.

    An empty set on TLS never happens with `require_client_auth` (no certificate, no handshake)."""
    auth = context.auth_context()
    return identities_of(auth if isinstance(auth, Mapping) else {})


def node_bound(node: str, identities: frozenset[str] | None) -> bool:
    """Whether a client with these certificate names may speak as `node`.

    Plaintext (None): loopback only, every node id (no certificate to bind it to). TLS: the node
    id is one of the certificate's names (SAN or CN), or `<name>/<anything>` for a certificate
    shared by a group of Envoys (a Deployment's pods: `<name>/$(POD_NAME)`); a group's members
    can speak for one another, nobody outside it can."""
    if identities is None:
        return True
    if node in identities:
        return True
    head, sep, tail = node.partition("/")
    return bool(sep and tail) and head in identities
