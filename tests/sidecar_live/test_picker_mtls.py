"""The endpoint picker over mutual TLS, live: real Envoy, real certificates, the shipped sidecar.

A throwaway CA (openssl CLI) signs the sidecar's gRPC certificate (IP:127.0.0.1) and Envoy's
client certificate. The topology sets `sidecar.grpc_tls`; the sidecar runs with
`--grpc-listen --grpc-tls-cert --grpc-tls-key --grpc-client-ca`. Then:
- Envoy (the rendered confgen_sidecar_grpc cluster with its UpstreamTlsContext) gets picks:
  each growing conversation goes back to its worker, the picker counts the picks, Envoy's
  cluster counts TLS handshakes;
- gRPC clients without a certificate, with a certificate of another CA (same name), or in
  plaintext are refused at the handshake (UNAVAILABLE), receive no message, and the picker
  never sees their stream (its stream and pick counters do not move);
- a raw TCP client speaking HTTP/2 in clear gets no HTTP/2 byte back (at most a TLS alert).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, fleet_topology, run_fleet_in_thread
from tests.sidecar_live.rig import FAST_ARGS, SidecarProcess, poll, worker_specs
from tests.sidecar_live.test_picker_live import chat, conversation_system
from tests.support.certs import Cert, CertAuthority

pytestmark = pytest.mark.timeout(240)


def _counter(sidecar: SidecarProcess, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in sidecar.metrics().splitlines()
               if line.startswith((f"{name}{{", f"{name} ")))


def _behind(sidecar: SidecarProcess) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in sidecar.metrics().splitlines()
               if line.startswith("confgen_picker_unpicked_total{") and 'reason="behind"' in line)


def _stat(proxy: EnvoyProcess, suffix: str) -> int:
    return sum(int(v) for k, v in proxy.stats().items() if k.endswith(suffix) and str(v).isdigit())


async def _hostile_call(port: int, creds: grpc.ChannelCredentials | None) -> tuple[str, int]:
    """One ext_proc stream as a client Envoy would open it: (its status, messages received)."""
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.secure_channel(target, creds) if creds is not None else grpc.aio.insecure_channel(target)
    received = 0
    async with channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=10)
        try:
            headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")])
            await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)))
            while await call.read() != grpc.aio.EOF:
                received += 1
            return "OK", received
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, received


def _raw_plaintext_http2(port: int) -> bytes:
    """Send an HTTP/2 client preface and SETTINGS in clear; everything the server answers (until it closes)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        try:
            while len(got) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got


