"""gRPC services beside the publisher: the interface each one implements, and their table.

    picker     (sidecar.outputs.picker)   Envoy ext_proc endpoint picker, for pools with policy prefix_affinity

A service is wanted when the topology asks for it (`wanted`); `sidecar.main` builds the
wanted ones, puts them all on one gRPC server (`sidecar.outputs.grpc`, at --grpc-listen),
and hands each the fleet view after every probe cycle (`update`). Adding a service: a
module with a `build(ServiceWiring) -> Service` and a `wanted(Topology) -> bool`, plus its
line in `SERVICES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from confgen.model import Topology

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from sidecar.config import SidecarConfig
    from sidecar.daemon import Snapshot
    from sidecar.outputs.grpc import GrpcServer

__all__ = ["SERVICES", "Service", "ServiceWiring", "build", "wanted"]


class Service(Protocol):
    name: str

    def register(self, server: GrpcServer) -> None:
        """Add its servicers to the server (before it starts)."""

    def update(self, view: Snapshot, topo: Topology) -> None:
        """The fleet view after a probe cycle, and the topology it was built from."""

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ServiceWiring:
    config: SidecarConfig
    topo: Topology
    registry: CollectorRegistry
    clock: Callable[[], float]


SERVICES: dict[str, str] = {  # name -> module with build(ServiceWiring) -> Service and wanted(Topology) -> bool
    "picker": "sidecar.outputs.picker",
}


def wanted(topo: Topology) -> list[str]:
    """The services this topology asks for."""
    return [name for name, module in SERVICES.items() if importlib.import_module(module).wanted(topo)]


def build(name: str, wiring: ServiceWiring) -> Service:
    factory: Callable[[ServiceWiring], Service] = importlib.import_module(SERVICES[name]).build
    return factory(wiring)
