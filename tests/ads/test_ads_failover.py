"""Two control planes (primary and standby) for two Envoys (delta and sotw): pools come and go over ADS, and
when the primary dies the Envoys move to the standby and keep taking decisions. Wall time ~20 s."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetHandle, FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import SidecarProcess, ads_envoy, control_plane, poll, worker_specs

POOL = """\
  - name: {name}
    engine: vllm
    models: [{name}-model]
    capacity: 4
    health: {{enabled: false}}
    outlier_detection: {{enabled: false}}
    workers: [{workers}]
"""


def _text(fleet: FleetHandle, xds: list[int], port: int, *, admin: int = 9901, protocol: str = "delta",
          extra: bool = False) -> str:
    w = {s.name: f'"127.0.0.1:{s.port}"' for s in fleet.workers}
    servers = ", ".join(f'"127.0.0.1:{p}"' for p in xds)
    pools = POOL.format(name="chat", workers=f"{w['w1']}, {w['w2']}")
    if extra:
        pools += POOL.format(name="extra", workers=w["w3"])
    return (f"version: 1\nname: ha\nadmin: {{address: 127.0.0.1, port: {admin}}}\n"
            f"listeners:\n  - {{name: public, address: 127.0.0.1, port: {port}}}\n"
            # two control planes on one host: TCP on loopback, by the explicit opt-in (one socket is one server)
            "sidecar: {grpc_plaintext_loopback: true}\n"
            f"envoy:\n  xds: {{mode: ads, servers: [{servers}], protocol: {protocol}}}\npools:\n{pools}")


def _clusters(proxy: EnvoyProcess) -> str:
    status, body = proxy.admin_get("/clusters")
    assert status == 200
    return body


@contextlib.contextmanager
def _running(tmp: Path) -> Iterator[tuple[FleetHandle, list[SidecarProcess], list[EnvoyProcess], Path, list[int], int]]:
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["w1", "w2", "w3"]), seed=5)) as fleet, \
            contextlib.ExitStack() as stack:
        xds, port = [free_port(), free_port()], free_port()
        topology = tmp / "topology.yaml"
        topology.write_text(_text(fleet, xds, port))
        # the Envoys are stopped first (the stack unwinds in reverse), then the control planes
        sidecars = [stack.enter_context(control_plane(topology, grpc_port, tmp / f"sidecar-{i}.log",
                                                      "--grpc-plaintext-loopback"))
                    for i, grpc_port in enumerate(xds)]
        envoys = [stack.enter_context(ads_envoy(_text(fleet, xds, port, admin=free_port(), protocol=protocol),
                                                tmp / f"envoy-{i}", f"envoy-{i}"))
                  for i, protocol in enumerate(("delta", "sotw"))]
        yield fleet, sidecars, envoys, topology, xds, port


def _rewrite(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_pools_come_and_go_and_envoys_fail_over_to_the_standby(tmp_path: Path) -> None:
    """Both Envoys follow the first listed control plane (primary/standby priorities); a pool added to the
    topology reaches them and a pool removed leaves them (delta removals and sotw wildcard); after the primary
    is killed they reconnect to the standby, which then marks a crashed worker unhealthy in both."""
    with _running(tmp_path) as (fleet, sidecars, envoys, topology, xds, port):
        primary, standby = sidecars
        assert poll(lambda: len(primary.state()["xds"]["nodes"]) == 2, timeout=10)
        assert standby.state()["xds"]["nodes"] == {}

        _rewrite(topology, _text(fleet, xds, port, extra=True))
        assert poll(lambda: all("extra::" in _clusters(p) for p in envoys), timeout=10)
        _rewrite(topology, _text(fleet, xds, port))
        assert poll(lambda: not any("extra::" in _clusters(p) for p in envoys), timeout=10)

        assert primary.proc is not None
        primary.proc.kill()
        primary.proc.wait(timeout=10)
        primary.proc = None
        assert poll(lambda: len(standby.state()["xds"]["nodes"]) == 2, timeout=15), standby.log_tail()

        w2 = fleet.worker("w2").port
        fleet.worker("w2").crash()
        flag = f"chat::127.0.0.1:{w2}::health_flags::/failed_eds_health"
        assert poll(lambda: all(flag in _clusters(p) for p in envoys), timeout=5)
