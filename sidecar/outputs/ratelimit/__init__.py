"""Envoy's rate limit service on Redis: the topology's scope: global limits (see service.py)."""

from __future__ import annotations

from pathlib import Path

from sidecar.outputs.contract import Built, Wiring
from sidecar.outputs.ratelimit.service import RateLimitService

__all__ = ["JOURNAL_FILE", "RateLimitService", "build"]

JOURNAL_FILE = ".confgen-ratelimit-journal.sqlite"  # a dot file: `confgen render --diff` and the manifest ignore it


def journal_path(wiring: Wiring) -> Path | None:
    """Where charges the store missed persist: beside the files the sidecar writes (None: in memory)."""
    from sidecar.config import xds_dir_for

    config = wiring.config
    if config.nginx is not None:
        return None  # no global limits there (validate refuses them)
    if config.serve_xds is not None:
        return None  # an ADS control plane writes no files: its charges wait in memory (docs/limits.md)
    return xds_dir_for(config, wiring.topo) / JOURNAL_FILE


def build(wiring: Wiring) -> Built:
    """The service with its journal, its servicer added to the sidecar's gRPC server (built when the
    topology has a global limit: `sidecar.outputs.registry.wanted`)."""
    service = RateLimitService(wiring.topology, wiring.registry, wiring.clock, journal=journal_path(wiring))
    wiring.grpc.add(service.add_to, service.name)
    wiring.budgets.check = service  # the endpoint picker decides the budgets in its own call with it
    return Built((service,))
