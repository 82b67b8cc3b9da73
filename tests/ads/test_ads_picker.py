"""One sidecar as the control plane (ADS) and the endpoint picker of two Envoys: the picker sees
every request of both, so a conversation goes back to its worker whichever Envoy it enters by."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from confgen import envoy, parse_topology
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import FAST_ARGS, SidecarProcess, poll, worker_specs
from tests.support.certs import CertAuthority

pytestmark = pytest.mark.timeout(240)

TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"]{xds_tls}}}
sidecar: {{grpc_port: {grpc}{grpc_tls}}}
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 8
    balancing: {{policy: prefix_affinity}}
    health: {{enabled: false}}
    outlier_detection: {{enabled: false}}
    workers:
{workers}
"""


def _chat(port: int, messages: list[dict[str, str]]) -> tuple[int, str]:
    body = json.dumps({"model": "sim-model", "messages": messages, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers.get("x-sim-worker", "-")
    except urllib.error.HTTPError as err:
        return err.code, "-"


def _picks(sidecar: SidecarProcess) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in sidecar.metrics().splitlines()
               if line.startswith("confgen_picker_picks_total{"))


@pytest.mark.parametrize("mtls", [False, True], ids=["loopback", "mtls"])
def test_one_picker_serves_every_envoy_of_the_control_plane(tmp_path: Path, mtls: bool) -> None:
    """mtls: ADS and the picker both over mutual TLS from one certificate pair (what the Kubernetes render
    mounts: the control plane's xds Secret serves both ports), the Envoys sharing one client certificate
    whose name prefixes their node ids; the cluster to the picker arrives over ADS with its TLS context."""
    tls_args: list[str] = []
    xds_tls = grpc_tls = ""
    if mtls:
        ca = CertAuthority.create(tmp_path / "pki")
        server = ca.issue("control-plane", ["IP:127.0.0.1"])
        client = ca.issue("fleet-envoy", ["DNS:fleet-envoy"])
        files = f"{{cert: {client.cert}, key: {client.key}, ca: {ca.cert}}}"
        xds_tls, grpc_tls = f", tls: {files}", f", grpc_tls: {files}"
        for flag in ("xds", "grpc"):
            tls_args += [f"--{flag}-tls-cert", str(server.cert), f"--{flag}-tls-key", str(server.key),
                         f"--{flag}-client-ca", str(ca.cert)]
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["a", "b", "c"]), seed=4)) as fleet:
        port, xds, grpc, listen = free_port(), free_port(), free_port(), free_port()
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)

        def text(admin: int) -> str:
            return TOPOLOGY.format(admin=admin, port=port, xds=xds, grpc=grpc, workers=workers, xds_tls=xds_tls,
                                   grpc_tls=grpc_tls)

        topo_path = tmp_path / "topology.yaml"
        topo_path.write_text(text(9901))
        sidecar = SidecarProcess(["--topology", str(topo_path), "--serve-xds", f"127.0.0.1:{xds}",
                                  "--listen", f"127.0.0.1:{listen}", *tls_args, *FAST_ARGS],
                                 tmp_path / "sidecar.log", listen)
        sidecar.start()
        envoys: list[EnvoyProcess] = []
        try:
            sidecar.wait_ready()
            for i in range(2):
                topo, _ = parse_topology(text(free_port()).encode())
                out = tmp_path / f"envoy-{i}"
                out.mkdir()
                (out / "bootstrap.json").write_bytes(envoy.render(topo, config_dir=str(out))["bootstrap.json"])
                node = f"fleet-envoy/{i}" if mtls else f"envoy-{i}"
                proxy = EnvoyProcess(out / "bootstrap.json", extra_args=["--service-node", node])
                proxy.start()
                envoys.append(proxy)
            assert poll(lambda: _chat(port, [{"role": "user", "content": "warm"}])[0] == 200 and _picks(sidecar) > 0,
                        timeout=30), sidecar.log_tail()
            homes: dict[int, Counter[str]] = {}
            for c in range(6):
                messages = [{"role": "system", "content": f"Agent {c}. " + "shared context " * 40}]
                homes[c] = Counter()
                for turn in range(4):
                    messages.append({"role": "user", "content": f"turn {turn}"})
                    status, worker = _chat(port, messages)
                    assert status == 200
                    homes[c][worker] += 1
                    messages.append({"role": "assistant", "content": "ok"})
            # Both Envoys called the picker (the kernel spreads new connections over them) ...
            started = [int(p.stats().get("http.public.ext_proc.streams_started", 0)) for p in envoys]
            assert all(n > 0 for n in started), started
            # ... and each conversation stayed on one worker across both.
            fallbacks = sum(int(p.stats().get("http.public.ext_proc.failure_mode_allowed", 0)) for p in envoys)
            moved = sum(4 - c.most_common(1)[0][1] for c in homes.values())
            assert moved <= fallbacks, (homes, fallbacks)
            if mtls:  # the picker's cluster came over ADS with its TLS context, and both ports are mTLS
                assert all(int(p.stats().get("cluster.confgen_sidecar_grpc.ssl.handshake", 0)) >= 1 for p in envoys)
                assert all(int(p.stats().get("cluster.confgen_xds.ssl.handshake", 0)) >= 1 for p in envoys)
                services = {str(e.get("service")) for e in sidecar.events() if e.get("event") == "tls.serving"}
                assert "xds" in services and any("picker" in s for s in services), services
                assert not [e for e in sidecar.events() if e.get("event") == "tls.plaintext"]
        finally:
            for proxy in envoys:
                proxy.stop()
            sidecar.stop()
