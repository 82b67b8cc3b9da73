"""Ask the real proxies whether they accept what we render.

Envoy: `envoy --mode validate` reads only the bootstrap, not file-based xDS, so the
rendered files are inlined into one static bootstrap first (see envoy.static_bootstrap).
Nginx: `nginx -t` under a throw-away prefix, with listen ports moved to free loopback
ports so the check binds nothing the user runs. The checks live in `confgen.proxycheck`
(the targets call them from there); this module picks the target's own.

A check that ran returns its findings ([] when accepted); a check that could not run
(binary missing, hung) raises `confgen.errors.VerifyError`.
"""

from __future__ import annotations

from . import targets
from .model import Topology
from .proxycheck import SAMPLED_ENDPOINTS, Refusal, VerifyError, loopback_ports, verify_envoy, verify_nginx

__all__ = ["SAMPLED_ENDPOINTS", "Refusal", "VerifyError", "loopback_ports", "verify", "verify_envoy", "verify_nginx"]


def verify(topo: Topology, target: str, *, all_endpoints: bool = False) -> list[Refusal]:
    """What the real proxy refuses in `topo` rendered for `target` ([] when accepted), each
    said in the topology's terms (confgen._rejection)."""
    check = targets.get(target).verify
    if check is None:
        raise VerifyError(f"target {target!r} has no real-proxy check")
    return check(topo, all_endpoints)
