"""Throwaway certificates for mTLS tests, made with the openssl CLI (no `cryptography` in the venv).

    ca = CertAuthority.create(tmp / "pki")
    server = ca.issue("xds", sans=["IP:127.0.0.1", "DNS:localhost"])
    envoy0 = ca.issue("envoy-0", sans=["DNS:envoy-0"])

Each issued `Cert` has its `cert` and `key` paths (PEM); `ca.cert` is the CA's. EC P-256 keys
(fast to make on a loaded machine), one day of validity.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cert", "CertAuthority", "openssl_available"]

_TIMEOUT = 30.0


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=_TIMEOUT)


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
