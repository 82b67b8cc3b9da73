"""sidecar.outputs.grpc: the one gRPC server builder (bind rules, caps, adding a service)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from sidecar.config import ConfigError, from_argv, grpc_listen_for
from sidecar.outputs.grpc import GrpcLimits, GrpcServer, GrpcSettings, TlsFiles, is_loopback
from sidecar.outputs.tls import peer_identities
from tests.support.certs import CertAuthority, served_common_name

_METHOD = "/confgen.test.Echo/Echo"


def _echo() -> grpc.GenericRpcHandler:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(echo)
    return grpc.method_handlers_generic_handler("confgen.test.Echo", {"Echo": handler})


def _register(handler: grpc.GenericRpcHandler):  # type: ignore[no-untyped-def]
    return lambda server: server.add_generic_rpc_handlers((handler,))


def test_plaintext_is_refused_beyond_loopback() -> None:
    for host in ("0.0.0.0", "10.1.2.3", "example.com", ""):
        with pytest.raises(ConfigError, match="loopback"):
            GrpcServer(GrpcSettings(host, 0))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")


def test_tls_files_unreadable_is_a_config_error(tmp_path: Path) -> None:
    server = GrpcServer(GrpcSettings("0.0.0.0", 0, tls=TlsFiles(tmp_path / "no.crt", tmp_path / "no.key",
                                                                  tmp_path / "no-ca.crt")))
    with pytest.raises(ConfigError, match=r"no\.crt"):
        asyncio.run(server.start())


def test_serves_an_added_service_and_caps_message_size() -> None:
    async def main() -> None:
        server = GrpcServer(GrpcSettings("127.0.0.1", 0, GrpcLimits(max_message_bytes=64 * 1024)))
        server.add(_register(_echo()), "echo")
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(_METHOD)
                assert await call(b"hello", timeout=10) == b"hello"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(b"x" * (128 * 1024), timeout=10)
                assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(RuntimeError):
                server.add(_register(_echo()), "echo")
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_every_server_bounds_connections_and_their_handshake() -> None:
    """Found by review: the picker's and rate limit service's server took grpc's defaults (no cap on
    connections, 120 s to finish a handshake): 3,000 TCP connections that never began TLS held 3,000
    descriptors. Every server now has both bounds unless its profile sets its own (ADS: 2,000, 10 s);
    here with a short handshake and a cap of 4, a client that connects and sends nothing is closed."""
    defaults = dict(GrpcLimits().options())
    assert defaults["grpc.max_allowed_incoming_connections"] == 4096
    assert defaults["grpc.server_handshake_timeout_ms"] == 10_000

    async def main() -> tuple[float, bytes]:
        server = GrpcServer(GrpcSettings("127.0.0.1", 0, GrpcLimits(handshake_timeout_s=0.5, max_connections=4)))
        server.add(_register(_echo()), "echo")
        port = await server.start()
        loop = asyncio.get_running_loop()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = loop.time()
            got = await asyncio.wait_for(reader.read(), 10)  # closed by the server: b"" (or its GOAWAY)
            writer.close()
            return loop.time() - started, got
        finally:
            await server.stop(0)

    took, _ = asyncio.run(main())
    assert took < 5.0, took


def test_a_taken_port_is_a_config_error() -> None:
    async def main() -> None:
        first = GrpcServer(GrpcSettings("127.0.0.1", 0))
        port = await first.start()
        try:
            with pytest.raises(ConfigError, match="gRPC listen"):
                await GrpcServer(GrpcSettings("127.0.0.1", port)).start()
        finally:
            await first.stop(0)

    asyncio.run(main())


def test_grpc_listen_flag_and_topology_default(tmp_path: Path) -> None:
    from confgen.topology import load

    topo_file = tmp_path / "t.yaml"
    topo_file.write_text(
        "version: 1\nname: t\nlisteners: [{name: l, port: 8080}]\n"
        "pools: [{name: p, engine: vllm, models: [m], workers: ['127.0.0.1:8000']}]\n")
    topo, _ = load(topo_file)
    assert grpc_listen_for(from_argv(["--topology", str(topo_file)]), topo) == ("127.0.0.1", 9110)
    config = from_argv(["--topology", str(topo_file), "--grpc-listen", "127.0.0.1:9999"])
    assert grpc_listen_for(config, topo) == ("127.0.0.1", 9999)
    with pytest.raises(ConfigError):
        from_argv(["--topology", str(topo_file), "--grpc-listen", "nope"])


def test_mutual_tls_from_the_shared_transport(tmp_path: Path) -> None:
    """The picker's server over the ADS transport (sidecar.outputs.tls): beyond loopback with mTLS; a client
    without a certificate fails the handshake; one with a certificate is served and named to the handler."""
    ca = CertAuthority.create(tmp_path / "pki")
    server_cert = ca.issue("sidecar", ["IP:127.0.0.1"])
    client = ca.issue("envoy-0", ["DNS:envoy-0"])
    seen: list[frozenset[str] | None] = []

    async def who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen.append(peer_identities(context))
        return request

    handler = grpc.method_handlers_generic_handler(
        "confgen.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(who)})

    async def main() -> None:
        files = TlsFiles(server_cert.cert, server_cert.key, ca.cert)
        server = GrpcServer(GrpcSettings("0.0.0.0", 0, tls=files))  # allowed: mutual TLS
        server.add(_register(handler), "echo")
        port = await server.start()
        try:
            for cert, expected in ((client, "ok"), (None, "UNAVAILABLE")):
                creds = grpc.ssl_channel_credentials(
                    ca.cert.read_bytes(), cert.key.read_bytes() if cert else None,
                    cert.cert.read_bytes() if cert else None)
                async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
                    try:
                        answer = await channel.unary_unary(_METHOD)(b"hi", timeout=10)
                        assert (answer, expected) == (b"hi", "ok")
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code().name == expected
        finally:
            await server.stop(0)

    asyncio.run(main())
    assert seen == [frozenset({"envoy-0"})]


def _topology_file(tmp_path: Path) -> Path:
    topo_file = tmp_path / "t.yaml"
    topo_file.write_text(
        "version: 1\nname: t\nlisteners: [{name: l, port: 8080}]\n"
        "pools: [{name: p, engine: vllm, models: [m], workers: ['127.0.0.1:8000']}]\n")
    return topo_file


def test_grpc_tls_flags(tmp_path: Path) -> None:
    """--grpc-tls-cert/-key/--grpc-client-ca: all three or none; beyond loopback --grpc-listen needs them."""
    topo = str(_topology_file(tmp_path))
    assert from_argv(["--topology", topo]).grpc_tls is None
    config = from_argv(["--topology", topo, "--grpc-listen", "0.0.0.0:9110", "--grpc-tls-cert", "c.crt",
                        "--grpc-tls-key", "c.key", "--grpc-client-ca", "ca.crt"])
    assert config.grpc_tls == TlsFiles(Path("c.crt").absolute(), Path("c.key").absolute(), Path("ca.crt").absolute())
    assert config.xds_tls == config.grpc_tls  # one TLS setup for every gRPC surface (the old name reads it)
    with pytest.raises(ConfigError, match="--grpc-tls-cert, --grpc-tls-key and --grpc-client-ca"):
        from_argv(["--topology", topo, "--grpc-tls-cert", "c.crt", "--grpc-tls-key", "c.key"])
    for host in ("0.0.0.0", "10.0.0.7", "[::]"):
        with pytest.raises(ConfigError, match="plaintext gRPC"):
            from_argv(["--topology", topo, "--grpc-listen", f"{host}:9110"])
    assert from_argv(["--topology", topo, "--grpc-listen", "[::1]:9110"]).grpc_listen == ("::1", 9110)


def test_sidecar_refuses_plaintext_grpc_beyond_loopback(tmp_path: Path) -> None:
    """The shipped command: --grpc-listen on a non-loopback address without mTLS exits 2 before binding."""
    import subprocess
    import sys

    topo = _topology_file(tmp_path)
    done = subprocess.run([sys.executable, "-m", "sidecar.main", "--topology", str(topo),
                           "--grpc-listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "--grpc-tls-cert" in done.stderr and "plaintext gRPC" in done.stderr


def test_renewed_grpc_certificate_served_without_restart(tmp_path: Path) -> None:
    """--grpc-tls-cert renewed in place (cert-manager): the picker's server presents it from the next handshake."""
    ca = CertAuthority.create(tmp_path / "pki")
    first, second = ca.issue("grpc-old", ["IP:127.0.0.1"]), ca.issue("grpc-new", ["IP:127.0.0.1"])
    client = ca.issue("envoy-0", ["DNS:envoy-0"])
    live = TlsFiles(tmp_path / "tls.crt", tmp_path / "tls.key", ca.cert)
    live.cert.write_bytes(first.cert.read_bytes())
    live.key.write_bytes(first.key.read_bytes())

    async def main() -> None:
        server = GrpcServer(GrpcSettings("127.0.0.1", 0, tls=live))
        server.add(_register(_echo()), "echo")
        port = await server.start()
        try:
            assert await served_common_name(port, ca, client) == "grpc-old"
            live.key.write_bytes(second.key.read_bytes())
            live.cert.write_bytes(second.cert.read_bytes())
            assert await served_common_name(port, ca, client) == "grpc-new"
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_grpc_listen_mismatch_names_what_envoy_cannot_reach(tmp_path: Path) -> None:
    """Logged at startup (startup.grpc_listen_mismatch): a loopback bind while the render sends Envoy elsewhere,
    or another port than sidecar.grpc_port."""
    from confgen.topology import load
    from sidecar.config import grpc_listen_mismatch

    base = _topology_file(tmp_path).read_text()
    remote = tmp_path / "remote.yaml"
    remote.write_text(base + "sidecar: {address: 10.0.0.5, grpc_tls: {cert: /t/e.crt, key: /t/e.key, ca: /t/ca.crt}}\n")
    topo, _ = load(remote)
    tls = ["--grpc-tls-cert", "s.crt", "--grpc-tls-key", "s.key", "--grpc-client-ca", "ca.crt"]
    problem = grpc_listen_mismatch(from_argv(["--topology", str(remote), *tls]), topo)
    assert problem is not None and "10.0.0.5:9110" in problem and "--grpc-listen" in problem
    assert grpc_listen_mismatch(from_argv(["--topology", str(remote), "--grpc-listen", "0.0.0.0:9110", *tls]),
                                topo) is None
    plain = tmp_path / "plain.yaml"
    plain.write_text(base + "sidecar: {grpc_plaintext_loopback: true}\n")
    local, _ = load(plain)
    assert grpc_listen_mismatch(from_argv(["--topology", str(remote)]), local) is None
    wrong = grpc_listen_mismatch(from_argv(["--topology", str(remote), "--grpc-listen", "127.0.0.1:9999"]), local)
    assert wrong is not None and "sidecar.grpc_port 9110" in wrong
    unix, _ = load(_topology_file(tmp_path))  # the default: a Unix socket, no address to miss
    assert grpc_listen_mismatch(from_argv(["--topology", str(remote), "--grpc-listen", "127.0.0.1:9999"]), unix) is None
