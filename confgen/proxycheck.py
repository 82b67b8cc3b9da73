"""The real proxies' checks of what we render (`confgen.verify.verify` picks one by target).

Envoy: `envoy --mode validate` reads only the bootstrap, not file-based xDS, so the
rendered files are inlined into one static bootstrap first (see envoy.static_bootstrap).
Nginx: `nginx -t` under a throw-away prefix, with listen ports moved to free loopback
ports so the check binds nothing the user runs.

A check that ran returns its findings ([] when accepted); a check that could not run
(binary missing, hung) raises `confgen.errors.VerifyError`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from . import binaries
from ._rejection import Refusal, explain_envoy, explain_nginx
from .errors import BinaryNotFoundError, VerifyError
from .model import Topology

__all__ = ["SAMPLED_ENDPOINTS", "Refusal", "VerifyError", "loopback_ports", "verify_envoy", "verify_nginx"]

# Endpoints per pool that Envoy parses in `validate --envoy` (see envoy.static_bootstrap).
SAMPLED_ENDPOINTS = 8


def verify_envoy(topo: Topology, *, all_endpoints: bool = False) -> list[Refusal]:
    """What `envoy --mode validate` refuses in `topo`'s Envoy output ([] when accepted)."""
    from . import envoy

    limit = None if all_endpoints else SAMPLED_ENDPOINTS
    if topo.envoy.xds.mode == "ads":
        # The bootstrap Envoy starts with, then what the control plane would send it.
        problems = _validate_envoy(envoy.ads_bootstrap(topo, envoy.VALIDATE_DIR), topo)
        return problems or _validate_envoy(envoy.ads_static_bootstrap(topo, max_endpoints=limit), topo)
    files = envoy.render(topo, config_dir=envoy.VALIDATE_DIR)
    if untyped := envoy.file_type_problems(files):  # what validate mode cannot see in the files
        return [Refusal("", problem) for problem in untyped]
    return _validate_envoy(envoy.static_bootstrap(files, max_endpoints=limit), topo)


def _validate_envoy(boot: dict[str, Any], topo: Topology) -> list[Refusal]:
    try:
        records = binaries.validate_envoy_static(boot)
    except BinaryNotFoundError as exc:
        raise VerifyError(str(exc)) from exc
    return [explain_envoy(record, boot, topo) for record in records]


def loopback_ports(topo: Topology) -> dict[str, int]:
    """A loopback port that was free a moment ago for every nginx listener and the status server."""
    from . import nginx

    return {name: binaries.free_port() for name in [*(lst.name for lst in topo.listeners), nginx.STATUS]}


def verify_nginx(topo: Topology) -> list[Refusal]:
    """What `nginx -t` refuses in `topo`'s nginx output ([] when accepted)."""
    from . import nginx

    with tempfile.TemporaryDirectory(prefix="confgen-nginx-") as tmp:
        prefix = Path(tmp)
        files = nginx.render_for_test(topo, prefix=str(prefix), ports=loopback_ports(topo))
        for rel, data in files.items():
            target = prefix / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        try:
            lines = binaries.nginx_test((prefix / "nginx.conf").read_text(), prefix)
        except BinaryNotFoundError as exc:
            raise VerifyError(str(exc)) from exc
        return [explain_nginx(line, files, str(prefix), topo) for line in lines]
