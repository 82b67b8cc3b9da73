"""The Envoy target: file-based xDS (or an ADS bootstrap), checked by `envoy --mode validate`."""

from __future__ import annotations

from collections.abc import Mapping

from .._rejection import Refusal
from ..envoy import layout
from ..model import Topology
from . import Target


def _render(topo: Topology, config_dir: str, secrets: Mapping[str, str] | None) -> dict[str, bytes]:
    from .. import envoy

    return envoy.render(topo, config_dir=config_dir, secrets=secrets)


def _verify(topo: Topology, all_endpoints: bool) -> list[Refusal]:
    from ..proxycheck import verify_envoy

    return verify_envoy(topo, all_endpoints=all_endpoints)


TARGET = Target(
    name="envoy",
    render=_render,
    verify=_verify,
    verify_help="also run the real Envoy on the rendered output "
    "(every listener, route and cluster, and the first 8 endpoints of each pool)",
    write_rank=layout.write_rank,
    config_dir=lambda topo: topo.envoy.config_dir,
    # An ADS bootstrap holds no key: the control plane resolves and serves them.
    needs_keys=lambda topo: topo.auth is not None and topo.envoy.xds.mode != "ads",
)
