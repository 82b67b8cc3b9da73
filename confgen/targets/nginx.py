"""The nginx target (open-source nginx + njs), checked by `nginx -t`."""

from __future__ import annotations

from collections.abc import Mapping

from .._rejection import Refusal
from ..model import Topology
from . import Finding, Target


def _render(topo: Topology, config_dir: str, secrets: Mapping[str, str] | None) -> dict[str, bytes]:
    from .. import nginx

    files: dict[str, bytes] = nginx.render(topo, config_dir=config_dir, secrets=secrets)
    return files


def _warnings(topo: Topology) -> list[Finding]:
    from .. import nginx

    found: list[Finding] = nginx.unsupported(topo)
    return found


def _refusals(topo: Topology) -> list[Finding]:
    from .. import nginx

    found: list[Finding] = nginx.refused(topo)
    return found


def _verify(topo: Topology, all_endpoints: bool) -> list[Refusal]:
    from ..proxycheck import verify_nginx

    return verify_nginx(topo)


TARGET = Target(
    name="nginx",
    render=_render,
    warnings=_warnings,
    refusals=_refusals,
    verify=_verify,
    verify_help="also run the real nginx -t on the rendered output",
    config_dir=lambda topo: topo.nginx.config_dir,
)
