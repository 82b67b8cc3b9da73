"""The Docker Compose target: Envoy and the sidecar side by side, for one machine."""

from __future__ import annotations

from collections.abc import Mapping

from ..model import Topology
from . import Target


def _render(topo: Topology, config_dir: str, secrets: Mapping[str, str] | None) -> dict[str, bytes]:
    from ..deploy import render_compose

    return render_compose(topo)


# The Compose file references the keys (an env file); no key is read.
TARGET = Target(name="compose", render=_render, needs_keys=lambda _: False)
