"""GET /v1/models lists only the models with healthy capacity somewhere in their chain, on
both targets, from the real sidecar's health view; without a sidecar, the full list.

One fleet, three pools: alpha (falls back to beta), beta, gamma. Envoy and nginx both serve
the rendered config; confgen-sidecar probes the workers and publishes Envoy's endpoints."""

from __future__ import annotations

import json
from pathlib import Path

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, WorkerSpec, run_fleet_in_thread
from tests.nginx._support import running_nginx
from tests.sidecar_live.rig import FAST_ARGS, SidecarProcess, http, poll

TOPOLOGY = """\
version: 1
name: models-live
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
sidecar: {{address: 127.0.0.1, port: {sidecar}}}
pools:
  - {{name: alpha, engine: vllm, models: [alpha], fallback: beta, balancing: {{policy: least_request}},
      health: {{enabled: false}}, outlier_detection: {{enabled: false}}, workers: ["127.0.0.1:{a}"]}}
  - {{name: beta, engine: vllm, models: [beta], balancing: {{policy: least_request}},
      health: {{enabled: false}}, outlier_detection: {{enabled: false}}, workers: ["127.0.0.1:{b}"]}}
  - {{name: gamma, engine: vllm, models: [gamma], balancing: {{policy: least_request}},
      health: {{enabled: false}}, outlier_detection: {{enabled: false}}, workers: ["127.0.0.1:{c}"]}}
"""


def _names(url: str) -> list[str]:
    status, headers, body = http("GET", url + "/v1/models", timeout=5.0)
    assert status == 200, body
    assert headers["content-type"].startswith("application/json")
    listed = json.loads(body)
    assert listed["object"] == "list"
    return [m["id"] for m in listed["data"]]


def test_models_list_follows_health_on_envoy_and_nginx(tmp_path: Path) -> None:
    """Full list with no sidecar running (both proxies fall back to the topology's list); then a
    crashed gamma worker drops gamma; a crashed alpha worker keeps alpha (its fallback beta
    serves); gamma revived comes back; a crashed beta worker then drops alpha and beta."""
    workers = tuple(WorkerSpec(name=n, models=(n,)) for n in ("alpha", "beta", "gamma"))
    with run_fleet_in_thread(FleetSpec(workers=workers, seed=5)) as fleet:
        ports = {w.name: w.port for w in fleet.workers}
        listen, admin, port = free_port(), free_port(), free_port()
        text = TOPOLOGY.format(admin=admin, port=port, sidecar=listen, a=ports["alpha"], b=ports["beta"],
                               c=ports["gamma"])
        topo_path = tmp_path / "topology.yaml"
        topo_path.write_text(text)
        topo, _ = parse_topology(text.encode())
        xds = tmp_path / "envoy"
        write_tree(envoy.render(topo, config_dir=str(xds)), xds)
        with EnvoyProcess(xds / "bootstrap.json") as proxy, running_nginx(text, tmp_path / "nginx") as ngx:
            proxies = [f"http://127.0.0.1:{port}", ngx.url]
            listening = poll(lambda: proxy.stats().get("listener_manager.total_listeners_active") == 1, timeout=10.0)
            assert listening, proxy.log_text()
            for url in proxies:
                assert _names(url) == ["alpha", "beta", "gamma"]  # no sidecar: the topology's list
            sidecar = SidecarProcess(["--topology", str(topo_path), "--xds-dir", str(xds),
                                      "--listen", f"127.0.0.1:{listen}", *FAST_ARGS], tmp_path / "sidecar.log", listen)
            sidecar.start()
            try:
                sidecar.wait_ready()
                for url in proxies:
                    assert _names(url) == ["alpha", "beta", "gamma"]
                steps = (("crash", "gamma", ["alpha", "beta"]), ("crash", "alpha", ["alpha", "beta"]),
                         ("revive", "gamma", ["alpha", "beta", "gamma"]), ("crash", "beta", ["gamma"]))
                for action, name, expected in steps:
                    worker = fleet.worker(name)
                    worker.crash() if action == "crash" else worker.revive()
                    for url in proxies:
                        assert poll(lambda u=url, e=expected: _names(u) == e, timeout=10.0), (
                            f"{url} after {action} {name}: {_names(url)}\n{sidecar.log_tail()}")
            finally:
                assert sidecar.stop() == 0, sidecar.log_tail()


def test_a_sidecar_listening_where_the_proxy_does_not_ask_says_so(tmp_path: Path) -> None:
    """The real sidecar process, started with a --listen port that is not the topology's
    sidecar.port (the rendered Envoy would ask 9109 for /v1/models and reach nothing), logs
    the disagreement as an error at startup; started without --listen it serves on the
    topology's port and logs nothing of the kind."""
    listen, other = free_port(), free_port()
    text = TOPOLOGY.format(admin=free_port(), port=free_port(), sidecar=listen, a=1001, b=1002, c=1003)
    topo_path = tmp_path / "topology.yaml"
    topo_path.write_text(text)
    common = ["--topology", str(topo_path), "--xds-dir", str(tmp_path / "envoy"), *FAST_ARGS]
    for args, port, mismatch in (([*common, "--listen", f"127.0.0.1:{other}"], other, True), (common, listen, False)):
        log = tmp_path / f"sidecar-{port}.log"
        sidecar = SidecarProcess(args, log, port)
        sidecar.start()
        try:
            assert poll(lambda s=sidecar: any(e.get("event") == "startup.done" for e in s.events()), 20.0), (
                sidecar.log_tail())
            assert sidecar.get("/healthz")[0] == 200  # it serves where it says
            found = [e for e in sidecar.events() if e.get("event") == "startup.listen_mismatch"]
            if mismatch:
                assert [e["level"] for e in found] == ["error"]
                assert f"sidecar.port {listen}" in found[0]["problem"]
            else:
                assert found == []
        finally:
            assert sidecar.stop() == 0
