"""Sheddable first in ADS mode: the control plane (`python -m sidecar.main --serve-xds`) serves
the pool's shed share in its RTDS layer beside the breaker limits; one real Envoy from the
`envoy.xds.mode: ads` render, in front of a simulated fleet, refuses sheddable requests first
under overload and critical ones never."""

from __future__ import annotations

import json
from pathlib import Path

from confgen import envoy
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import ads_envoy, control_plane, poll, worker_specs
from tests.support.classes import TRUSTED, load, post

TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}, {trusted}}}
sidecar: {{grpc_socket_dir: {sockets}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"]}}
routes:
  - {{name: bulk, pool: chat, class: sheddable, match: {{headers: [{{name: x-tier, exact: bulk}}]}}}}
  - {{name: urgent, pool: chat, class: critical, match: {{headers: [{{name: x-tier, exact: urgent}}]}}}}
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 2
    health: {{enabled: false}}
    outlier_detection: {{enabled: false}}
    workers:
{workers}
"""
KEY = envoy.shed_runtime_key("chat")


def _share(proxy: EnvoyProcess) -> str | None:
    status, text = proxy.admin_get("/runtime")
    if status != 200:
        return None
    entry = json.loads(text)["entries"].get(KEY)
    return entry["final_value"] if entry else None


def test_the_control_plane_serves_the_shed_share_and_sheddable_traffic_goes_first(tmp_path: Path) -> None:
    """Three workers of 2 slots under 20 closed-loop clients for 14 s (12 sheddable, 5
    standard, 3 critical): the RTDS layer carries the share at 0 before the load, above 0
    during it (seen in Envoy's runtime), 0 again after; the sheddable clients' refused share
    is above the standard clients'; the critical clients get no 429. Measured with the share at
    100 % from the start of shedding (two runs): sheddable refused 0.98 / 0.98 per attempt,
    standard 0 / 0 (58 answered each), critical 31 / 31 answered; shares seen in Envoy 0, 100."""
    specs = worker_specs(["a", "b", "c"], max_num_seqs=2, decode_ms=20.0)
    with run_fleet_in_thread(FleetSpec(workers=specs, seed=3)) as fleet:
        port, xds = free_port(), free_port()
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)
        topology = tmp_path / "topology.yaml"
        sockets = tmp_path / "sockets"  # ADS over its Unix socket
        text = TOPOLOGY.format(admin=free_port(), port=port, xds=xds, workers=workers, trusted=TRUSTED, sockets=sockets)
        topology.write_text(text)
        with control_plane(topology, xds, tmp_path / "sidecar.log") as sidecar, \
                ads_envoy(text, tmp_path / "envoy", "envoy-0") as proxy:
            url = f"http://127.0.0.1:{port}/v1/completions"
            assert poll(lambda: _share(proxy) == "0" and post(url, "bulk")[0] == 200, timeout=20), \
                sidecar.log_tail()
            seen: set[str | None] = set()
            outcome = load(url, 14.0, lambda: seen.add(_share(proxy)))
            statuses = outcome.statuses
            refused = outcome.refused()
            print(f"statuses {({k: dict(v) for k, v in statuses.items()})}, refused share {refused}, "
                  f"shares seen in Envoy {sorted(str(s) for s in seen)}")
            assert all(set(c) <= {200, 429} for c in statuses.values()), statuses
            assert statuses["critical"][429] == 0 and statuses["critical"][200] > 0, statuses
            assert any(s not in (None, "0") for s in seen), seen
            assert statuses["sheddable"][429] > 0 and refused["sheddable"] > refused["standard"], statuses
            assert poll(lambda: _share(proxy) == "0", timeout=30), sidecar.log_tail()
