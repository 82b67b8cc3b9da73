"""One sidecar serving ADS to five real Envoys (three delta, two state of the world).

The sidecar runs as `python -m sidecar.main --serve-xds` (the shipped entry point) in front
of a simulated fleet; each Envoy starts from `confgen render` output for the same topology
(`envoy.xds.mode: ads`), differing only in its admin port and its node id
(`--service-node`). They share one listener port (Envoy binds listeners with SO_REUSEPORT,
the kernel spreads connections over them). Wall time ~25 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetHandle, FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import SidecarProcess, ads_envoy, control_plane, http, now, poll, worker_specs

INTERVAL = 0.5
JITTER = 0.05
PROTOCOLS = ("delta", "delta", "delta", "sotw", "sotw")

TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: {address}, port: {port}}}
sidecar: {{grpc_socket_dir: {sockets}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"], protocol: {protocol}}}
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 4
    # The control plane alone decides health: no active checks, no outlier ejection.
    health: {{enabled: false}}
    outlier_detection: {{enabled: false}}
    workers:
{workers}
"""


@dataclass
class AdsRig:
    fleet: FleetHandle
    sidecar: SidecarProcess
    envoys: dict[str, EnvoyProcess]
    topology: Path
    port: int
    xds: int
    tmp: Path

    def text(self, *, admin: int = 9901, protocol: str = "delta", address: str = "127.0.0.1") -> str:
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in self.fleet.workers)
        return TOPOLOGY.format(admin=admin, address=address, port=self.port, xds=self.xds, protocol=protocol,
                               workers=workers, sockets=self.tmp / "sockets")  # ADS over its Unix socket

    def start_envoy(self, index: int) -> EnvoyProcess:
        """Envoy `envoy-<index>` from the rendered bootstrap, with its own admin port and node id."""
        proxy = ads_envoy(self.text(admin=free_port(), protocol=PROTOCOLS[index]), self.tmp / f"envoy-{index}",
                          f"envoy-{index}")
        proxy.start()
        self.envoys[f"envoy-{index}"] = proxy
        return proxy

    def send(self) -> tuple[int, str]:
        try:
            status, headers, _ = http("POST", f"http://127.0.0.1:{self.port}/v1/completions",
                                      {"model": "sim-model", "prompt": "hi", "max_tokens": 2}, timeout=10)
        except OSError:
            return 0, "-"
        return status, headers.get("x-sim-worker", "-")

    def rewrite_topology(self, text: str) -> None:
        tmp = self.topology.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.topology)


def _flags(proxy: EnvoyProcess, port: int) -> str:
    status, body = proxy.admin_get("/clusters")
    assert status == 200
    prefix = f"chat::127.0.0.1:{port}::health_flags::"
    return next((line[len(prefix):] for line in body.splitlines() if line.startswith(prefix)), "")


def _probes(fleet: FleetHandle) -> dict[str, int]:
    """Requests each worker received that were not inference: the control plane's probes."""
    out = {}
    for w in fleet.workers:
        stats = fleet.worker(w.name).stats()
        out[w.name] = int(stats["received"]) - int(stats["inference_received"])
    return out


@contextlib.contextmanager
def ads_rig(tmp: Path) -> Iterator[AdsRig]:
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["w1", "w2", "w3"], max_num_seqs=4), seed=3)) as fleet:
        rig = AdsRig(fleet, None, {}, tmp / "topology.yaml", free_port(), free_port(), tmp)  # type: ignore[arg-type]
        rig.topology.write_text(rig.text())
        with control_plane(rig.topology, rig.xds, tmp / "sidecar.log") as rig.sidecar:
            try:
                for index in range(len(PROTOCOLS)):
                    rig.start_envoy(index)
                yield rig
            finally:
                for proxy in rig.envoys.values():
                    proxy.stop()


