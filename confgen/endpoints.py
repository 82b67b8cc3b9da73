"""A decided endpoint and its weight range, whatever proxy it is published to.

`confgen render` builds the first endpoints of each pool from the topology; the sidecar
decides them every cycle (health and weight) and hands them to its publishers (Envoy's EDS
files or ADS, nginx's upstream files). Each renderer turns an `Endpoint` into its own
format (`confgen.envoy.eds`, `confgen.nginx.upstream`); nothing here is a proxy's format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["MAX_WEIGHT", "Endpoint", "HealthStatus", "clamp_weight", "static_weight"]

# The health an endpoint is published with (Envoy's names; nginx's publisher maps them).
HealthStatus = Literal["HEALTHY", "DEGRADED", "UNHEALTHY", "DRAINING"]

MAX_WEIGHT = 10_000  # the sidecar publishes up to this; Envoy allows far more per endpoint


@dataclass(frozen=True, order=True)
class Endpoint:
    """One worker as the proxy should see it. `address` must be an IP literal."""

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
