"""What a topology asks for that open-source nginx cannot honour (or only approximately).

Each finding is (path, message); `confgen validate --nginx` prints them as warnings pinned
to the field's place in the file. docs/targets.md has the whole feature matrix.
"""

from __future__ import annotations

import ipaddress

from ..balancing import is_hashing
from ..model import Balancing, LimitSet, RateLimit, Topology, admin_tcp, limit_list
from ._context import rate

Finding = tuple[str, str]
_DEFAULT_BIAS = Balancing().active_request_bias  # only a bias asked for explicitly is worth a warning


def unsupported(topo: Topology) -> list[Finding]:
    found: list[Finding] = []
    for ri, route in enumerate(topo.routes):
        if route.class_ != "standard":
            found.append((f"routes[{ri}].class", (
                "nginx honours no traffic class: one limit_conn per pool, so critical, standard and sheddable "
                "traffic are shed alike (critical's own breaker and shedding sheddable first are Envoy-only)")))
    for ki, key in enumerate(topo.auth.api_keys if topo.auth else []):
        if key.class_ != "standard":
            found.append((f"auth.api_keys[{ki}].class", (
                "nginx honours no traffic class: one limit_conn per pool, so this client's traffic is shed like "
                "any other (classes are Envoy-only)")))
    for li, lst in enumerate(topo.listeners):
        if lst.trusted_headers is not None:
            found.append((f"listeners[{li}].trusted_headers", (
                "nginx does not remove these headers from other peers: any client can send them (the classes "
                "they give are Envoy-only; a route to another pool on them can be chosen by any client)")))
    for pi, pool in enumerate(topo.pools):
        base = f"pools[{pi}]"
        bal = pool.balancing
        if pool.health.enabled:
            found.append((f"{base}.health", (
                "active health checks are NGINX Plus only; nginx notices a dead worker only when real "
                "requests fail (max_fails from outlier_detection.consecutive_gateway_failure)")))
        if is_hashing(bal.policy):
            found.append((f"{base}.balancing.hash_balance_factor", (
                "bounded-load hashing is Envoy-only: nginx's consistent hash keeps a hot session on "
                "its worker however loaded it is")))
        if bal.policy == "maglev":
            found.append((f"{base}.balancing.policy", "maglev is rendered as nginx's consistent (ketama) hash"))
        if bal.policy == "prefix_affinity":  # named, not auto: nginx has no picker, says so once
            found.append((f"{base}.balancing.policy", (
                "prefix_affinity is Envoy-only (confgen-sidecar's endpoint picker over ext_proc): nginx "
                "balances this pool as least_request, with no prefix-cache affinity")))
        if pool.admission.given():
            found.append((f"{base}.admission", (
                "admission per request is the endpoint picker's, Envoy-only: nginx pools are shed by the "
                "sidecar's in-flight limiter alone (backpressure)")))
        if bal.policy in ("auto", "least_request", "prefix_affinity"):
            if bal.choice_count != 2:
                found.append((f"{base}.balancing.choice_count", (
                    "nginx samples two workers (random two least_conn) or all of them (least_conn); "
                    f"choice_count {bal.choice_count} is rendered as least_conn over all workers")))
            if bal.active_request_bias != _DEFAULT_BIAS:
                found.append((f"{base}.balancing.active_request_bias", "nginx has no active request bias; ignored"))
        for wi, worker in enumerate(pool.workers):
            if worker.drain:
                found.append((f"{base}.workers[{wi}].drain", (
                    "nginx has no draining state: the worker is marked down; requests in flight finish "
                    "only because a reload lets old nginx workers complete them")))
            if worker.zone is not None:
                found.append((f"{base}.workers[{wi}].zone", "nginx has no locality-aware balancing; zone is ignored"))
        if pool.timeouts.request.ms:
            found.append((f"{base}.timeouts.request", (
                "nginx has no whole-request timeout for proxied requests; only timeouts.idle "
                "(proxy_read_timeout) bounds a generation")))
        if pool.retries.attempts and pool.retries.retry_on == ["retriable-4xx"]:
            found.append((f"{base}.retries.retry_on", "nginx cannot retry on 409; retries are off for this pool"))
        elif "retriable-4xx" in pool.retries.retry_on:
            found.append((f"{base}.retries.retry_on", "nginx cannot retry on 409; retriable-4xx is ignored"))
        if pool.discovery == "strict_dns":
            found.append((f"{base}.discovery", (
                "nginx resolves the worker names when it starts or reloads, not continuously; the "
                "sidecar (discovery: eds) keeps them current")))
        if pool.fallback is not None:
            found.append((f"{base}.fallback", (
                "nginx falls back to the next pool when every try in this one failed (its own 502/504); "
                "there is no partial spill-over while some workers are still healthy")))
    for path, limit in _limits(topo):
        if limit.scope == "local" and not _exact(limit.rate, limit.period.ms):
            found.append((path, f"nginx rates are whole requests per second or minute; rendered as {rate(limit)}"))
    if not ipaddress.ip_address(admin_tcp(topo)[0]).is_loopback:
        found.append(("admin.address", "the nginx status page listens on 127.0.0.1 only"))
    return found


def _limits(topo: Topology) -> list[tuple[str, RateLimit]]:
    """(field path, limit) for every limit in the topology."""
    sets: list[tuple[str, LimitSet | None]] = [
        ("limits.global", topo.limits.global_), ("limits.per_key", topo.limits.per_key)]
    if topo.auth is not None:
        sets += [(f"auth.api_keys[{ki}].rate_limit", k.rate_limit) for ki, k in enumerate(topo.auth.api_keys)]
    out = []
    for base, value in sets:
        for index, limit in enumerate(limit_list(value)):
            out.append((f"{base}[{index}]" if isinstance(value, list) else base, limit))
    return out


def refused(topo: Topology) -> list[Finding]:
    """What open-source nginx cannot render at all: `validate --nginx` and `render --target nginx`
    refuse the topology with these errors."""
    found: list[Finding] = []
    for path, limit in _limits(topo):
        if limit.scope == "global":
            found.append((f"{path}.scope", (
                "open-source nginx cannot call a rate limit service, so it cannot share a budget with other "
                "proxies; global limits are Envoy-only (docs/targets.md)")))
        elif limit.unit != "requests":
            found.append((f"{path}.unit", "nginx counts requests only; token limits are Envoy-only (docs/targets.md)"))
    return found


def _exact(requests: int, per_ms: int) -> bool:
    return (requests * 1000) % per_ms == 0 or (requests * 60_000) % per_ms == 0
