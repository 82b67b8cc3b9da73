"""Turn a worker's host into IP literals (Envoy's EDS takes nothing else). Async DNS.

IP workers pass through. A DNS name is resolved with `loop.getaddrinfo` (the resolver
runs in the loop's executor, never blocking the loop) under a timeout; every address it
returns becomes an endpoint (a headless Service name gives one per pod). When a lookup
fails the last good answer is kept, so a DNS outage never empties a pool.

A name answers at most `MAX_ADDRESSES` addresses (the first in order; the rest dropped and said in the
log): a DNS answer is not a worker's to make the probe loop thousands of endpoints long.

IPv4 is preferred, as Envoy's own `V4_PREFERRED` for strict_dns pools: when a name has
IPv4 addresses only those are used, else its IPv6 ones. A dual-stack name (`localhost`
is often 127.0.0.1 and ::1) is one server listening on one family more often than two:
publishing both would count its capacity twice, double its share of traffic, and keep
an endpoint that refuses connections in the pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from confgen.model import MAX_NAME_ADDRESSES, is_ip
from sidecar.logs import log_event

__all__ = ["MAX_ADDRESSES", "GetAddrInfo", "Resolver", "prefer_ipv4"]

MAX_ADDRESSES = MAX_NAME_ADDRESSES  # one name's addresses taken (nginx's upstream zones hold as many)

_log = logging.getLogger("sidecar.observe.resolve")

# loop.getaddrinfo's shape: (host, port, *, type=, proto=) -> [(family, type, proto, canonname, sockaddr)]
GetAddrInfo = Callable[..., Awaitable[Sequence[tuple[Any, ...]]]]


def prefer_ipv4(addresses: set[str]) -> tuple[str, ...]:
    """The IPv4 addresses when there are any, else the IPv6 ones; sorted."""
    v4 = {a for a in addresses if ipaddress.ip_address(a).version == 4}
    return tuple(sorted(v4 or addresses))


class Resolver:
    """Resolves hosts every cycle, remembering the last good answer per (host, port).

    `getaddrinfo` defaults to the running loop's; tests pass one that fails on demand.
    """

    def __init__(self, timeout_s: float, getaddrinfo: GetAddrInfo | None = None) -> None:
        self._timeout_s = timeout_s
        self._getaddrinfo = getaddrinfo
        self._last_good: dict[tuple[str, int], tuple[str, ...]] = {}

    async def resolve(self, host: str, port: int) -> tuple[str, ...]:
        """Sorted unique IPs for `host`; the last good answer (maybe ()) when a lookup fails."""
        if is_ip(host):
            return (host,)
        key = (host, port)
        lookup = self._getaddrinfo or asyncio.get_running_loop().getaddrinfo
        try:
            async with asyncio.timeout(self._timeout_s):
                infos = await lookup(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except (OSError, TimeoutError) as exc:  # socket.gaierror is an OSError
            kept = self._last_good.get(key, ())
            log_event(_log, logging.WARNING, "dns.failed", host=host, error=str(exc) or type(exc).__name__,
                      kept=list(kept))
            return kept
        addresses = prefer_ipv4({str(info[4][0]) for info in infos if is_ip(str(info[4][0]))})
        if not addresses:
            return self._last_good.get(key, ())
        if len(addresses) > MAX_ADDRESSES:
            if len(self._last_good.get(key, ())) != MAX_ADDRESSES:
                log_event(_log, logging.WARNING, "dns.too_many", host=host, answered=len(addresses),
                          taken=MAX_ADDRESSES)
            addresses = addresses[:MAX_ADDRESSES]
        if self._last_good.get(key) != addresses:
            log_event(_log, logging.INFO, "dns.changed", host=host, addresses=list(addresses[:16]),
                      count=len(addresses))
        self._last_good[key] = addresses
        return addresses

    def forget_except(self, keep: set[tuple[str, int]]) -> None:
        """Drop memories of hosts no longer in the topology."""
        for key in list(self._last_good):
            if key not in keep:
                del self._last_good[key]
