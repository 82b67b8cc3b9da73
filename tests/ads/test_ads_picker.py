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

pytestmark = pytest.mark.timeout(240)

TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"]}}
sidecar: {{grpc_port: {grpc}}}
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


def test_one_picker_serves_every_envoy_of_the_control_plane(tmp_path: Path) -> None:
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["a", "b", "c"]), seed=4)) as fleet:
        port, xds, grpc, listen = free_port(), free_port(), free_port(), free_port()
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)

        def text(admin: int) -> str:
            return TOPOLOGY.format(admin=admin, port=port, xds=xds, grpc=grpc, workers=workers)

        topo_path = tmp_path / "topology.yaml"
        topo_path.write_text(text(9901))
        sidecar = SidecarProcess(["--topology", str(topo_path), "--serve-xds", f"127.0.0.1:{xds}",
                                  "--listen", f"127.0.0.1:{listen}", *FAST_ARGS], tmp_path / "sidecar.log", listen)
        sidecar.start()
        envoys: list[EnvoyProcess] = []
        try:
            sidecar.wait_ready()
            for i in range(2):
                topo, _ = parse_topology(text(free_port()).encode())
                out = tmp_path / f"envoy-{i}"
                out.mkdir()
                (out / "bootstrap.json").write_bytes(envoy.render(topo, config_dir=str(out))["bootstrap.json"])
                proxy = EnvoyProcess(out / "bootstrap.json", extra_args=["--service-node", f"envoy-{i}"])
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
        finally:
            for proxy in envoys:
                proxy.stop()
            sidecar.stop()
