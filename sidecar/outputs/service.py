"""What the sidecar needs of a service: an output that answers requests beside the publisher.

A publisher pushes the daemon's decisions to the proxy; a service is asked by the proxy
(per request) and answers from the newest fleet view: the endpoint picker (Envoy ext_proc,
the Endpoint Picker Protocol) and the rate limit service (Envoy's RLS on a shared store).
Services that speak gRPC register their servicers on the sidecar's one gRPC server
(`sidecar.outputs.grpc`), so they share its bind, its TLS and its limits.

`sidecar.main` builds the services the topology needs from
`sidecar.outputs.registry.SERVICES` (name -> the module's `build(ServiceWiring) -> Service`,
imported on use), lists each one's `problems` and `refused` among the daemon's (`Daemon.add_service`)
and hands each the fleet view after every daemon cycle. This module imports
no implementation. Adding a service: a package under `sidecar/outputs/` with a class
satisfying `Service` and a `build` function, plus its line in `SERVICES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from confgen.model import Topology

if TYPE_CHECKING:
    import grpc
    from prometheus_client.registry import CollectorRegistry

    from sidecar.config import SidecarConfig
    from sidecar.fleet import Snapshot

__all__ = ["Service", "ServiceWiring"]


class Service(Protocol):
    """Answers the proxy's per-request questions from the newest fleet view.

    Every method runs on the daemon's event loop; a service never blocks it (no blocking
    I/O, bounded work per request) and never lets one caller's bad input end it.
    """

    name: str

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register its gRPC servicers on the sidecar's gRPC server (before it starts)."""
        ...

    async def start(self) -> None:
        """Open what it needs beyond the gRPC server (stores, sessions); OSError when it cannot."""
        ...

    def update(self, fleet: Snapshot) -> None:
        """The newest fleet view (after every daemon cycle and reload); cheap, never blocks."""
        ...

    def problems(self) -> list[str]:
        """Why it cannot answer as configured ([] when it can), read on every view: listed,
        prefixed with `name`, in the daemon's problems (/readyz's body, /state, the status page,
        confgen_sidecar_problems), never a readiness failure."""
        ...

    def refused(self) -> Mapping[tuple[str, str], int]:
        """Requests it answered 429 for overload so far, by (pool, class) (the picker's admission;
        {} for a service that sheds nothing): counted, as reason `name`, in the one
        confgen_sidecar_shed_requests_total beside the limiter's."""
        ...

    async def close(self) -> None:
        """Stop answering; let calls in progress finish within their deadlines."""
        ...


@dataclass(frozen=True, slots=True)
class ServiceWiring:
    """What `sidecar.main` hands a service's `build`."""

    config: SidecarConfig
    topology: Callable[[], Topology]  # the daemon's current one (it changes on reload)
    registry: CollectorRegistry  # for the service's own metrics
    clock: Callable[[], float]  # the event loop's
