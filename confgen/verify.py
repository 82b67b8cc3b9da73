"""Ask the real proxies whether they accept what we render.

Envoy: `envoy --mode validate` reads only the bootstrap, not file-based xDS, so the
rendered files are inlined into one static bootstrap first (see envoy.static_bootstrap).
Nginx: `nginx -t` under a throw-away prefix, with listen ports moved to free loopback
ports so the check binds nothing the user runs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from . import runtime
from .model import Topology


class ProxyUnavailableError(Exception):
    """The proxy binary needed for the check is not installed."""


# Endpoints per pool that Envoy parses in `validate --envoy` (see envoy.static_bootstrap).
SAMPLED_ENDPOINTS = 8


def verify(topo: Topology, target: str, *, all_endpoints: bool = False) -> list[str]:
    """Problems the real proxy reports for `topo` rendered for `target` ([] when accepted)."""
    try:
        if target == "envoy":
            return verify_envoy(topo, all_endpoints=all_endpoints)
        if target == "nginx":
            return verify_nginx(topo)
    except runtime.BinaryNotFoundError as exc:
        raise ProxyUnavailableError(str(exc)) from exc
    raise ValueError(f"unknown target {target!r}")


def verify_envoy(topo: Topology, *, all_endpoints: bool = False) -> list[str]:
    from . import envoy

    limit = None if all_endpoints else SAMPLED_ENDPOINTS
    if topo.envoy.xds.mode == "ads":
        # The bootstrap Envoy starts with, then what the control plane would send it.
        problems = runtime.validate_envoy_static(envoy.ads.bootstrap(topo))
        return problems or runtime.validate_envoy_static(envoy.ads_static_bootstrap(topo, max_endpoints=limit))
    files = envoy.render(topo, config_dir="/nonexistent/confgen-validate")
    boot = envoy.static_bootstrap(files, max_endpoints=limit)
    return runtime.validate_envoy_static(boot)


def verify_nginx(topo: Topology) -> list[str]:
    from . import nginx  # type: ignore[attr-defined,unused-ignore]

    with tempfile.TemporaryDirectory(prefix="confgen-nginx-") as tmp:
        prefix = Path(tmp)
        files: dict[str, bytes] = nginx.render_for_test(topo, prefix=str(prefix))
        for rel, data in files.items():
            target = prefix / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        problems: list[str] = runtime.nginx_test((prefix / "nginx.conf").read_text(), prefix)
        return problems
