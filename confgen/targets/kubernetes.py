"""The Kubernetes target: manifests for the proxy pods (Envoy + sidecar) and the topology ConfigMap."""

from __future__ import annotations

from collections.abc import Mapping

from ..model import Topology
from . import Finding, Target


def _render(topo: Topology, config_dir: str, secrets: Mapping[str, str] | None) -> dict[str, bytes]:
    from ..deploy import render_kubernetes

    return render_kubernetes(topo)


def _refusals(topo: Topology) -> list[Finding]:
    from .._pod_fit import loopback_store

    # with kubernetes.redis the render names the store itself (DeployError: write the rendered Service)
    return [] if topo.kubernetes.redis else loopback_store(topo)


def _warnings(topo: Topology) -> list[Finding]:
    from .._pod_fit import unpublished_image

    return unpublished_image(topo)


# The manifests reference the keys (a Secret); no key is read.
TARGET = Target(name="kubernetes", render=_render, warnings=_warnings, refusals=_refusals,
                needs_keys=lambda _: False)
