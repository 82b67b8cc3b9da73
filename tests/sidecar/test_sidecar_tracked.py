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
