"""One sidecar as the control plane (ADS) and the endpoint picker of two Envoys: the picker sees
every request of both, so a conversation goes back to its worker whichever Envoy it enters by."""

from __future__ import annotations

import contextlib
import json
import socket
import stat
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from confgen import envoy
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import SidecarProcess, ads_envoy, control_plane, poll, worker_specs
from tests.support.certs import CertAuthority

pytestmark = pytest.mark.timeout(240)

TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"]}}
sidecar: {{grpc_port: {grpc}, grpc_socket_dir: {sockets}{grpc_tls}}}
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


def _late(sidecar: SidecarProcess) -> float:
    """Requests the picker left to Envoy for reaching it late (`unpicked{reason="behind"}`)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in sidecar.metrics().splitlines()
               if line.startswith("confgen_picker_unpicked_total{") and 'reason="behind"' in line)


def _runtime_value(proxy: EnvoyProcess, key: str) -> str | None:
    status, body = proxy.admin_get("/runtime")
    entry = json.loads(body).get("entries", {}).get(key) if status == 200 else None
    return None if entry is None else str(entry.get("final_value"))


def _picks(sidecar: SidecarProcess) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in sidecar.metrics().splitlines()
               if line.startswith("confgen_picker_picks_total{"))


@pytest.mark.parametrize("mtls", [False, True], ids=["unix", "mtls"])
def test_one_picker_serves_every_envoy_of_the_control_plane(tmp_path: Path, mtls: bool) -> None:
    """unix (the default): ADS and the picker on the control plane's Unix sockets (the real Envoy's clusters
    are `pipe` addresses), no TCP port for either. mtls: ADS and the picker both over mutual TLS from the one
    TLS setup (--grpc-tls-*, sidecar.grpc_tls; what the Kubernetes render mounts: the control plane's xds
    Secret serves both ports), the Envoys sharing one client certificate whose name prefixes their node ids;
    the cluster to the picker arrives over ADS with its TLS context."""
    tls_args: list[str] = []
    grpc_tls = ""
    sockets = tmp_path / "sockets"
    if mtls:
        ca = CertAuthority.create(tmp_path / "pki")
        server = ca.issue("control-plane", ["IP:127.0.0.1"])
        client = ca.issue("fleet-envoy", ["DNS:fleet-envoy"])
        grpc_tls = f", grpc_tls: {{cert: {client.cert}, key: {client.key}, ca: {ca.cert}}}"
        tls_args += ["--grpc-tls-cert", str(server.cert), "--grpc-tls-key", str(server.key),
                     "--grpc-client-ca", str(ca.cert), "--xds-nodes-per-identity", "2"]
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["a", "b", "c"]), seed=4)) as fleet:
        port, xds, grpc = free_port(), free_port(), free_port()
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)

        def text(admin: int) -> str:
            return TOPOLOGY.format(admin=admin, port=port, xds=xds, grpc=grpc, workers=workers, sockets=sockets,
                                   grpc_tls=grpc_tls)

        topo_path = tmp_path / "topology.yaml"
        topo_path.write_text(text(9901))
        with control_plane(topo_path, xds, tmp_path / "sidecar.log", *tls_args) as sidecar, \
                contextlib.ExitStack() as stack:
            envoys = [stack.enter_context(ads_envoy(text(free_port()), tmp_path / f"envoy-{i}",
                                                    f"fleet-envoy/{i}" if mtls else f"envoy-{i}"))
                      for i in range(2)]
            assert poll(lambda: _chat(port, [{"role": "user", "content": "warm"}])[0] == 200 and _picks(sidecar) > 0,
                        timeout=30), sidecar.log_tail()
            late_before = _late(sidecar)
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
            # ... and each conversation stayed on one worker across both (but for a turn Envoy balanced:
            # the picker failed, or the turn reached it late on a loaded machine)
            fallbacks = sum(int(p.stats().get("http.public.ext_proc.failure_mode_allowed", 0)) for p in envoys)
            fallbacks += int(_late(sidecar) - late_before)
            moved = sum(4 - c.most_common(1)[0][1] for c in homes.values())
            assert moved <= fallbacks, (homes, fallbacks)
            # the picker's bypass share (0: it keeps up) reached every Envoy in the control plane's RTDS layer
            assert all(poll(lambda p=p: _runtime_value(p, envoy.PICKER_BYPASS_RUNTIME_KEY) == "0", timeout=10)
                       for p in envoys)
            if mtls:  # the picker's cluster came over ADS with its TLS context, and both ports are mTLS
                assert all(int(p.stats().get("cluster.confgen_sidecar_grpc.ssl.handshake", 0)) >= 1 for p in envoys)
                assert all(int(p.stats().get("cluster.confgen_xds.ssl.handshake", 0)) >= 1 for p in envoys)
            serving = {str(e.get("service")): e for e in sidecar.events() if e.get("event") == "tls.serving"}
            assert any("ads" in s for s in serving) and any("picker" in s for s in serving), serving
            assert not [e for e in sidecar.events() if e.get("event") == "tls.plaintext"]
            if not mtls:  # both on their 0600 sockets in the 0700 directory; nothing on the TCP ports
                assert {str(e["listen"]) for e in serving.values()} == {f"unix:{sockets}/xds.sock",
                                                                         f"unix:{sockets}/grpc.sock"}, serving
                assert stat.S_IMODE(sockets.stat().st_mode) == 0o700
                assert {stat.S_IMODE((sockets / n).stat().st_mode) for n in ("xds.sock", "grpc.sock")} == {0o600}
                for tcp in (xds, grpc):
                    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", tcp), timeout=2):
                        pass
            # both Envoys count as Envoys of the fleet: two node ids on one local socket (or one shared
            # certificate) count once unless the flag says how many share it (mtls: 2)
            assert poll(lambda: sidecar.state()["xds"]["counted_envoys"] == (2 if mtls else 1), timeout=15), \
                sidecar.state()["xds"]
