"""Throwaway certificates for mTLS tests, made with the openssl CLI (no `cryptography` in the venv).

    ca = CertAuthority.create(tmp / "pki")
    server = ca.issue("xds", sans=["IP:127.0.0.1", "DNS:localhost"])
    envoy0 = ca.issue("envoy-0", sans=["DNS:envoy-0"])

Each issued `Cert` has its `cert` and `key` paths (PEM); `ca.cert` is the CA's. EC P-256 keys
(fast to make on a loaded machine), one day of validity.

Without the openssl CLI the test making a certificate FAILS with how to install it (`make test`
installs Debian's `openssl` first); it never skips: a skipped mTLS test is not coverage.

`await served_common_name(port, ca, client)` handshakes with a TLS server as `client` and
answers the CN of the certificate the server presented (certificate renewal tests).
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["Cert", "CertAuthority", "openssl", "served_common_name"]

_TIMEOUT = 30.0
_HANDSHAKE_TIMEOUT = 10.0
_HINT = ("install Debian's openssl package (apt-get install -y --no-install-recommends openssl; "
         "`make test` does it as root)")


def openssl() -> str:
    """The openssl CLI's path; the calling test fails (not skips) when it is missing."""
    path = shutil.which("openssl")
    if path is None:
        pytest.fail(f"the mTLS tests make their certificates with the openssl CLI, not found on PATH: {_HINT}",
                    pytrace=False)
    return path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run([openssl(), *args], cwd=cwd, check=True, capture_output=True, timeout=_TIMEOUT)


@dataclass(frozen=True)
class Cert:
    name: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class CertAuthority:
    directory: Path
    cert: Path
    key: Path

    @classmethod
    def create(cls, directory: Path, name: str = "confgen-test-ca") -> CertAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)
        return cls(directory, cert, key)

    def issue(self, name: str, sans: Sequence[str] = (), *, file_name: str | None = None) -> Cert:
        """A leaf certificate with CN `name` and the given subjectAltNames ("DNS:x", "IP:1.2.3.4", "URI:...")."""
        stem = file_name or name
        key, csr, cert = (self.directory / f"{stem}.{ext}" for ext in ("key", "csr", "crt"))
        ext = self.directory / f"{stem}.ext"
        lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
                 "extendedKeyUsage=serverAuth,clientAuth"]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
             "-out", str(csr), "-subj", f"/CN={name}", cwd=self.directory)
        _run("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
             "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext), cwd=self.directory)
        return Cert(name, cert, key)


async def served_common_name(port: int, ca: CertAuthority, client: Cert, *, host: str = "127.0.0.1") -> str:
    """The CN of the certificate a TLS (gRPC: ALPN h2) server on host:port presents to `client`."""
    context = ssl.create_default_context(cafile=str(ca.cert))
    context.load_cert_chain(str(client.cert), str(client.key))
    context.set_alpn_protocols(["h2"])
    async with asyncio.timeout(_HANDSHAKE_TIMEOUT):
        _, writer = await asyncio.open_connection(host, port, ssl=context)
    cert = writer.get_extra_info("peercert")
    writer.close()
    return str(dict(x[0] for x in cert["subject"])["commonName"])