def test_one_control_plane_many_envoys(tmp_path: Path) -> None:
    """Five Envoys on one ADS server: traffic through each; probes from one sidecar only; a killed worker
    UNHEALTHY in every Envoy within two probe intervals; a restarted Envoy gets the current config; a NACKed
    listener is reported (metric + /state) while the old one keeps serving; with the control plane killed
    every Envoy keeps serving its last config."""
    with ads_rig(tmp_path) as rig:
        state = rig.sidecar.state()
        assert sorted(state["xds"]["nodes"]) == sorted(rig.envoys)
        assert {n["protocol"] for n in state["xds"]["nodes"].values()} == {"delta", "sotw"}
        assert all(set(n["acked"]) == {"cds", "eds", "lds", "rtds"} for n in state["xds"]["nodes"].values())

        # Traffic flows through each Envoy (new connection per request; the kernel spreads them).
        results = Counter(rig.send()[0] for _ in range(60))
        assert results == {200: 60}, results
        for name, proxy in rig.envoys.items():
            assert int(proxy.stats().get("http.public.downstream_rq_total", 0)) > 0, name

        # Below saturation every Envoy's in-flight limit is the render's safety cap, 4 x 12 slots
        # (served over RTDS); only a saturated pool gets a lower one (sidecar.decide.saturation).
        layer = rig.envoys["envoy-0"].admin_get("/runtime")[1]
        assert json.loads(layer)["entries"]["circuit_breakers.chat.default.max_requests"]["final_value"] == "48"

        # Probes: one control plane probes each worker once per cycle (health + metrics at most),
        # whatever the number of Envoys; five sidecars would send at least five times the minimum.
        before, started = _probes(rig.fleet), now()
        poll(lambda: False, timeout=3.0)
        after, window = _probes(rig.fleet), now() - started
        cycles_max = window / (INTERVAL * (1 - JITTER)) + 2
        for name in before:
            sent = after[name] - before[name]
            assert 1 <= sent <= 2 * cycles_max, (name, sent, window)
            assert sent < len(rig.envoys) * (window / (INTERVAL * (1 + JITTER)) - 1), (name, sent)

        # A killed worker is UNHEALTHY in every Envoy within two probe intervals.
        port = rig.fleet.worker("w2").port
        rig.fleet.worker("w2").crash()
        killed = now()
        pending = set(rig.envoys)
        seen: dict[str, float] = {}
        while pending and now() - killed < 5:
            for name in sorted(pending):
                if "/failed_eds_health" in _flags(rig.envoys[name], port):
                    seen[name] = now() - killed
                    pending.discard(name)
        assert not pending, pending
        assert max(seen.values()) <= 2 * INTERVAL * (1 + JITTER) + 0.1, seen

        # An Envoy restarted mid-run gets the current config (the dead worker already marked).
        rig.envoys["envoy-4"].stop()
        restarted = rig.start_envoy(4)
        assert "/failed_eds_health" in _flags(restarted, port)
        assert poll(lambda: "envoy-4" in rig.sidecar.state()["xds"]["nodes"], timeout=5)
        served = rig.sidecar.state()["xds"]["versions"]
        assert poll(lambda: rig.sidecar.state()["xds"]["nodes"]["envoy-4"]["acked"].get("lds") == served["lds"],
                    timeout=5)
        assert 'confgen_sidecar_xds_node_in_sync{node="envoy-4",type="lds"} 1.0' in rig.sidecar.metrics()

        # A listener Envoy refuses (an address it cannot bind) is NACKed by every Envoy, reported, and the
        # listener in force keeps serving.
        rig.rewrite_topology(rig.text(address="192.0.2.1"))

        def all_nacked() -> bool:
            nodes = rig.sidecar.state()["xds"]["nodes"]
            return len(nodes) == len(rig.envoys) and all("lds" in n["nacked"] for n in nodes.values())

        assert poll(all_nacked, timeout=10, interval=0.1), rig.sidecar.state()["xds"]
        nacked = rig.sidecar.state()["xds"]["nodes"]["envoy-0"]["nacked"]["lds"]
        assert "cannot bind" in nacked["error"]
        metrics = rig.sidecar.metrics()
        line = f'confgen_sidecar_xds_node_nacked{{node="envoy-0",type="lds",version="{nacked["version"]}"}} 1.0'
        assert line in metrics, metrics
        # the version it accepted is no longer the one served (one series per Envoy and type, whatever the versions)
        assert 'confgen_sidecar_xds_node_in_sync{node="envoy-0",type="lds"} 0.0' in metrics, metrics
        assert "confgen_sidecar_xds_node_acked" not in metrics
        assert re.search(r'confgen_sidecar_xds_nacks_total\{node="envoy-3",type="lds"\} 1.0', metrics)
        assert Counter(rig.send()[0] for _ in range(20)) == {200: 20}

        # The control plane killed: every Envoy keeps its last config and serves, the dead worker kept out.
        assert rig.sidecar.proc is not None
        rig.sidecar.proc.kill()
        rig.sidecar.proc.wait(timeout=10)
        rig.sidecar.proc = None
        poll(lambda: False, timeout=1.0)
        outcomes = Counter(rig.send() for _ in range(40))
        assert sum(n for (status, _), n in outcomes.items() if status == 200) == 40, outcomes
        assert not [w for (_, w) in outcomes if w == "w2"], outcomes
        for name, proxy in rig.envoys.items():
            assert "/failed_eds_health" in _flags(proxy, port), name
            assert proxy.admin_get("/ready")[0] == 200, name


