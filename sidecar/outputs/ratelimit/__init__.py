"""Envoy's rate limit service on Redis: the topology's scope: global limits (see service.py)."""

from __future__ import annotations

from sidecar.outputs.ratelimit.service import RateLimitService
from sidecar.outputs.service import ServiceWiring

__all__ = ["RateLimitService", "build"]


def build(wiring: ServiceWiring) -> RateLimitService:
    """Always built when the sidecar serves gRPC: a reload may add the first global limit."""
    return RateLimitService(wiring.topology, wiring.registry, wiring.clock)  # the fleet view is not needed
