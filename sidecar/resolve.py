"""Turn a worker's host into IP literals (Envoy's EDS takes nothing else). Async DNS.

IP workers pass through. A DNS name is resolved with `loop.getaddrinfo` (the resolver
runs in the loop's executor, never blocking the loop) under a timeout; every address it
returns becomes an endpoint (a headless Service name gives one per pod). When a lookup
fails the last good answer is kept, so a DNS outage never empties a pool.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from confgen.model import is_ip
from sidecar.logs import log_event

__all__ = ["Resolver"]

_log = logging.getLogger("sidecar.resolve")


class Resolver:
    """Resolves hosts every cycle, remembering the last good answer per (host, port)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._last_good: dict[tuple[str, int], tuple[str, ...]] = {}

    async def resolve(self, host: str, port: int) -> tuple[str, ...]:
        """Sorted unique IPs for `host`; the last good answer (maybe ()) when a lookup fails."""
        if is_ip(host):
            return (host,)
        key = (host, port)
        try:
            async with asyncio.timeout(self._timeout_s):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                )
        except (OSError, TimeoutError) as exc:  # socket.gaierror is an OSError
            kept = self._last_good.get(key, ())
            log_event(_log, logging.WARNING, "dns.failed", host=host, error=str(exc) or type(exc).__name__,
                      kept=list(kept))
            return kept
        addresses = tuple(sorted({str(info[4][0]) for info in infos if is_ip(str(info[4][0]))}))
        if not addresses:
            return self._last_good.get(key, ())
        if self._last_good.get(key) != addresses:
            log_event(_log, logging.INFO, "dns.changed", host=host, addresses=list(addresses))
        self._last_good[key] = addresses
        return addresses

    def forget_except(self, keep: set[tuple[str, int]]) -> None:
        """Drop memories of hosts no longer in the topology."""
        for key in list(self._last_good):
            if key not in keep:
                del self._last_good[key]
