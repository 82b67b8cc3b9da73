"""The one place that knows Envoy's EDS format: endpoints -> ClusterLoadAssignment file.

`confgen render` writes the first version of each file from the topology; the sidecar
calls the same builder with the health and weights it measured.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from ..endpoints import MAX_WEIGHT, Endpoint, HealthStatus, clamp_weight, static_weight
from ._proto import Json, dumps_compact, typed

# The endpoint and its weight range are the decided endpoint's, not EDS's (confgen.endpoints);
# re-exported here for the callers that name them through this module.
__all__ = ["MAX_WEIGHT", "OVERPROVISIONING_FACTOR", "Endpoint", "HealthStatus", "build_cla", "clamp_weight",
           "eds_document", "parse_eds", "render_eds", "static_weight"]

# Envoy's default: a priority (or, through an aggregate cluster, a pool) at 50 % health
# keeps 70 % of its traffic and spills the rest to the next one.
OVERPROVISIONING_FACTOR = 140


def build_cla(cluster: str, endpoints: Iterable[Endpoint]) -> Json:
    """A ClusterLoadAssignment grouping endpoints by zone (locality), in a stable order."""
    by_zone: dict[str, list[Endpoint]] = {}
    for ep in sorted(endpoints, key=lambda e: (e.zone or "", e.address, e.port)):
        by_zone.setdefault(ep.zone or "", []).append(ep)
    groups: list[Json] = []
    for zone, members in sorted(by_zone.items()):
        group: Json = {"lb_endpoints": [_lb_endpoint(ep) for ep in members]}
        if zone:
            group["locality"] = {"zone": zone}
        groups.append(group)
    return typed("config.endpoint.v3.ClusterLoadAssignment", {
        "cluster_name": cluster,
        "endpoints": groups,
        "policy": {"overprovisioning_factor": OVERPROVISIONING_FACTOR},
    })


def _lb_endpoint(ep: Endpoint) -> Json:
    body: Json = {
        "endpoint": {"address": {"socket_address": {"address": ep.address, "port_value": ep.port}}},
        "health_status": ep.health,
        "load_balancing_weight": ep.weight,
    }
    meta: dict[str, str] = dict(ep.labels)
    if ep.worker:
        meta["worker"] = ep.worker
    if meta:
        body["metadata"] = {"filter_metadata": {"confgen": meta}}
    return body


def eds_document(cla: Json) -> bytes:
    """The file content for one CLA (compact JSON: machine-written, often large, rewritten
    often); version_info is a hash of the assignment itself, so equal content, equal version."""
    version = hashlib.sha256(dumps_compact(cla)).hexdigest()[:16]
    return dumps_compact({"version_info": version, "resources": [cla]})


def render_eds(cluster: str, endpoints: Iterable[Endpoint]) -> bytes:
    return eds_document(build_cla(cluster, endpoints))


def parse_eds(data: bytes) -> tuple[str, list[Endpoint]]:
    """The inverse of `render_eds`: (cluster, endpoints) of a file confgen wrote.

    ValueError when the file is not in that form; a file that re-renders to other bytes
    (written by hand or by another tool) is refused too, so nothing is guessed.
    """
    try:
        cla = json.loads(data)["resources"][0]
        cluster = str(cla["cluster_name"])
        endpoints: list[Endpoint] = []
        for group in cla.get("endpoints", []):
            zone = group.get("locality", {}).get("zone")
            for lb in group.get("lb_endpoints", []):
                sock = lb["endpoint"]["address"]["socket_address"]
                meta = dict(lb.get("metadata", {}).get("filter_metadata", {}).get("confgen", {}))
                worker = str(meta.pop("worker", ""))
                endpoints.append(
                    Endpoint(
                        address=str(sock["address"]),
                        port=int(sock["port_value"]),
                        weight=int(lb.get("load_balancing_weight", 1)),
                        health=lb.get("health_status", "HEALTHY"),
                        zone=zone,
                        worker=worker,
                        labels=tuple(sorted((str(k), str(v)) for k, v in meta.items())),
                    )
                )
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ValueError(f"not an EDS file confgen wrote: {exc!r}") from exc
    if render_eds(cluster, endpoints) != data:
        raise ValueError("the file is not in the form confgen writes")
    return cluster, endpoints
