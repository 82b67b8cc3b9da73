"""The gateway-api target: InferencePools (Gateway API Inference Extension v1) whose endpoint picker is
confgen-sidecar, their HTTPRoute, and the picker's Deployment and Service."""

from __future__ import annotations

from collections.abc import Mapping

from ..model import Topology
from . import Finding, Target


def _render(topo: Topology, config_dir: str, secrets: Mapping[str, str] | None) -> dict[str, bytes]:
    from ..deploy.gateway_api import render_gateway_api

    return render_gateway_api(topo)


def _refusals(topo: Topology) -> list[Finding]:
    from ..deploy.gateway_api import gateway_problems

    return gateway_problems(topo)


def _warnings(topo: Topology) -> list[Finding]:
    from .._pod_fit import unpublished_image
    from ..deploy.gateway_api import gateway_pools

    inside = {i for i, _ in gateway_pools(topo)}
    left_out = [(f"pools[{i}].balancing.policy", "not in the gateway's route: only pools on the endpoint picker "
                 "(prefix_affinity, or auto with pod_labels) become InferencePools (confgen's picker picks for those)")
                for i in range(len(topo.pools)) if i not in inside]
    return [*unpublished_image(topo), *left_out]


# The manifests reference the keys (a Secret); no key is read.
TARGET = Target(name="gateway-api", render=_render, warnings=_warnings, refusals=_refusals,
                needs_keys=lambda _: False)
