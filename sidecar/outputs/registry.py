"""Every output of the sidecar by name, in one shape: name -> "module:function" (imported on use).

    PUBLISHERS   SidecarConfig.publisher selects one; its build takes a `publisher.Wiring`
                 and returns a `publisher.Built` (the publisher and its limiter)
    SERVICES     the topology selects them (`wanted`); each build takes a
                 `service.ServiceWiring` and returns a `service.Service`

The interface modules (`sidecar.outputs.publisher`, `sidecar.outputs.service`) hold the
protocols the implementations import; the registry lives here so no implementation's import
of its interface closes a loop back through the registry. Adding an output: its module and
one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from confgen.balancing import picker_wanted
from confgen.limits import needs_store
from confgen.model import Topology

if TYPE_CHECKING:
    from sidecar.outputs.publisher import Built, Wiring
    from sidecar.outputs.service import Service, ServiceWiring

__all__ = ["PUBLISHERS", "SERVICES", "build_publisher", "build_service", "wanted"]

PUBLISHERS: dict[str, str] = {  # name -> "module:function" taking a Wiring, returning Built
    "envoy": "sidecar.outputs.files.publisher:build",
    "nginx": "sidecar.outputs.nginx.publisher:build",
    "ads": "sidecar.outputs.xds.publisher:build",
}

SERVICES: dict[str, str] = {  # name -> "module:function" taking a ServiceWiring, returning a Service
    "picker": "sidecar.outputs.picker:build",  # Envoy ext_proc endpoint picker (policy prefix_affinity)
    "ratelimit": "sidecar.outputs.ratelimit:build",  # Envoy's rate limit service (scope: global limits)
}


def _factory(spec: str) -> Callable[..., object]:
    module, _, function = spec.partition(":")
    factory: Callable[..., object] = getattr(importlib.import_module(module), function)
    return factory


def build_publisher(name: str, wiring: Wiring) -> Built:
    """The publisher called `name` (a key of PUBLISHERS) and its limiter, built for `wiring`."""
    built: Built = _factory(PUBLISHERS[name])(wiring)  # type: ignore[assignment]
    return built


def wanted(topo: Topology) -> list[str]:
    """The services `topo` needs, in start order (`sidecar.main` starts these and no others)."""
    out = []
    if picker_wanted(topo):
        out.append("picker")
    if needs_store(topo):
        out.append("ratelimit")
    return out


def build_service(name: str, wiring: ServiceWiring) -> Service:
    """The service called `name` (a key of SERVICES), built for `wiring`."""
    service: Service = _factory(SERVICES[name])(wiring)  # type: ignore[assignment]
    return service
