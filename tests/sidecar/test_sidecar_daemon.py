"""The daemon's cycle, driven step by step with a fake clock.

Real parts: simulated vLLM workers on loopback, the real Prober and Resolver, the real
state machine and weights. The publisher is a recorder implementing the `Publisher`
interface (what the daemon decided is the behaviour under test, not a proxy's reaction),
and time is a number the test moves, so every transition is exact and nothing sleeps.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from confgen.endpoints import Endpoint
from confgen.model import Topology
from confgen.simulate import FleetHandle, FleetSpec, WorkerSpec, fleet_topology, run_fleet_in_thread
from sidecar.config import SidecarConfig
from sidecar.daemon import Daemon
from sidecar.decide.state import HealthPolicy
from sidecar.fleet import Cycle, Snapshot
from sidecar.observe.probe import Prober
from sidecar.observe.resolve import Resolver
from sidecar.outputs.contract import OutputStatus, Publisher, published

SPARE_POOL = ["  - name: spare", "    engine: vllm", "    models: [spare-model]", "    capacity: 4",
              "    workers: [{worker}]"]


@dataclass
class Recorder:
    """A `Publisher` that keeps what it was asked to publish."""

    name = "recorder"
    publishes: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    rejected: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (method, pool or "*")
    latest: dict[str, list[Endpoint]] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)
    applied: int = 0  # cycles applied (after the publish)
    updated: int = 0  # fleet views handed over

    async def start(self) -> None:
        self.calls.append(("start", "*"))

    def adopt(self, pool: str) -> list[Endpoint]:
        self.calls.append(("adopt", pool))
        return []

    async def apply(self, cycle: Cycle) -> None:
        self.applied += 1

    def update(self, fleet: Snapshot) -> None:
        self.updated += 1

    def status(self) -> OutputStatus:
        return OutputStatus(problems=tuple(self.broken), pools=published(self.publishes, self.rejections,
                                                                          self.rejected))

    def offer(self, pool: str, endpoints: Sequence[Endpoint]) -> None:
        self.calls.append(("offer", pool))
        self.latest[pool] = list(endpoints)

    def check_reload(self, old: Topology, new: Topology) -> Callable[[], None]:
        self.calls.append(("check_reload", new.name))
        return lambda: self.calls.append(("adopted", new.name))

    async def publish_all(self, topo: Topology, endpoints: Mapping[str, Sequence[Endpoint]]) -> bool:
        self.calls.append(("publish_all", "*"))
        self.latest.update({pool: list(eps) for pool, eps in endpoints.items()})
        return True

    def forget(self, pool: str) -> None:
        self.calls.append(("forget", pool))
        self.latest.pop(pool, None)

    async def check_published(self) -> bool:
        return True

    async def close(self) -> None:
        self.calls.append(("close", "*"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fleet() -> Iterator[FleetHandle]:
    workers = tuple(WorkerSpec(name=n, models=("sim-model", "spare-model")) for n in ("a", "b", "c"))
    with run_fleet_in_thread(FleetSpec(workers=workers, seed=5)) as handle:
        yield handle


def _write(path: Path, fleet: FleetHandle, *, spare: bool = False) -> None:
    workers = [f"127.0.0.1:{w.port}" for w in fleet.workers]
    tail = [line.format(worker=workers[0]) for line in SPARE_POOL] if spare else []
    path.write_text(fleet_topology(name="cycle", admin=19901, port=18080, workers=workers, models=["sim-model"],
                                   capacity=4, pool=["health: {enabled: false}", "outlier_detection: {enabled: false}"],
                                   tail=tail))


def _statuses(endpoints: Sequence[Endpoint], fleet: FleetHandle) -> dict[str, str]:
    names = {f"127.0.0.1:{w.port}": w.name for w in fleet.workers}
    return {names[ep.worker]: ep.health for ep in endpoints}


def _run(tmp: Path, fleet: FleetHandle, body: Callable[[Daemon, Recorder, Clock], Awaitable[None]],
         *, spare: bool = False, outputs: Sequence[object] = ()) -> Recorder:
    topo_path = tmp / "topology.yaml"
    _write(topo_path, fleet, spare=spare)
    # Thresholds the test counts cycles against: 2 failures eject, 2 successes restore.
    config = SidecarConfig(topology=topo_path, xds_dir=tmp, interval_s=1.0,
                           health=HealthPolicy(fall=2, refused_fall=2, rise=2, slow_start_s=0.0))
    recorder = Recorder()

    async def main() -> None:
        from confgen.topology import load

        topo, _ = load(topo_path)
        clock = Clock()
        publisher: Publisher = recorder
        async with Prober(max_concurrency=8, deadline_s=2.0, body_cap=1 << 20, clock=clock) as prober:
            daemon = Daemon(config, topo, prober=prober, resolver=Resolver(2.0), publisher=publisher, clock=clock,
                            outputs=outputs)  # type: ignore[arg-type]
            await body(daemon, recorder, clock)

    asyncio.run(main())
    return recorder


def test_first_cycle_publishes_everything_later_cycles_offer_per_pool(tmp_path: Path, fleet: FleetHandle) -> None:
    """Startup adopts per pool; the first cycle publishes the whole output once (publish_all)
    with every endpoint HEALTHY, later cycles offer each pool; readiness waits for the first
    cycle and the first whole publish; the publisher's problems are listed, never unready."""

    async def body(daemon: Daemon, rec: Recorder, clock: Clock) -> None:
        assert daemon.restore() == (0, 0)
        assert daemon.not_ready() == ["first probe cycle not done"]
        await daemon.cycle()
        assert rec.calls[-1] == ("publish_all", "*")
        assert (rec.applied, rec.updated) == (1, 1)  # the cycle applied after the publish, then the view
        assert _statuses(rec.latest["chat"], fleet) == {"a": "HEALTHY", "b": "HEALTHY", "c": "HEALTHY"}
        assert daemon.not_ready() == []
        clock.now += 1.0
        await daemon.cycle()
        assert rec.calls[-1] == ("offer", "chat")
        assert (rec.applied, rec.updated) == (2, 2)
        rec.broken.append("last chat update rejected")
        assert daemon.view().not_ready == ()
        assert daemon.view().problems == ("last chat update rejected",)

    rec = _run(tmp_path, fleet, body)
    assert rec.calls[0] == ("adopt", "chat")
    assert [c for c in rec.calls if c[0] == "publish_all"] == [("publish_all", "*")]


