"""The Kubernetes target: manifests for the proxy pods (Envoy + sidecar) and the topology ConfigMap."""

from __future__ import annotations

from collections.abc import Mapping

from ..model import Topology
from . import Target


def _render(topo: Topology, config_dir: str, secrets: Mapping[str, str] | None) -> dict[str, bytes]:
    from ..deploy import render_kubernetes

    return render_kubernetes(topo)


# The manifests reference the keys (a Secret); no key is read.
TARGET = Target(name="kubernetes", render=_render, needs_keys=lambda _: False)