def test_envoy_gets_picks_over_mtls_and_strangers_are_refused(tmp_path: Path) -> None:
    ca = CertAuthority.create(tmp_path / "pki")
    server = ca.issue("sidecar", ["IP:127.0.0.1"])
    client = ca.issue("live-envoy", ["DNS:live-envoy"])
    stranger: Cert = CertAuthority.create(tmp_path / "other", name="other-ca").issue("live-envoy", ["DNS:live-envoy"])
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["a", "b", "c"]), seed=6)) as fleet:
        port, admin, listen, grpc_port = free_port(), free_port(), free_port(), free_port()
        text = fleet_topology(
            name="live", admin=admin, port=port, workers=[f"127.0.0.1:{w.port}" for w in fleet.workers],
            models=["sim-model"], capacity=8,
            pool=["balancing: {policy: prefix_affinity}", "health: {enabled: false}",
                  "outlier_detection: {enabled: false}"],
            tail=[f"sidecar: {{port: {listen}, grpc_port: {grpc_port}, grpc_tls: "
                  f"{{cert: {client.cert}, key: {client.key}, ca: {ca.cert}}}}}"])
        topo_path = tmp_path / "topology.yaml"
        topo_path.write_text(text)
        xds = tmp_path / "envoy"
        topo, _ = parse_topology(text.encode())
        files = envoy.render(topo, config_dir=str(xds))
        grpc_cluster = {c["name"]: c for c in json.loads(files[envoy.layout.CDS])["resources"]}["confgen_sidecar_grpc"]
        assert grpc_cluster["transport_socket"]["name"] == "envoy.transport_sockets.tls"
        write_tree(files, xds, rank=envoy.layout.write_rank)
        sidecar = SidecarProcess(
            ["--topology", str(topo_path), "--xds-dir", str(xds), "--listen", f"127.0.0.1:{listen}",
             "--grpc-listen", f"127.0.0.1:{grpc_port}", "--grpc-tls-cert", str(server.cert),
             "--grpc-tls-key", str(server.key), "--grpc-client-ca", str(ca.cert), *FAST_ARGS],
            tmp_path / "sidecar.log", listen)
        with EnvoyProcess(xds / "bootstrap.json") as proxy:
            sidecar.start()
            try:
                sidecar.wait_ready()
                warm = [{"role": "user", "content": "warm up"}]
                assert poll(lambda: chat_ok(port, warm) and _counter(sidecar, "confgen_picker_picks_total") > 0,
                            timeout=30), sidecar.log_tail()
                serving = [e for e in sidecar.events() if e.get("event") == "tls.serving"]
                assert any("picker" in str(e.get("service")) and e.get("client_auth") == "required"
                           for e in serving), serving
                assert not [e for e in sidecar.events() if e.get("event") == "tls.plaintext"]

                # Envoy with a valid client certificate: picks, and conversations stay home.
                picks_before = _counter(sidecar, "confgen_picker_picks_total")
                # a request not picked: Envoy's fallback (the sidecar failed or timed out), or the picker's own
                # answer without a pick when the request reached it late (a loaded machine)
                fallbacks_before = _stat(proxy, "ext_proc.failure_mode_allowed") + \
                    _stat(proxy, "ext_proc.message_timeouts") + _behind(sidecar)
                homes: dict[int, Counter[str]] = {}
                for c in range(6):
                    messages = [{"role": "system", "content": conversation_system(c)}]
                    homes[c] = Counter()
                    for turn in range(4):
                        messages.append({"role": "user", "content": f"turn {turn}"})
                        status, worker = chat_rig(port, messages)
                        assert status == 200
                        homes[c][worker] += 1
                        messages.append({"role": "assistant", "content": "ok"})
                fallbacks = _stat(proxy, "ext_proc.failure_mode_allowed") + \
                    _stat(proxy, "ext_proc.message_timeouts") + _behind(sidecar) - fallbacks_before
                picked = _counter(sidecar, "confgen_picker_picks_total") - picks_before
                assert picked >= 24 - fallbacks and picked > 0, (picked, fallbacks)
                moved = sum(4 - c.most_common(1)[0][1] for c in homes.values())
                assert moved <= fallbacks, (homes, fallbacks)
                assert _stat(proxy, "cluster.confgen_sidecar_grpc.ssl.handshake") >= 1
                assert _stat(proxy, "cluster.confgen_sidecar_grpc.ssl.connection_error") == 0

                # Strangers: refused at the handshake, nothing received, the picker never sees them.
                streams = _counter(sidecar, "confgen_picker_streams_total")
                picks = _counter(sidecar, "confgen_picker_picks_total")
                trust = ca.cert.read_bytes()
                cases = {
                    "no certificate": grpc.ssl_channel_credentials(trust),
                    "another CA's certificate": grpc.ssl_channel_credentials(
                        trust, stranger.key.read_bytes(), stranger.cert.read_bytes()),
                    "plaintext": None,
                }
                for what, creds in cases.items():
                    status, received = asyncio.run(_hostile_call(grpc_port, creds))
                    assert (status, received) == ("UNAVAILABLE", 0), what
                answer = _raw_plaintext_http2(grpc_port)
                assert not answer or answer[0] == 0x15, answer[:64]  # nothing, or a TLS alert record
                assert _counter(sidecar, "confgen_picker_streams_total") == streams
                assert _counter(sidecar, "confgen_picker_picks_total") == picks
                # ... while the real Envoy is still served.
                status, _ = chat_rig(port, [{"role": "user", "content": "after the strangers"}])
                assert status == 200
            finally:
                code = sidecar.stop()
            assert code == 0, f"sidecar exited {code} on SIGTERM:\n{sidecar.log_tail()}"


def chat_rig(port: int, messages: list[dict[str, str]]) -> tuple[int, str]:
    return chat(SimpleNamespace(port=port), messages)  # type: ignore[arg-type]  # chat reads .port only


def chat_ok(port: int, messages: list[dict[str, str]]) -> bool:
    return chat_rig(port, messages)[0] == 200
