"""The tracker's adoption of what a previous run published (sidecar.daemon.tracked)."""

from __future__ import annotations

import asyncio
from typing import Any

from confgen import parse_topology
from confgen.endpoints import Endpoint
from sidecar.config import from_argv
from sidecar.daemon.tracked import EndpointKey, Tracker
from sidecar.decide.state import Status
from sidecar.observe.resolve import Resolver

TOPOLOGY = b"""
version: 1
name: t
listeners: [{name: public, port: 8080}]
pools: [{name: chat, engine: vllm, models: [m], workers: ["127.0.0.1:8000", "127.0.0.1:8001"]}]
"""


def test_a_published_health_no_publisher_writes_is_not_adopted_and_ends_nothing() -> None:
    """Found by review: an EDS file on disk whose health_status was not one of Envoy's names ("Healthy ")
    raised out of the first cycle (EndpointState.adopt: unknown published status), ending the process. Such
    an endpoint starts afresh; a known one is adopted as before."""
    topo, _ = parse_topology(TOPOLOGY)
    tracker = Tracker(from_argv(["--topology", "topo.yaml"]))
    odd = EndpointKey("chat", "127.0.0.1:8000", "127.0.0.1", 8000)
    known = EndpointKey("chat", "127.0.0.1:8001", "127.0.0.1", 8001)
    bad: Any = "Healthy "
    tracker.adopted[odd] = Endpoint("127.0.0.1", 8000, weight=5, health=bad)
    tracker.adopted[known] = Endpoint("127.0.0.1", 8001, weight=3, health="UNHEALTHY")

    async def no_dns(*_: Any, **__: Any) -> Any:
        raise AssertionError("IP workers need no lookup")

    asyncio.run(tracker.sync(list(topo.pools), Resolver(1.0, no_dns), lambda: 100.0))
    assert tracker.tracked[odd].state.reason.startswith("new:")  # as never probed: out until a first ok probe
    assert tracker.tracked[known].state.status is Status.UNHEALTHY
    assert tracker.tracked[known].state.reason == "adopted UNHEALTHY"


def test_a_drain_goes_with_its_worker() -> None:
    """Found by review: a worker drained through the API, then dropped from the topology, could not be
    undrained (unknown worker) and came back drained when the topology named it again. A reload that drops
    it drops its drain (as a restart does); an undrain of a drain still held succeeds."""
    from sidecar.daemon.drains import Drains

    topo, _ = parse_topology(TOPOLOGY)
    fewer, _ = parse_topology(TOPOLOGY.replace(b', "127.0.0.1:8001"', b""))
    drains = Drains(from_argv(["--topology", "topo.yaml"]))
    assert drains.set(topo, "chat", "127.0.0.1:8001", True)
    assert drains.set(topo, "chat", "127.0.0.1:8000", True)
    assert drains.set(fewer, "chat", "127.0.0.1:8001", False)  # held, though the topology no longer names it
    assert not drains.set(fewer, "chat", "127.0.0.1:8001", False)  # nothing held any more: unknown
    drains.apply(fewer, [], 0.0)  # 8000 still named: kept
    assert drains.set(topo, "chat", "127.0.0.1:8000", False)
    assert drains.set(topo, "chat", "127.0.0.1:8001", True)
    drains.apply(fewer, [], 0.0)  # 8001 dropped by the reload: its drain with it
    tracker = Tracker(from_argv(["--topology", "topo.yaml"]))

    async def no_dns(*_: Any, **__: Any) -> Any:
        raise AssertionError("IP workers need no lookup")

    asyncio.run(tracker.sync(list(topo.pools), Resolver(1.0, no_dns), lambda: 100.0))
    drains.apply(topo, tracker.members("chat"), 100.0)  # named again: not drained
    assert not any(t.state.drained for _, t in tracker.members("chat"))
