"""The sidecar's Prometheus collector (sidecar.serve.metrics) over real daemon cycles: the
simulated fleet is probed for real; Envoy's admin is a closed port (not needed here)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from confgen.runtime import free_port
from confgen.simulate import FleetHandle, FleetSpec, WorkerSpec, run_fleet_in_thread
from confgen.topology import load as load_topology
from sidecar.config import SidecarConfig
from sidecar.daemon import Daemon
from sidecar.decide.state import HealthPolicy
from sidecar.observe.probe import Prober
from sidecar.observe.resolve import Resolver
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.files.publisher import EdsPublisher
from sidecar.serve.metrics import METRIC_NAMES, register

TOPOLOGY = """\
version: 1
name: metrics
admin: {{address: 127.0.0.1, port: {admin}}}
listeners: [{{name: public, address: 127.0.0.1, port: {port}}}]
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 4
    workers: [{workers}]
"""

EP_LABELS = {"pool", "worker", "address"}
LABELS = {
    "llm_queue_depth": {"pool", "worker"},
    "confgen_sidecar_build_info": {"version", "python_version"},
    "confgen_sidecar_pool_saturation_ratio": {"pool"},
    "confgen_sidecar_endpoint_health": EP_LABELS | {"state"},
    "confgen_sidecar_endpoint_running_requests": EP_LABELS,
    "confgen_sidecar_endpoint_waiting_requests": EP_LABELS,
    "confgen_sidecar_endpoint_kv_cache_usage_ratio": EP_LABELS,
    "confgen_sidecar_endpoint_weight": EP_LABELS,
    "confgen_sidecar_probe_duration_seconds_bucket": {"pool", "le"},
    "confgen_sidecar_probe_duration_seconds_count": {"pool"},
    "confgen_sidecar_probe_duration_seconds_sum": {"pool"},
    "confgen_sidecar_eds_publishes_total": {"pool"},
    "confgen_sidecar_eds_rejected_total": {"pool"},
    "confgen_sidecar_topology_reloads_total": {"result"},
    "confgen_sidecar_probe_cycles_total": set(),
    "confgen_sidecar_ready": set(),
    "confgen_sidecar_topology_stale": set(),
    "confgen_sidecar_write_failures_total": {"target"},
}


@pytest.fixture
def fleet() -> Iterator[FleetHandle]:
    workers = tuple(WorkerSpec(name=n, models=("sim-model",), max_num_seqs=4) for n in ("a", "b"))
    with run_fleet_in_thread(FleetSpec(workers=workers, seed=1)) as handle:
        yield handle


def samples(registry: CollectorRegistry) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it has, from a real scrape of the registry."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append({**sample.labels, "=": str(sample.value)})
    return out


def labels(series: dict[str, str]) -> set[str]:
    return set(series) - {"="}


async def cycles(tmp: Path, fleet: FleetHandle, registry: CollectorRegistry,
                 ) -> tuple[dict[str, list[dict[str, str]]], dict[str, list[dict[str, str]]]]:
    """Scrapes after a cycle with workers a and b, and after a reload that removed b."""
    admin, port = free_port(), free_port()
    a, b = (f'"127.0.0.1:{w.port}"' for w in fleet.workers)
    topo_path = tmp / "topology.yaml"
    topo_path.write_text(TOPOLOGY.format(admin=admin, port=port, workers=f"{a}, {b}"))
    topo, _ = load_topology(topo_path)
    config = SidecarConfig(topology=topo_path, xds_dir=tmp / "envoy", confirm_timeout_s=0.0,
                           health=HealthPolicy(slow_start_s=0.0))
    loop = asyncio.get_running_loop()
    async with (
        Prober(max_concurrency=4, deadline_s=1.0, body_cap=1 << 20, clock=loop.time) as prober,
        EnvoyAdmin(f"http://127.0.0.1:{admin}", timeout_s=0.5) as envoy_admin,
    ):
        publisher = EdsPublisher(config.xds_dir or tmp, envoy_admin, debounce_s=0.0, confirm_timeout_s=0.0)
        daemon = Daemon(config, topo, prober=prober, resolver=Resolver(1.0), publisher=publisher, clock=loop.time)
        register(registry, daemon.view)
        await daemon.cycle()
        before = samples(registry)
        topo_path.write_text(TOPOLOGY.format(admin=admin, port=port, workers=a))
        assert await daemon.reload()
        after = samples(registry)
        await publisher.close()
    return before, after


def test_series_and_label_sets_follow_the_fleet(tmp_path: Path, fleet: FleetHandle) -> None:
    """Every family carries exactly its documented labels; each endpoint has one health
    series per EDS state (one of them 1); after a reload removes worker b, no series of
    b is left in the scrape (the collector reads the current snapshot only)."""
    before, after = asyncio.run(cycles(tmp_path, fleet, CollectorRegistry()))
    for name, wanted in LABELS.items():
        assert before.get(name), name
        assert all(labels(s) == wanted for s in before[name]), (name, before[name])
    b = f"127.0.0.1:{fleet.workers[1].port}"
    health = [s for s in before["confgen_sidecar_endpoint_health"] if s["worker"] == b]
    assert sorted(s["state"] for s in health) == ["degraded", "draining", "healthy", "unhealthy"]
    assert all(s["address"] == b for s in health)
    assert sorted(s["="] for s in health) == ["0.0", "0.0", "0.0", "1.0"]

    def workers(scrape: dict[str, list[dict[str, str]]]) -> set[str]:
        return {s["worker"] for series in scrape.values() for s in series if "worker" in s}

    assert workers(before) == {f"127.0.0.1:{w.port}" for w in fleet.workers}
    assert workers(after) == {f"127.0.0.1:{fleet.workers[0].port}"}
    assert after["confgen_sidecar_topology_reloads_total"] == [{"result": "ok", "=": "1.0"},
                                                              {"result": "error", "=": "0.0"},
                                                              {"result": "needs_keys", "=": "0.0"}]
    assert after["confgen_sidecar_topology_stale"] == [{"=": "0.0"}]
    assert "confgen_sidecar_inflight_limit" not in after  # no limiter, no series
    # one probe per endpoint per cycle: two endpoints probed once, all within the last bucket
    assert before["confgen_sidecar_probe_duration_seconds_count"] == [{"pool": "chat", "=": "2.0"}]
    assert before["confgen_sidecar_probe_duration_seconds_bucket"][-1] == {"pool": "chat", "le": "+Inf", "=": "2.0"}
    assert {s["worker"] for s in before["llm_queue_depth"]} == workers(before) - {""}
    assert before["confgen_sidecar_probe_cycles_total"] == [{"=": "1.0"}]


def test_every_documented_family_is_scraped_and_no_other() -> None:
    """The collector's METRIC_NAMES (what the README, dashboard and alert rules use) is
    exactly the set of families a scrape yields, besides the nginx publisher's own."""
    assert set(METRIC_NAMES) >= {name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
                                 for name in LABELS}
