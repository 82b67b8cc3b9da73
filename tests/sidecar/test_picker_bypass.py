"""The share of requests Envoy sends past the picker while it cannot keep up (bypass.py), and how the
picker publishes it (PickerService.bypass_tick, the publishers' runtime writers). The real Envoy
skipping the filter on that share: tests/sidecar_live/test_picker_live.py."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest
from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf import json_format
from prometheus_client import CollectorRegistry

from confgen.envoy import PICKER_BYPASS_RUNTIME_KEY
from confgen.topology import load as load_topology
from sidecar.config import SidecarConfig
from sidecar.outputs.contract import EnvoyRuntime, Wiring
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.grpc import GrpcSettings, Servicers
from sidecar.outputs.picker import PickerPolicy, PickerService
from sidecar.outputs.picker.bypass import Bypass, BypassPolicy
from sidecar.outputs.picker.datastore import Datastore, EndpointFacts, PoolFacts
from sidecar.outputs.picker.prompt import parse_body
from sidecar.outputs.picker.scheduling import Picker, PickRequest
from sidecar.outputs.xds.cache import RTDS
from sidecar.outputs.xds.publisher import AdsPublisher

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "07-prefix-affinity.yaml"


def test_the_share_rises_by_what_was_late_and_falls_while_the_picker_keeps_up() -> None:
    bypass = Bypass()
    assert bypass.step(1000, 0) == 0  # keeps up: nothing skips it
    # 40 % answered late, once: a burst (the late rule answers it); twice in a row: sustained. Had 40 %
    # skipped the picker, those would have been spared the round trip
    assert bypass.step(1000, 400) == 0
    assert bypass.step(1000, 400) == 40
    # still 20 % of what reached it late: 1 - 0.6 * 0.8 = 52 %
    assert bypass.step(600, 120) == 52
    # a little over `on`: at least min_step more
    assert bypass.step(480, 50) == 57
    # between off and on: too little to move either way
    assert bypass.step(430, 20) == 57
    # keeping up: down by step_down each interval, to 0 and no further
    assert [bypass.step(500, 0) for _ in range(13)] == [52, 47, 42, 37, 32, 27, 22, 17, 12, 7, 2, 0, 0]
    # from 0 again, the streak again: one interval late is not enough
    assert bypass.step(1000, 300) == 0
    assert bypass.step(1000, 0) == 0
    assert bypass.step(1000, 300) == 0


def test_the_share_does_not_rise_while_admission_is_on() -> None:
    """Sent past the picker is sent past its admission: while a pool admits, late requests do not raise
    the share (the late rule answers them, refusing under admission); it still falls, and rises again once
    admission is off."""
    bypass = Bypass()
    assert [bypass.step(1000, 400, surging=True) for _ in range(3)] == [0, 0, 0]
    assert bypass.step(1000, 400) == 40  # admission off, late for the third interval in a row: sustained
    assert bypass.step(1000, 400, surging=True) == 40  # held, not raised
    assert bypass.step(1000, 0, surging=True) == 35  # falls as ever


def test_an_interval_with_too_few_requests_says_nothing_and_the_share_has_a_ceiling() -> None:
    bypass = Bypass(BypassPolicy(max_percent=60))
    assert bypass.step(49, 49) == 0  # 49 requests, all late: under 100 req/s, the late rule's
    assert bypass.step(49, 49) == 0
    assert bypass.step(100, 100) == 0
    assert bypass.step(100, 100) == 60  # every request late: the ceiling, so the picker keeps learning
    assert bypass.step(50, 50) == 60
    assert bypass.step(5, 0) == 60  # a quiet interval does not lower it either
    assert bypass.step(50, 0) == 55


def test_picker_bypass_max_is_a_picker_override_of_0_to_100() -> None:
    assert PickerPolicy().bypass_max == 90
    assert PickerPolicy().with_overrides(["bypass_max=0"]).bypass_max == 0
    off = Bypass(BypassPolicy(max_percent=0))
    assert [off.step(1000, 1000) for _ in range(3)] == [0, 0, 0]  # never above 0 (the picker still writes 0)
    with pytest.raises(ValueError, match="bypass_max"):
        PickerPolicy().with_overrides(["bypass_max=101"])


class _Writer:
    """What the publisher installs in `Wiring.runtime`: here, records the writes, and refuses on demand."""

    def __init__(self) -> None:
        self.writes: list[dict[str, int]] = []
        self.refuse = False

    async def __call__(self, values: Mapping[str, int]) -> bool:
        self.writes.append(dict(values))
        return not self.refuse


async def _service(tmp_path: Path, writer: _Writer, registry: CollectorRegistry) -> PickerService:
    topo, _ = load_topology(EXAMPLE)
    config = SidecarConfig(topology=EXAMPLE, xds_dir=tmp_path)
    runtime = EnvoyRuntime()
    runtime.writer = writer
    admin = EnvoyAdmin("http://127.0.0.1:9", timeout_s=0.1)  # not used: the writer stands for it
    loop = asyncio.get_running_loop()
    return PickerService(Wiring(config, topo, lambda: topo, admin, registry, loop.time, Servicers(),
                                runtime=runtime))


def test_the_picker_writes_0_first_then_the_share_when_it_moves_and_retries_a_refused_write(tmp_path: Path) -> None:
    async def run() -> None:
        writer, registry = _Writer(), CollectorRegistry()
        service = await _service(tmp_path, writer, registry)
        servicer = service.servicer
        # first tick: 0 is written whatever an earlier picker left in the Envoys' runtime
        assert await service.bypass_tick() == 0
        assert writer.writes == [{PICKER_BYPASS_RUNTIME_KEY: 0}]
        # nothing moved: nothing written
        servicer.seen += 500
        assert await service.bypass_tick() == 0
        assert len(writer.writes) == 1
        # half the requests of two intervals answered late, the Envoy refuses the write: not held, tried again
        for _ in range(2):
            servicer.seen += 1000
            servicer.late += 500
            writer.refuse = True
            assert await service.bypass_tick() == 0
        assert writer.writes[-1] == {PICKER_BYPASS_RUNTIME_KEY: 50}
        assert registry.get_sample_value("confgen_picker_bypass_percent") == 0
        writer.refuse = False
        servicer.seen += 500  # the next interval keeps up, but the share it wants is still the one not written
        assert await service.bypass_tick() == 45
        assert writer.writes[-1] == {PICKER_BYPASS_RUNTIME_KEY: 45}
        assert registry.get_sample_value("confgen_picker_bypass_percent") == 45

    asyncio.run(run())


def test_the_service_holds_the_share_while_a_pool_admits(tmp_path: Path) -> None:
    """The service asks whether any pool admits (here by the daemon's saturation verdict; the picker's own
    signals: `Picker.surging`, below) and holds the share then; with no pool known it rises as before."""
    async def run() -> None:
        writer = _Writer()
        service = await _service(tmp_path, writer, CollectorRegistry())
        servicer = service.servicer
        assert await service.bypass_tick() == 0
        service.store.update([PoolFacts("chat", ("m",), (EndpointFacts("10.0.0.1:8000", serving=True),),
                                        saturated=True)])
        for _ in range(3):
            servicer.seen += 1000
            servicer.late += 500
            assert await service.bypass_tick() == 0
        service.store.update([])
        servicer.seen += 1000
        servicer.late += 500
        assert await service.bypass_tick() == 50

    asyncio.run(run())


def _layer(publisher: AdsPublisher) -> dict[str, float]:
    resources = publisher.cache.resources(RTDS)
    assert len(resources) == 1, resources
    runtime = rtds_pb2.Runtime()
    assert next(iter(resources.values())).body.Unpack(runtime)
    return dict(json_format.MessageToDict(runtime.layer))


def test_ads_serves_the_limiters_values_and_the_pickers_in_one_runtime_layer() -> None:
    publisher = AdsPublisher(GrpcSettings(), clock=lambda: 0.0)
    assert publisher.set_runtime({"confgen.limit.chat": 8})
    assert publisher.set_runtime({PICKER_BYPASS_RUNTIME_KEY: 30}, part="outputs")
    assert _layer(publisher) == {"confgen.limit.chat": 8, PICKER_BYPASS_RUNTIME_KEY: 30}
    # the limiter's next cycle replaces its own part only
    assert publisher.set_runtime({"confgen.limit.chat": 6})
    assert _layer(publisher) == {"confgen.limit.chat": 6, PICKER_BYPASS_RUNTIME_KEY: 30}
    assert not publisher.set_runtime({"confgen.limit.chat": 6})  # unchanged: nothing new to serve


def test_a_pool_surges_when_offered_its_capacity_before_admission_opens() -> None:
    """What holds the share besides admission: requests arriving as fast as the pool serves them (the
    first instants of a surge, before admission opens). Idle endpoints, so no request waits and the gate
    stays shut; one request every 10 s is no surge, fifty at once are."""
    now = [0.0]
    store = Datastore()
    store.update([PoolFacts("chat", ("m",), tuple(
        EndpointFacts(f"10.0.0.{i}:8000", serving=True, capacity=8, token_latency_s=0.02) for i in (1, 2)))])
    picker = Picker(clock=lambda: now[0])
    prompt = parse_body(b'{"model": "m", "prompt": "hello", "max_tokens": 64}')

    def arrive() -> None:
        pick = picker.pick(PickRequest("chat", prompt, [], saturated=False), store.endpoints("chat"))
        assert pick.endpoints and pick.refused_for_s is None

    for _ in range(3):
        now[0] += 10.0
        arrive()
    assert not picker.admission.surging("chat") and not picker.admission.admitting("chat")
    for _ in range(50):
        arrive()
    assert picker.admission.surging("chat") and not picker.admission.admitting("chat")
    now[0] += 2.5  # no request since, for longer than pressure_s: nothing arriving is no surge
    assert not picker.admission.surging("chat")
