"""Envoy's rate limit service on Redis: the topology's scope: global limits (see service.py)."""

from __future__ import annotations

from pathlib import Path

from sidecar.outputs.ratelimit.service import RateLimitService
from sidecar.outputs.service import ServiceWiring

__all__ = ["JOURNAL_FILE", "RateLimitService", "build"]

JOURNAL_FILE = ".confgen-ratelimit-journal.sqlite"  # a dot file: `confgen render --diff` and the manifest ignore it


def journal_path(wiring: ServiceWiring) -> Path | None:
    """Where charges the store missed persist: beside the files the sidecar writes (None: in memory)."""
    from sidecar.config import xds_dir_for

    config = wiring.config
    if config.nginx is not None:
        return None  # no global limits there (validate refuses them)
    if config.serve_xds is not None:
        return None  # an ADS control plane writes no files: its charges wait in memory (docs/limits.md)
    return xds_dir_for(config, wiring.topology()) / JOURNAL_FILE


def build(wiring: ServiceWiring) -> RateLimitService:
    """Always built when the sidecar serves gRPC: a reload may add the first global limit."""
    return RateLimitService(wiring.topology, wiring.registry, wiring.clock, journal=journal_path(wiring))
