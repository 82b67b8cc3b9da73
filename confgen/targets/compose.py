"""The Docker Compose target: Envoy and the sidecar side by side, for one machine."""

from __future__ import annotations

from collections.abc import Mapping

from ..model import Topology
from . import Finding, Target


def _render(topo: Topology, config_dir: str, secrets: Mapping[str, str] | None) -> dict[str, bytes]:
    from ..deploy import render_compose

    return render_compose(topo)


def _refusals(topo: Topology) -> list[Finding]:
    """The Compose file runs one Envoy beside its sidecar, which writes the xDS files that Envoy reads."""
    if topo.envoy.xds.mode == "ads":
        return [("envoy.xds.mode", "the compose target runs one Envoy beside its sidecar on the xDS files: use "
                 "mode files (ADS serves many Envoys from a control plane: the kubernetes target renders that)")]
    return []


# The Compose file references the keys (an env file); no key is read.
TARGET = Target(name="compose", render=_render, refusals=_refusals, needs_keys=lambda _: False)
