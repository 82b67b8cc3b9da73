"""Checks of what a client may claim at the edge: traffic classes and body sizes.

A request's class decides who is refused first under overload, so it must come from what a
client cannot choose: its authenticated identity (auth.api_keys[].class, a route's
allow_clients) or a header a trusted hop sets (listeners[].trusted_headers, which Envoy removes
from every other peer). Headers, the path and the body's `model` are the client's to write.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator

from .balancing import uses_picker
from .errors import Severity
from .model import PICKER_MAX_BODY_BYTES, PICKER_MAX_MESSAGE_BYTES, Route, Topology
from .plan import fallback_chain, implicit_model_routes

Finding = tuple[str, str, Severity]
ERROR, WARNING = Severity.ERROR, Severity.WARNING
RANK = {"sheddable": 0, "standard": 1, "critical": 2}


def check(topo: Topology, reserved: Callable[[str], bool]) -> Iterator[Finding]:
    """`reserved`: the headers no topology may claim (the proxies' own, the key's)."""
    yield from _trusted_headers(topo, reserved)
    yield from _class_claims(topo)
    yield from _bodies(topo)


def _trusted_headers(topo: Topology, reserved: Callable[[str], bool]) -> Iterator[Finding]:
    for li, lst in enumerate(topo.listeners):
        trusted = lst.trusted_headers
        if trusted is None:
            continue
        base = f"listeners[{li}].trusted_headers"
        for ni, name in enumerate(trusted.names):
            if reserved(name) or (topo.auth is not None and name == topo.auth.client_header):
                yield f"{base}.names[{ni}]", f"{name!r} is a header the proxies own or that carries the client's " \
                    "identity; trust a header of your own", ERROR
            elif name in trusted.names[:ni]:
                yield f"{base}.names[{ni}]", f"{name!r} is listed twice", ERROR
        for ci, cidr in enumerate(trusted.from_):
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as err:
                yield f"{base}.from[{ci}]", f"{cidr!r} is not a network in CIDR form ({err})", ERROR


def _pools(topo: Topology, name: str) -> set[str]:
    """The pool and those it falls back to: where a route's class is honoured."""
    try:
        return {p.name for p in fallback_chain(topo, topo.pool(name))}
    except KeyError:
        return set()


def _what(route: Route, trusted: frozenset[str]) -> str:
    """What a client writes to be matched by `route` (its untrusted conditions)."""
    match, parts = route.match, []
    for header in match.headers or []:
        if header.name not in trusted:
            parts.append(f"header {header.name}")
        elif header.present is False:
            parts.append(f"no {header.name} (Envoy removes an untrusted peer's copy)")
    if match.path_prefix is not None:
        parts.append(f"a path under {match.path_prefix}")
    if match.models is not None:
        parts.append("model " + " or ".join(match.models))
    return ", ".join(parts) or "any request"


def _gated(route: Route, trusted: frozenset[str]) -> bool:
    """Only an identity or a trusted hop gets this route: its own allow_clients names the clients
    (others are answered 403, not routed on), or it needs a trusted header to be sent (a
    `present: false` on one matches every untrusted peer, whose copy Envoy removed)."""
    if route.allow_clients is not None:
        return True
    return any(h.name in trusted and h.present is not False for h in route.match.headers or [])


def _class_claims(topo: Topology) -> Iterator[Finding]:
    """A route whose class is better than another route's into the same pools (its fallback chain
    included) lets a client move its request from the worse class to the better one by writing what
    the better route matches on, unless that route is gated by identity or a trusted header."""
    trusted = topo.trusted_header_names()
    others: list[tuple[str, str, set[str]]] = []  # (what, class, pools) of every route
    for route in topo.routes:
        others.append((f"route {route.name}", route.class_, _pools(topo, route.pool)))
    others += [(f"the model route of {model}", "standard", _pools(topo, pool.name))
               for model, pool in implicit_model_routes(topo)]
    if topo.default_pool is not None:
        others.append(("the default route", "standard", _pools(topo, topo.default_pool)))
    for ri, route in enumerate(topo.routes):
        if route.class_ == "sheddable" or _gated(route, trusted):
            continue
        pools = _pools(topo, route.pool)
        worse = [(what, cls) for what, cls, theirs in others
                 if RANK[cls] < RANK[route.class_] and pools & theirs]
        if not worse:
            continue
        what, cls = worse[0]
        yield f"routes[{ri}].class", (
            f"any client gets class {route.class_} by sending {_what(route, trusted)} ({what} into the same pool "
            f"is {cls}): a class must come from what a client cannot forge. Give it by identity "
            "(auth.api_keys[].class, or this route's allow_clients), or match on a header a trusted hop sets "
            "(listeners[].trusted_headers on every listener: Envoy removes it from other peers)"), ERROR


def _bodies(topo: Topology) -> Iterator[Finding]:
    """The endpoint picker gets every request body of a listener in one gRPC message: a body it
    cannot take would cost each such request the picker's timeout, then go unpicked."""
    picker = next((i for i, p in enumerate(topo.pools) if uses_picker(topo, p)), None)
    if picker is None:
        return
    for li, lst in enumerate(topo.listeners):
        if lst.max_request_bytes > PICKER_MAX_BODY_BYTES:
            yield f"listeners[{li}].max_request_bytes", (
                f"{lst.max_request_bytes} is more than the endpoint picker takes (pools[{picker}] is "
                f"prefix_affinity): it reads the body in one gRPC message of at most {PICKER_MAX_MESSAGE_BYTES} "
                f"bytes; keep this at most {PICKER_MAX_BODY_BYTES}"), ERROR
