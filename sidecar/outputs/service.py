"""The Service interface: a gRPC service the sidecar serves beside its publisher.

Every service registers on the sidecar's one gRPC server (`sidecar.outputs.grpc`), reads
the daemon's current topology (and, for those that need it, the fleet view), and has a
start/close lifecycle around the server's. `SERVICES` maps a name to the module function
that builds it; `build_all` builds those a topology needs.

Adding a service: a module with `build(wiring) -> Service | None` (None: this topology
does not need it) and its line in SERVICES.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from prometheus_client.registry import CollectorRegistry

from confgen.model import Topology

__all__ = ["SERVICES", "Service", "ServiceWiring", "build_all"]


@dataclass(frozen=True, slots=True)
class ServiceWiring:
    """What `sidecar.main` hands a service's `build`."""

    topology: Callable[[], Topology]  # the daemon's current topology (changes on reload)
    registry: CollectorRegistry  # for the service's own metrics
    clock: Callable[[], float]  # monotonic seconds (the event loop's)


class Service(Protocol):
    name: str

    def register(self, server: grpc.aio.Server) -> None:
        """Add the servicer(s) to the server (one line per servicer)."""

    async def start(self) -> None:
        """Open what the service needs (clients, connections); it must not fail on a store that is down."""

    async def close(self) -> None:
        """Release it; the server has stopped."""


SERVICES: dict[str, str] = {  # name -> "module:function" taking a ServiceWiring, returning Service | None
    "ratelimit": "sidecar.outputs.ratelimit:build",
}


def build_all(wiring: ServiceWiring) -> list[Service]:
    """The services the current topology needs, in SERVICES order."""
    out: list[Service] = []
    for target in SERVICES.values():
        module, _, func = target.partition(":")
        builder = getattr(importlib.import_module(module), func)
        service = builder(wiring)
        if service is not None:
            out.append(service)
    return out
