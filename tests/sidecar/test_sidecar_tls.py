"""sidecar.outputs.tls: plaintext only on loopback, unusable files refused, node ids bound to certificates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from sidecar.config import ConfigError, from_argv
from sidecar.outputs.tls import (
    InsecureBindError,
    TlsError,
    TlsFiles,
    bind,
    identities_of,
    is_loopback,
    node_bound,
    server_credentials,
)
from tests.support.certs import CertAuthority, served_common_name


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True), ("127.9.9.9", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.1", False), ("xds.example", False),
])
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_node_bound_to_the_certificate_names() -> None:
    names = frozenset({"envoy-0", "spiffe://cluster/ns/a/sa/envoy"})
    assert node_bound("envoy-0", names)
    assert node_bound("spiffe://cluster/ns/a/sa/envoy", names)
    assert node_bound("envoy-0/pod-abc", names)  # a group certificate: <name>/<member>
    assert not node_bound("envoy-1", names)
    assert not node_bound("envoy-0/", names)
    assert not node_bound("envoy-00", names)
    assert not node_bound("envoy-1/envoy-0", names)
    assert not node_bound("envoy-0", frozenset())
    assert node_bound("anything", None)  # plaintext (loopback only): nothing to bind to


def test_identities_only_from_tls() -> None:
    assert identities_of({"transport_security_type": [b"insecure"], "x509_common_name": [b"x"]}) is None
    assert identities_of({}) is None
    auth = {"transport_security_type": [b"ssl"], "x509_common_name": [b"cn"],
            "x509_subject_alternative_name": [b"dns-name", b"spiffe://x/y"]}
    assert identities_of(auth) == {"cn", "dns-name", "spiffe://x/y"}


def test_plaintext_beyond_loopback_refused() -> None:
    async def run() -> None:
        server = grpc.aio.server()
        with pytest.raises(InsecureBindError, match="refusing to serve plaintext"):
            bind(server, "0.0.0.0", 0, None, what="xds")
        assert bind(server, "127.0.0.1", 0, None, what="xds") > 0
        await server.stop(0)

    asyncio.run(run())


def test_config_refuses_plaintext_ads_beyond_loopback(tmp_path: Path) -> None:
    topo = str(tmp_path / "t.yaml")
    with pytest.raises(ConfigError, match="plaintext ADS"):
        from_argv(["--topology", topo, "--serve-xds", "0.0.0.0:18000"])
    with pytest.raises(ConfigError, match="all three"):
        from_argv(["--topology", topo, "--serve-xds", "0.0.0.0:18000", "--xds-tls-cert", "/a"])
    config = from_argv(["--topology", topo, "--serve-xds", "0.0.0.0:18000", "--xds-tls-cert", "/a",
                        "--xds-tls-key", "/b", "--xds-client-ca", "/c"])
    assert config.xds_tls == TlsFiles(Path("/a"), Path("/b"), Path("/c"))
    assert from_argv(["--topology", topo, "--serve-xds", "127.0.0.1:18000"]).xds_tls is None


def test_unusable_files_refused(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(TlsError, match="missing"):
        server_credentials(TlsFiles(tmp_path / "missing", pem, pem))
    junk = tmp_path / "junk"
    junk.write_text("not a certificate")
    with pytest.raises(TlsError, match="not PEM"):
        server_credentials(TlsFiles(pem, junk, pem))
    huge = tmp_path / "huge"
    huge.write_bytes(b"-----BEGIN " + b"A" * (2 * 1024 * 1024))
    with pytest.raises(TlsError, match="larger than"):
        server_credentials(TlsFiles(pem, pem, huge))


def test_renewed_certificate_served_without_restart(tmp_path: Path) -> None:
    """cert-manager renews tls.crt in place: the next handshake presents the new certificate."""
    ca = CertAuthority.create(tmp_path / "pki")
    first = ca.issue("xds-old", ["IP:127.0.0.1"])
    second = ca.issue("xds-new", ["IP:127.0.0.1"])
    client = ca.issue("envoy-0", ["DNS:envoy-0"])
    live = TlsFiles(tmp_path / "tls.crt", tmp_path / "tls.key", ca.cert)
    live.cert.write_bytes(first.cert.read_bytes())
    live.key.write_bytes(first.key.read_bytes())

    async def run() -> None:
        server = grpc.aio.server()
        port = bind(server, "127.0.0.1", 0, live, what="test")
        await server.start()
        try:
            assert await served_common_name(port, ca, client) == "xds-old"
            live.key.write_bytes(second.key.read_bytes())
            live.cert.write_bytes(second.cert.read_bytes())
            assert await served_common_name(port, ca, client) == "xds-new"
        finally:
            await server.stop(0)

    asyncio.run(run())


def test_certificates_without_openssl_fail_rather_than_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No openssl CLI on PATH: making a certificate fails the test with how to install it (never a skip)."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(pytest.fail.Exception, match=r"openssl CLI, not found on PATH: install Debian's openssl"):
        CertAuthority.create(tmp_path / "pki")
    assert not (tmp_path / "pki" / "confgen-test-ca.crt").exists()


def test_one_tls_setup_and_the_deprecated_flags(tmp_path: Path) -> None:
    """--xds-tls-* are the deprecated names of --grpc-tls-*: read as them (a deprecation noted for the startup
    log), the same files given both ways are fine, other files refused (one TLS setup for every surface)."""
    topo = str(tmp_path / "t.yaml")
    new = ["--grpc-tls-cert", "/a", "--grpc-tls-key", "/b", "--grpc-client-ca", "/c"]
    old = ["--xds-tls-cert", "/a", "--xds-tls-key", "/b", "--xds-client-ca", "/c"]
    assert from_argv(["--topology", topo, *new]).deprecations == ()
    config = from_argv(["--topology", topo, *old])
    assert config.grpc_tls == TlsFiles(Path("/a"), Path("/b"), Path("/c")) and "deprecated" in config.deprecations[0]
    assert from_argv(["--topology", topo, *old, *new]).grpc_tls == config.grpc_tls
    with pytest.raises(ConfigError, match="different files"):
        from_argv(["--topology", topo, *old, "--grpc-tls-cert", "/z", "--grpc-tls-key", "/b", "--grpc-client-ca", "/c"])
    with pytest.raises(ConfigError, match="choose one transport"):
        from_argv(["--topology", topo, *new, "--grpc-plaintext-loopback"])
    with pytest.raises(ConfigError, match="unix"):
        from_argv(["--topology", topo, "--serve-xds", "unix", *new])
    assert from_argv(["--topology", topo, "--serve-xds", "unix"]).serve_xds == ("unix", 0)


def test_the_socket_directory_is_private_and_stale_sockets_go(tmp_path: Path) -> None:
    """prepare_socket: the directory made 0700 (a loose one of ours tightened), a link or a file refused, a
    stale socket removed, a live one (another server) refused, a non-socket never removed, a path too long for
    the kernel refused."""
    import socket
    import stat

    from sidecar.outputs.tls import prepare_socket

    sockets = tmp_path / "s"
    path = sockets / "grpc.sock"
    asyncio.run(prepare_socket(path))
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o700
    sockets.chmod(0o755)
    asyncio.run(prepare_socket(path))
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o700

    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # bound, never listening, closed: what a killed server leaves
    asyncio.run(prepare_socket(path))
    assert not path.exists()

    async def live() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_unix_server(answer, str(path))
        try:
            with pytest.raises(OSError, match="another server"):
                await prepare_socket(path)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(live())
    path.unlink(missing_ok=True)
    path.write_text("not a socket")
    with pytest.raises(InsecureBindError, match="not a socket"):
        asyncio.run(prepare_socket(path))
    assert path.read_text() == "not a socket"

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InsecureBindError, match="not a directory"):
        asyncio.run(prepare_socket(tmp_path / "link" / "grpc.sock"))
    with pytest.raises(InsecureBindError, match="longer than 107"):
        asyncio.run(prepare_socket(tmp_path / ("x" * 120) / "grpc.sock"))
    with pytest.raises(InsecureBindError, match="not absolute"):
        asyncio.run(prepare_socket(Path("relative/grpc.sock")))


@pytest.mark.parametrize(("what", "says", "not_says"), [
    ("xds", "read what ADS serves (the API keys)", "steer"),
    ("grpc (picker)", "steer the picks and spend the rate limits", "API keys"),
])
def test_the_plaintext_warning_says_what_that_service_exposes(what: str, says: str, not_says: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The tls.plaintext warning names the risk of the service bound: the picker's and the rate limit
    service's port serves no API key (it said "(API keys over ADS)" for them too)."""
    async def run() -> None:
        server = grpc.aio.server()
        try:
            assert bind(server, "127.0.0.1", 0, None, what=what) > 0
        finally:
            await server.stop(None)

    with caplog.at_level("WARNING"):
        asyncio.run(run())
    (record,) = [r for r in caplog.records if r.getMessage() == "tls.plaintext"]
    note = record.confgen_fields["note"]  # type: ignore[attr-defined]
    assert says in note and not_says not in note, note