class _Service:
    """An output beside the publisher (as the picker is): what the daemon hands it and reads of it."""

    name = "picker"

    def __init__(self) -> None:
        self.faults: list[str] = []
        self.refusals: dict[tuple[str, str], int] = {}
        self.views: list[Snapshot] = []
        self.cycles: list[Cycle] = []
        self.forgotten: list[str] = []

    async def apply(self, cycle: Cycle) -> None:
        self.cycles.append(cycle)

    def update(self, fleet: Snapshot) -> None:
        self.views.append(fleet)

    def forget(self, pool: str) -> None:
        self.forgotten.append(pool)

    def status(self) -> OutputStatus:
        return OutputStatus(problems=tuple(f"picker: {fault}" for fault in self.faults),
                            refused={("picker", pool, cls): n for (pool, cls), n in self.refusals.items()})


def test_an_outputs_problems_are_listed_after_the_publishers_never_unready(tmp_path: Path, fleet: FleetHandle) -> None:
    """An output beside the publisher (what sidecar.main gives the daemon for the limiter and every
    gRPC service) is applied each cycle after the publisher and handed the fleet view that cycle
    left; its problems are listed after the publisher's in `problems()` and the snapshot (/readyz's
    body, /state, the metric); readiness ignores them. Its refusals are in the snapshot by
    (output, pool, class), and in the one shed counter."""
    service = _Service()

    async def body(daemon: Daemon, rec: Recorder, clock: Clock) -> None:
        await daemon.cycle()
        assert [c.now for c in service.cycles] == [clock.now] and service.cycles[0].endpoints["chat"]
        assert [v.cycles for v in service.views] == [1]
        assert {p.name for p in service.views[0].pools} == {"chat"}
        assert daemon.problems() == []
        service.faults.append("x")
        rec.broken.append("last chat update rejected")
        assert daemon.problems() == ["last chat update rejected", "picker: x"]
        assert daemon.view().problems == ("last chat update rejected", "picker: x")
        assert daemon.not_ready() == []
        service.refusals[("chat", "sheddable")] = 3
        assert daemon.view().refused == {("picker", "chat", "sheddable"): 3}
        from prometheus_client import CollectorRegistry, generate_latest

        from sidecar.serve.metrics import SidecarCollector

        registry = CollectorRegistry()
        registry.register(SidecarCollector(daemon.view))
        text = generate_latest(registry).decode()
        assert 'confgen_sidecar_shed_requests_total{class="sheddable",pool="chat",reason="picker"} 3.0' in text

    _run(tmp_path, fleet, body, outputs=[service])


