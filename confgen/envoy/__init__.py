"""Envoy target: a pure function from the topology to file-based xDS files.

    render(topo, config_dir=..., secrets=...) -> {relative path: bytes}

`config_dir` is where the files will live when Envoy reads them (file xDS paths are
absolute). `static_bootstrap` inlines everything into one static config, which is what
`envoy --mode validate` can actually check (it does not read file-based xDS).

With `envoy.xds.mode: ads` the output is the bootstrap alone (see `ads`): listeners,
clusters, endpoints and limits come from the control plane, which builds them with
`ads.resources` (`ads_static_bootstrap` inlines those for validation).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ..endpoints import Endpoint
from ..errors import DeployError
from ..model import MAX_SOCKET_PATH, Topology, admin_socket, admin_tcp
from ..plan import plan
from . import ads, layout
from ._clusters import assignments, breaker_runtime_keys, clusters
from ._listener import (
    PICKER_BYPASS_RUNTIME_KEY,
    PICKER_LATE_MODE,
    PICKER_MAX_HOLD_S,
    REQUEST_TIME_ATTRIBUTE,
    ROUTE_NAME_ATTRIBUTE,
    RouteClass,
    listeners,
    route_checks,
    route_classes,
    shed_runtime_key,
    shed_stat_prefix,
)
from ._proto import TYPE_PREFIX as _TYPE_PREFIX
from ._proto import Json, dumps
from .eds import build_cla, eds_document, parse_eds, render_eds

__all__ = [
    "PICKER_BYPASS_RUNTIME_KEY", "PICKER_LATE_MODE", "PICKER_MAX_HOLD_S", "REQUEST_TIME_ATTRIBUTE",
    "ROUTE_NAME_ATTRIBUTE",
    "VALIDATE_DIR", "Endpoint", "RouteClass", "admin", "ads", "ads_bootstrap",
    "ads_static_bootstrap", "breaker_runtime_keys", "build_cla", "eds_document", "layout", "parse_eds", "render",
    "render_eds", "route_checks", "route_classes", "shed_runtime_key", "shed_stat_prefix", "static_bootstrap",
]


# Where `validate --envoy` says the files live: Envoy's validate mode reads no file of theirs and binds no admin.
VALIDATE_DIR = "/nonexistent/confgen-validate"


def _placeholder_secrets(topo: Topology) -> dict[str, str]:
    keys = topo.auth.api_keys if topo.auth else []
    return {k.client: f"placeholder-key-{k.client}" for k in keys}


def admin(topo: Topology, config_dir: str) -> Json:
    """Envoy's admin: on its Unix socket, mode 0600 (admin.socket, else envoy-admin.sock in `config_dir`), or
    on TCP where the topology says so (admin.address, admin.port; `confgen render --admin-loopback`). Envoy's
    admin has no authentication and can stop Envoy, change runtime values and drain listeners, so by default
    only Envoy's own user (and the sidecar, run as that user) can connect. The socket is created with the
    process umask and then set to 0600: under the usual umask (022) nobody else can write to it, so connect
    to it, even in between (tests/envoy/test_envoy_admin_socket.py)."""
    path = admin_socket(topo, config_dir)
    if path is None:
        address, port = admin_tcp(topo)
        return {"address": {"socket_address": {"address": address, "port_value": port}}}
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise DeployError([("admin.socket", f"Envoy's admin socket {path!r} is longer than {MAX_SOCKET_PATH} bytes, "
                            "the most a Unix socket's path may hold: set admin.socket to a shorter path")])
    return {"address": {"pipe": {"path": path, "mode": 0o600}}}


def bootstrap(topo: Topology, config_dir: str) -> Json:
    def source(name: str) -> Json:
        return {
            "resource_api_version": "V3",
            # Watching the directory also catches a ConfigMap's atomic symlink swap.
            "path_config_source": {"path": f"{config_dir}/{name}", "watched_directory": {"path": config_dir}},
        }

    return {
        "node": {"id": topo.envoy.node_id or topo.name, "cluster": topo.name},
        "admin": admin(topo, config_dir),
        "dynamic_resources": {"lds_config": source(layout.LDS), "cds_config": source(layout.CDS)},
        "layered_runtime": {"layers": [
            {"name": "static", "static_layer": {"overload.global_downstream_max_connections": 50000}},
            {"name": "admin", "admin_layer": {}},
        ]},
    }


def render(topo: Topology, *, config_dir: str, secrets: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """Every file of the Envoy output, keyed by path relative to the output directory.

    `secrets` maps API-key clients to their keys; without it placeholders are written
    (fine for validation, useless for serving).
    """
    config_dir = config_dir.rstrip("/") or "/"
    if topo.envoy.xds.mode == "ads":
        return {layout.BOOTSTRAP: dumps(ads.bootstrap(topo, admin(topo, config_dir)))}
    keys = dict(secrets) if secrets is not None else _placeholder_secrets(topo)
    routing = plan(topo)
    files = {
        layout.BOOTSTRAP: dumps(bootstrap(topo, config_dir)),
        layout.LDS: dumps({"version_info": topo.name, "resources": listeners(topo, routing, keys)}),
        layout.CDS: dumps({"version_info": topo.name, "resources": clusters(topo, routing, config_dir)}),
    }
    for pool, cla in assignments(topo).items():
        files[layout.eds_path(pool)] = eds_document(cla)
    return files


def static_bootstrap(files: Mapping[str, bytes], *, max_endpoints: int | None = None) -> Json:
    """One static bootstrap holding what the rendered files hold, for `envoy --mode validate`.

    EDS clusters become STATIC ones carrying their assignment inline; that is how Envoy
    checks endpoint addresses, ports and weights too. `max_endpoints` keeps only the first
    endpoints of each pool: the rest come out of the same builder and differ only in values
    the topology's own checks already bound (IP literal, port, weight), while Envoy's parse
    of 10,000 endpoints costs a second.
    """
    boot: Json = json.loads(files[layout.BOOTSTRAP])
    lds = json.loads(files[layout.LDS])["resources"]
    cds = json.loads(files[layout.CDS])["resources"]
    eds = {pool: json.loads(files[layout.eds_path(pool)])["resources"][0]
           for pool in (c["eds_cluster_config"]["service_name"] for c in cds if c.get("type") == "EDS")}
    return _inline(boot, lds, cds, eds, max_endpoints)


_FILE_TYPES = {layout.LDS: "config.listener.v3.Listener", layout.CDS: "config.cluster.v3.Cluster"}


def file_type_problems(files: Mapping[str, bytes]) -> list[str]:
    """What Envoy would refuse in the xDS files but not in the inlined bootstrap: each file
    resource is a google.protobuf.Any and must name its type ("@type"). `envoy --mode
    validate` never reads these files, so this part of the check is ours."""
    problems = []
    for rel, type_name in _FILE_TYPES.items():
        for index, resource in enumerate(json.loads(files[rel])["resources"]):
            if resource.get("@type") != _TYPE_PREFIX + type_name:
                problems.append(f"{rel}: resources[{index}] ({resource.get('name', '?')}): "
                                f"'@type' must be {_TYPE_PREFIX + type_name}, got {resource.get('@type')!r}")
    return problems


def ads_bootstrap(topo: Topology, config_dir: str) -> Json:
    """The ADS bootstrap `render` writes, with its admin for files read from `config_dir`."""
    return ads.bootstrap(topo, admin(topo, config_dir.rstrip("/") or "/"))


def ads_static_bootstrap(topo: Topology, *, max_endpoints: int | None = None) -> Json:
    """The ADS bootstrap's node and admin with what the control plane would send inlined.

    The control plane serves `ads.resources` (placeholder keys here, like `render` without
    secrets); Envoy checks those the same way as file output.
    """
    served = ads.resources(topo, _placeholder_secrets(topo))
    boot = ads_bootstrap(topo, VALIDATE_DIR)
    boot.pop("static_resources", None)
    boot["layered_runtime"] = {"layers": [layer for layer in boot["layered_runtime"]["layers"]
                                          if "rtds_layer" not in layer]}
    return _inline(boot, ads.keys_inline(served), served.clusters, served.assignments, max_endpoints)


def _inline(boot: Json, lds_in: list[Json], cds_in: list[Json], eds: Mapping[str, Json],
            max_endpoints: int | None) -> Json:
    lds = [dict(r) for r in lds_in]
    cds = [dict(r) for r in cds_in]
    for cluster in cds:
        if cluster.get("type") == "EDS":
            service = cluster.pop("eds_cluster_config")["service_name"]
            assignment = dict(eds[service])
            assignment.pop("@type", None)
            if max_endpoints is not None:
                assignment["endpoints"] = _first_endpoints(assignment.get("endpoints", []), max_endpoints)
            cluster["type"] = "STATIC"
            cluster["load_assignment"] = assignment
    for resource in lds + cds:
        resource.pop("@type", None)
    boot.pop("dynamic_resources", None)
    boot["static_resources"] = {"listeners": lds, "clusters": cds}
    return boot



def _first_endpoints(groups: list[Json], limit: int) -> list[Json]:
    kept: list[Json] = []
    for group in groups:
        if limit <= 0:
            break
        members = group.get("lb_endpoints", [])[:limit]
        limit -= len(members)
        kept.append({**group, "lb_endpoints": members})
    return kept
