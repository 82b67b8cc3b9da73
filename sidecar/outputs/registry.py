"""Every output of the sidecar by name, in one table: name -> "module:function" (imported on use).

Each function takes the one `sidecar.outputs.contract.Wiring` and returns a
`sidecar.outputs.contract.Built`. Which run: the publisher the flags select
(`SidecarConfig.publisher`: "envoy", "nginx" or "ads"; its build makes its limiter too), then
the outputs the topology needs (`wanted`), started in that order by `sidecar.main`. The
contract lives in `sidecar.outputs.contract`, which the implementations import; the registry
lives here so no implementation's import of its interface closes a loop back through the
registry. Adding an output: its module and one line here (and, when the topology selects it,
its test in `wanted`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from confgen.balancing import picker_wanted
from confgen.limits import needs_store
from confgen.model import Topology

if TYPE_CHECKING:
    from sidecar.outputs.contract import Built, Wiring

__all__ = ["OUTPUTS", "build", "wanted"]

OUTPUTS: dict[str, str] = {  # name -> "module:function" taking a Wiring, returning Built
    "envoy": "sidecar.outputs.files.publisher:build",  # EDS files and the tree; limits via Envoy's admin
    "nginx": "sidecar.outputs.nginx.publisher:build",  # upstream files, nginx -t, reload
    "ads": "sidecar.outputs.xds.publisher:build",  # ADS over gRPC (--serve-xds); limits over RTDS
    "picker": "sidecar.outputs.picker:build",  # Envoy ext_proc endpoint picker (policy prefix_affinity)
    "ratelimit": "sidecar.outputs.ratelimit:build",  # Envoy's rate limit service (scope: global limits)
}


def wanted(topo: Topology) -> list[str]:
    """The outputs `topo` needs besides the publisher, in start order (the services answering the
    proxy per request; `sidecar.main` starts these and no others)."""
    out = []
    if picker_wanted(topo):
        out.append("picker")
    if needs_store(topo):
        out.append("ratelimit")
    return out


def build(name: str, wiring: Wiring) -> Built:
    """The output(s) called `name` (a key of OUTPUTS), built for `wiring`."""
    module, _, function = OUTPUTS[name].partition(":")
    factory: Callable[[Wiring], Built] = getattr(importlib.import_module(module), function)
    return factory(wiring)