def test_a_crashed_worker_is_ejected_after_fall_cycles_and_drain_is_published(
    tmp_path: Path, fleet: FleetHandle
) -> None:
    """A worker refusing connections is UNHEALTHY after `fall` (2) failed cycles, not after
    one; an admin drain of another worker is published as DRAINING by the next republish
    without a probe, and undrain brings it back."""

    async def body(daemon: Daemon, rec: Recorder, clock: Clock) -> None:
        await daemon.cycle()
        fleet.worker("b").crash()
        clock.now += 1.0
        await daemon.cycle()
        assert _statuses(rec.latest["chat"], fleet)["b"] == "HEALTHY"  # one failure is not enough
        clock.now += 1.0
        await daemon.cycle()
        assert _statuses(rec.latest["chat"], fleet) == {"a": "HEALTHY", "b": "UNHEALTHY", "c": "HEALTHY"}
        a = f"127.0.0.1:{fleet.worker('a').port}"
        assert daemon.set_drain("chat", a, True)
        assert not daemon.set_drain("chat", "127.0.0.1:1", True)  # not in the topology
        await daemon.republish()
        assert _statuses(rec.latest["chat"], fleet)["a"] == "DRAINING"
        assert daemon.set_drain("chat", a, False)
        clock.now += 1.0
        await daemon.cycle()
        assert _statuses(rec.latest["chat"], fleet)["a"] != "DRAINING"

    _run(tmp_path, fleet, body)


def test_reload_forgets_a_removed_pool_and_publishes_everything_again(tmp_path: Path, fleet: FleetHandle) -> None:
    """A reloaded topology without a pool makes the daemon tell the publisher and every other
    output to forget it, publish the whole new output (publish_all), and drop the pool from its
    view; an invalid edit keeps the previous topology and counts a failed reload."""
    service = _Service()

    async def body(daemon: Daemon, rec: Recorder, clock: Clock) -> None:
        await daemon.cycle()
        assert {p.name for p in daemon.view().pools} == {"chat", "spare"}
        _write(daemon.config.topology, fleet, spare=False)
        clock.now += 1.0
        assert await daemon.reload()
        assert ("forget", "spare") in rec.calls and ("adopted", "cycle") in rec.calls
        assert service.forgotten == ["spare"]
        assert rec.calls[-1] == ("publish_all", "*")
        assert {p.name for p in daemon.view().pools} == {"chat"}
        daemon.config.topology.write_text("version: 1\nname: [broken\n")
        assert not await daemon.reload()
        view = daemon.view()
        assert view.reloads == {"ok": 1, "error": 1} and view.last_reload_error
        assert {p.name for p in view.pools} == {"chat"}

    _run(tmp_path, fleet, body, spare=True, outputs=[service])
