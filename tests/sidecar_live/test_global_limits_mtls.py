"""The rate limit service over mutual TLS, live: it registers on the sidecar's one gRPC server, so
--grpc-tls-* protect it as they protect the picker.

One Envoy + its sidecar (`--grpc-tls-cert/-key/--grpc-client-ca`), a real redis-server, a global
budget of 3 requests per hour, `sidecar.grpc_tls` in the topology. Envoy's checks travel over
mTLS and are answered: 3 admitted, then 429 (a check that failed would fail open and admit
all), Redis counts 3. A grpcio client without a certificate or with another CA's is refused at
the handshake (UNAVAILABLE, no answer) and spends nothing; the same call with Envoy's
certificate is answered.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, RedisProcess, free_port
from confgen.simulate import FleetSpec, run_fleet_in_thread
from tests.sidecar_live.glimits import KEYS, NAME, call, topology_text, wait_for_window
from tests.sidecar_live.rig import FAST_ARGS, SidecarProcess, worker_specs
from tests.support.certs import CertAuthority

pytestmark = pytest.mark.timeout(240)


async def _check(port: int, creds: grpc.ChannelCredentials) -> str:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        request = rls_pb2.RateLimitRequest(domain=f"confgen.{NAME}", hits_addend=1000, descriptors=[
            ratelimit_pb2.RateLimitDescriptor(entries=[
                ratelimit_pb2.RateLimitDescriptor.Entry(key="confgen_client", value="req")])])
        try:
            answer = await rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return f"answered {answer.overall_code}"


def _counted(store: RedisProcess) -> int:
    import redis

    client = redis.Redis(host="127.0.0.1", port=store.port, socket_timeout=2, socket_connect_timeout=2)
    try:
        return sum(int(client.get(key) or 0) for key in client.scan_iter(match=f"confgen:confgen.{NAME}:*")
                   if not key.endswith(b":r"))
    finally:
        client.close()


def test_envoy_checks_global_limits_over_mtls_and_strangers_spend_nothing(tmp_path: Path) -> None:
    ca = CertAuthority.create(tmp_path / "pki")
    server = ca.issue("sidecar", ["IP:127.0.0.1"])
    client = ca.issue("glim-envoy", ["DNS:glim-envoy"])
    stranger = CertAuthority.create(tmp_path / "other", name="other-ca").issue("glim-envoy", ["DNS:glim-envoy"])
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFGEN_")}
    with RedisProcess() as store, run_fleet_in_thread(FleetSpec(workers=worker_specs(["w0"]), seed=3)) as fleet:
        port, admin, listen, grpc_port = free_port(), free_port(), free_port(), free_port()
        text = topology_text([f"127.0.0.1:{w.port}" for w in fleet.workers], admin=admin, port=port, listen=listen,
                             grpc=grpc_port, redis=store.address, check_timeout="5s", store_timeout="2s",
                             clients={"req": "{scope: global, requests: 3, window: hour}"})  # generous: a slow
        # answer on a loaded machine must not fail open (an admission the assertion would count as wrong)
        sidecar_line = f"sidecar: {{address: 127.0.0.1, port: {listen}, grpc_port: {grpc_port}}}"
        assert sidecar_line in text
        text = text.replace(sidecar_line, sidecar_line[:-1] + f", grpc_tls: {{cert: {client.cert}, "
                            f"key: {client.key}, ca: {ca.cert}}}}}")
        topo_path = tmp_path / "topology.yaml"
        topo_path.write_text(text)
        topo, _ = parse_topology(text.encode())
        xds = tmp_path / "envoy"
        write_tree(envoy.render(topo, config_dir=str(xds), secrets=KEYS), xds, rank=envoy.layout.write_rank)
        sidecar = SidecarProcess(
            ["--topology", str(topo_path), "--xds-dir", str(xds), "--listen", f"127.0.0.1:{listen}",
             "--grpc-listen", f"127.0.0.1:{grpc_port}", "--grpc-tls-cert", str(server.cert),
             "--grpc-tls-key", str(server.key), "--grpc-client-ca", str(ca.cert), *FAST_ARGS],
            tmp_path / "sidecar.log", listen, env=env)
        with EnvoyProcess(xds / "bootstrap.json") as proxy:
            sidecar.start()
            try:
                sidecar.wait_ready()
                serving = [e for e in sidecar.events() if e.get("event") == "tls.serving"]
                assert any("ratelimit" in str(e.get("service")) for e in serving), serving
                wait_for_window(30, window=3600)  # the 5 requests stay in one hourly window
                url = f"http://127.0.0.1:{port}/v1/completions"
                codes = [call(url, "req", {"model": "sim-model", "prompt": "hi", "max_tokens": 2})[0]
                         for _ in range(5)]
                assert codes == [200, 200, 200, 429, 429], (codes, sidecar.log_tail())
                assert _counted(store) >= 3
                stats = proxy.stats()
                assert int(stats.get("cluster.confgen_sidecar_grpc.ssl.handshake", 0)) >= 1
                assert int(stats.get("cluster.confgen_sidecar_grpc.ssl.connection_error", 0)) == 0

                spent = _counted(store)
                trust = ca.cert.read_bytes()
                for what, creds in {
                    "no certificate": grpc.ssl_channel_credentials(trust),
                    "another CA's certificate": grpc.ssl_channel_credentials(
                        trust, stranger.key.read_bytes(), stranger.cert.read_bytes()),
                }.items():
                    assert asyncio.run(_check(grpc_port, creds)) == "UNAVAILABLE", what
                assert _counted(store) == spent
                # the same call with Envoy's certificate is answered (the refusals were the handshake's)
                valid = grpc.ssl_channel_credentials(trust, client.key.read_bytes(), client.cert.read_bytes())
                assert asyncio.run(_check(grpc_port, valid)).startswith("answered"), sidecar.log_tail()
            finally:
                code = sidecar.stop()
            assert code == 0, f"sidecar exited {code} on SIGTERM:\n{sidecar.log_tail()}"
