"""The one place that knows Envoy's EDS format: endpoints -> ClusterLoadAssignment file.

`confgen render` writes the first version of each file from the topology; the sidecar
calls the same builder with the health and weights it measured.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ._proto import Json, dumps_compact, typed

HealthStatus = Literal["HEALTHY", "DEGRADED", "UNHEALTHY", "DRAINING"]

# Envoy's default: a priority (or, through an aggregate cluster, a pool) at 50 % health
# keeps 70 % of its traffic and spills the rest to the next one.
OVERPROVISIONING_FACTOR = 140
MAX_WEIGHT = 10_000  # the sidecar publishes up to this; Envoy allows far more per endpoint


@dataclass(frozen=True, order=True)
class Endpoint:
    """One worker as Envoy should see it. `address` must be an IP literal."""

    address: str
    port: int
    weight: int = 1
    health: HealthStatus = "HEALTHY"
    zone: str | None = None
    worker: str = ""  # the worker as written in the topology (host:port), for humans
    labels: tuple[tuple[str, str], ...] = ()  # the topology's labels, as endpoint metadata

    def __post_init__(self) -> None:
        if not 1 <= self.weight <= MAX_WEIGHT:
            # Envoy rejects a whole EDS file for one weight of 0.
            raise ValueError(f"weight {self.weight} outside 1..{MAX_WEIGHT}")


def clamp_weight(value: float, max_weight: int = MAX_WEIGHT) -> int:
    """`value` rounded into [1, max_weight]: Envoy rejects a weight of 0."""
    return int(min(max(round(value), 1), max_weight))


def static_weight(capacity: int, share: int = 1, max_weight: int = MAX_WEIGHT) -> int:
    """The weight of an endpoint whose load is unknown: capacity x the worker's static share.

    capacity is the worker's max concurrent sequences, share its topology `weight`. The
    first render publishes this, and the sidecar publishes the same for an endpoint with
    no load sample (its load-based weights are scaled by the same share), so the
    sidecar's first cycle after a render leaves an idle fleet's weights as they are.
    """
    return clamp_weight(capacity * share, max_weight)


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
