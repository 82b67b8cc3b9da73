"""The sidecar's HTTP app (sidecar.serve.server) over a real Daemon that probes the simulated fleet
for real, with the real endpoint picker registered in the same registry: what /state, /metrics
and the status page (GET /) answer, on a loopback port.

Two pools: `chat` (policy prefix_affinity: the picker's pool; workers a, b and d, d drained) and
`batch` (least_request: worker c, and a port nobody listens on, so UNHEALTHY). Envoy's admin is
a closed port (nothing here needs it). Picks come from the picker's own Picker over its own
Datastore (the gRPC transport is exercised by tests/sidecar_live/test_picker_live.py).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client.registry import CollectorRegistry

from confgen.runtime import free_port
from confgen.simulate import FleetHandle, FleetSpec, WorkerSpec, run_fleet_in_thread
from confgen.topology import load as load_topology
from sidecar.config import SidecarConfig
from sidecar.daemon import Daemon
from sidecar.decide.state import HealthPolicy
from sidecar.observe.probe import Prober
from sidecar.observe.resolve import Resolver
from sidecar.outputs.contract import Wiring
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.files.publisher import EdsPublisher
from sidecar.outputs.grpc import Servicers
from sidecar.outputs.picker import PickerService
from sidecar.outputs.picker.prompt import block_hashes, parse_body
from sidecar.outputs.picker.scheduling import Picker, PickRequest
from sidecar.serve.guard import MutationGuard
from sidecar.serve.metrics import register
from sidecar.serve.server import build_app

TOPOLOGY = """\
version: 1
name: status-rig
admin: {{address: 127.0.0.1, port: {admin}}}
listeners: [{{name: public, address: 127.0.0.1, port: {port}}}]
routes:
  - {{name: batch, pool: batch, match: {{models: [batch-model]}}}}
default_pool: chat
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 4
    balancing: {{policy: prefix_affinity}}
    workers: ["127.0.0.1:{a}", "127.0.0.1:{b}", "127.0.0.1:{d}"]
  - name: batch
    engine: vllm
    models: [batch-model]
    capacity: 2
    balancing: {{policy: least_request}}
    workers: ["127.0.0.1:{c}", "127.0.0.1:{dead}"]
limits:
  per_key: {{requests: 10, per: 1s}}
sidecar: {{grpc_port: {grpc}}}
auth:
  api_keys:
    - {{client: team-a, env: STATUS_RIG_KEY}}
"""


@dataclass
class Served:
    base: str
    daemon: Daemon
    registry: CollectorRegistry
    picker: PickerService
    pools: dict[str, list[str]]  # pool -> the workers the topology lists


@contextmanager
def status_fleet() -> Iterator[FleetHandle]:
    workers = (WorkerSpec(name="a", models=("sim-model",), max_num_seqs=4),
               WorkerSpec(name="b", models=("sim-model",), max_num_seqs=4),
               WorkerSpec(name="c", models=("batch-model",), max_num_seqs=2),
               WorkerSpec(name="d", models=("sim-model",), max_num_seqs=4))
    with run_fleet_in_thread(FleetSpec(workers=workers, seed=5)) as handle:
        yield handle


def pick(served: Served, prompt_text: str) -> str:
    """One pick for pool chat by the picker's own Picker over its Datastore, counted in its metrics
    and indexed at the chosen endpoint (what its ext_proc servicer does per request); the address."""
    prompt = parse_body(json.dumps({"model": "sim-model", "prompt": prompt_text}).encode())
    assert prompt is not None
    hashes = block_hashes(prompt.text, "sim-model")
    chosen = Picker(rng=random.Random(2)).pick(PickRequest("chat", prompt, hashes),
                                               served.picker.store.endpoints("chat"))
    assert chosen.endpoints, chosen
    chosen.endpoints[0].index.add(hashes)
    served.picker.metrics.observe_pick("chat", chosen, 0.0003)
    return chosen.endpoints[0].address


@asynccontextmanager
async def serving(tmp: Path, fleet: FleetHandle, *, cycles: int = 2) -> AsyncIterator[Served]:
    """The app on a free loopback port after `cycles` probe cycles (d drained), the picker updated."""
    a, b, c, d = (w.port for w in fleet.workers)
    path = tmp / "topology.yaml"
    path.write_text(TOPOLOGY.format(admin=free_port(), port=free_port(), a=a, b=b, c=c, d=d, dead=free_port(),
                                    grpc=free_port()))
    topo, _ = load_topology(path)
    config = SidecarConfig(topology=path, xds_dir=tmp / "envoy", confirm_timeout_s=0.0,
                           health=HealthPolicy(slow_start_s=0.0))
    loop = asyncio.get_running_loop()
    registry = CollectorRegistry()
    async with (
        Prober(max_concurrency=4, deadline_s=1.0, body_cap=1 << 20, clock=loop.time) as prober,
        EnvoyAdmin(f"http://127.0.0.1:{free_port()}", timeout_s=0.2) as admin,
    ):
        publisher = EdsPublisher(tmp / "envoy", admin, debounce_s=0.0, confirm_timeout_s=0.0)
        daemon = Daemon(config, topo, prober=prober, resolver=Resolver(1.0), publisher=publisher, clock=loop.time)
        picker = PickerService(Wiring(config, topo, lambda: daemon.topology, admin, registry, loop.time, Servicers()))
        register(registry, daemon.view)
        assert daemon.set_drain("chat", f"127.0.0.1:{d}", True)
        for _ in range(cycles):
            await daemon.cycle()
        picker.update(daemon.view())
        runner = web.AppRunner(build_app(daemon, registry, guard=MutationGuard(None, remote=False)), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        pools = {p.name: [w.address for w in p.workers] for p in topo.pools}
        try:
            yield Served(f"http://127.0.0.1:{port}", daemon, registry, picker, pools)
        finally:
            await runner.cleanup()
            await publisher.close()


async def get(url: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session, session.get(url) as resp:
        return resp.status, dict(resp.headers), await resp.read()
