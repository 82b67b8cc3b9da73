"""The transport of every gRPC surface the sidecar serves: mutual TLS, a Unix socket, or plaintext on loopback.

    files = TlsFiles(cert, key, client_ca)        (None: plaintext)
    port = bind(server, host, port, files, what="xds")   mTLS, or plaintext on loopback only
    await prepare_socket(path); bind_unix(server, path, what="xds")   a 0600 socket in a 0700 directory
    names = peer_identities(context)              the client certificate's SANs and CN
    key = credential_of(names, context.peer())    what the connection proved (nodes are counted per key)

One module so that ADS and the shared gRPC builder (`sidecar.outputs.grpc`) build the same
thing. Rules:
- With files: the server presents `cert`/`key` and requires a client certificate signed by
  `client_ca` (`require_client_auth`): a client without one fails the handshake, before any
  request is read. The files are read again when they change (cert-manager renews them in
  place): checked on each new handshake.
- Without files: plaintext, allowed only on a loopback bind and logged at warning level on
  every start; a non-loopback bind without TLS raises `InsecureBindError` (the daemon refuses
  to start).
- A Unix socket: its directory is created 0700 (or, when it exists, must be a real directory
  owned by the sidecar's user: its mode is then tightened to 0700; anything else refuses the
  start), the socket is made 0600; a socket left by a sidecar that died is removed, one that
  answers (another sidecar running) refuses the start, and what is not a socket is never
  removed. Only the sidecar's user (the local Envoy runs as it) can connect.
- A client's identity is what its verified certificate says: every subjectAltName (DNS, URI,
  IP, email) and the subject's CN. `peer_identities` is None on a plaintext connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from confgen.errors import ConfgenError
from confgen.model import MAX_SOCKET_PATH, join_address
from sidecar.config.tls import TlsFiles, is_loopback
from sidecar.logs import log_event

__all__ = [
    "InsecureBindError",
    "TlsError",
    "TlsFiles",
    "bind",
    "bind_unix",
    "credential_of",
    "is_loopback",
    "node_bound",
    "peer_identities",
    "prepare_socket",
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
    address = join_address(host, port)
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


def _private_dir(directory: Path) -> None:
    """`directory` exists, is a directory (not a link) owned by this user, mode 0700."""
    try:
        directory.mkdir(mode=0o700)
        created = True
    except FileExistsError:
        created = False
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise InsecureBindError(f"socket directory {directory} is not a directory (a link or a file): refusing it")
    if st.st_uid != os.geteuid():
        raise InsecureBindError(f"socket directory {directory} is owned by uid {st.st_uid}, not this user "
                                f"({os.geteuid()}): another user could read or replace the socket; remove it "
                                "or choose another directory")
    if stat.S_IMODE(st.st_mode) != 0o700:
        directory.chmod(0o700)  # ours: others lose access before any socket is made in it
        if not created:
            log_event(_log, logging.WARNING, "tls.socket_dir_tightened", directory=str(directory),
                      mode_was=oct(stat.S_IMODE(st.st_mode)))


async def prepare_socket(path: Path) -> None:
    """Make `path` bindable safely: its directory private (0700, ours), no stale socket in the way.

    InsecureBindError for a path that is not safe (too long, relative, a foreign or linked
    directory, a non-socket file in the way); OSError when another server answers on it or the
    directory cannot be made."""
    text = str(path)
    if not path.is_absolute():
        raise InsecureBindError(f"socket path {text!r} is not absolute")
    if len(text.encode()) > MAX_SOCKET_PATH:
        raise InsecureBindError(f"socket path {text!r} is longer than {MAX_SOCKET_PATH} bytes (the kernel's limit)")
    await asyncio.to_thread(_private_dir, path.parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InsecureBindError(f"{path} exists and is not a socket: refusing to remove it")
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_unix_connection(text)
    except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
        await asyncio.to_thread(path.unlink, missing_ok=True)  # left by a server that is gone
        log_event(_log, logging.INFO, "tls.stale_socket_removed", socket=text)
        return
    writer.close()
    await writer.wait_closed()
    raise OSError(f"{path}: another server is listening on it")


def bind_unix(server: grpc.aio.Server, path: Path, *, what: str) -> int:
    """Add the Unix socket `path` to `server` (after `prepare_socket`), mode 0600; 0 (no port).

    OSError when it cannot be bound."""
    if not server.add_insecure_port(f"unix:{path}"):
        raise OSError(f"{what}: cannot listen on unix:{path}")
    path.chmod(0o600)  # the directory (0700) already keeps other users out; this says so twice
    log_event(_log, logging.INFO, "tls.serving", service=what, listen=f"unix:{path}", transport="unix",
              mode="0600", note="only this user's processes (the local Envoy) can connect")
    return 0


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


def credential_of(identities: frozenset[str] | None, peer: str) -> str:
    """What a connection proved about its client, as one key (nodes are counted per key):
    `cert:<its names>` for a verified client certificate, `unix` for a Unix socket (only the
    socket's owner can connect: the local Envoy), `plaintext` for plaintext TCP on loopback
    (any local process: proves nothing beyond that)."""
    if identities is not None:
        return "cert:" + ",".join(sorted(identities))
    return "unix" if peer.startswith("unix:") else "plaintext"


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
