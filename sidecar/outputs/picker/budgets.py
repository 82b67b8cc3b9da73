"""The global budgets' check, decided by the picker in the ext_proc call every request already makes.

Envoy's rate limit filter would call the sidecar's rate limit service once more per request (a
second gRPC call into this process: ~1.25 ms of Envoy-to-Python transport at P50, measured in
docs/limits.md); the picker sees the same request one filter earlier, so it evaluates the route's
request-time descriptors itself, from the actions confgen rendered for that route
(`confgen.envoy.route_checks`), and asks the rate limit service in process (`BudgetCheck`). Admitted,
the request leaves marked checked (`confgen.limits.CHECKED_HEADER`), which makes the filter's
descriptors produce nothing, so Envoy makes no call; refused, it gets the filter's 429 from here.
A request the picker does not check (skipped, behind, a stream over the cap, the picker unreachable)
carries no mark, and Envoy's filter checks it as before.

The actions are evaluated as Envoy evaluates them (rate limit action semantics): an action that
produces nothing drops its whole descriptor, except a header or metadata read marked
`skip_if_absent`; a route whose actions include a kind this module does not know is left to Envoy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confgen.errors import ConfgenError
from confgen.limits import BUDGET_HEADERS, CHECKED_HEADER
from sidecar.outputs.contract import Descriptor

__all__ = ["Descriptor", "RouteChecks", "Unknown", "budget_metadata", "refusal_headers"]

Headers = Mapping[str, str]  # lower-case name -> first value
Metadata = Mapping[str, Mapping[str, str]]  # namespace -> key -> string value (ext_proc's forwarded metadata)
_SKIP = object()  # an entry left out (skip_if_absent), the descriptor kept
# an action: (headers, metadata) -> (key, value), _SKIP, or None (the descriptor is dropped)
_Action = Callable[[Headers, Metadata], "tuple[str, str] | object | None"]


class Unknown(ConfgenError):
    """An action this module cannot evaluate exactly as Envoy would: its route stays Envoy's to check."""


def _generic(spec: Mapping[str, Any]) -> _Action:
    entry = (spec.get("descriptor_key") or "generic_key", spec["descriptor_value"])
    return lambda headers, metadata: entry


def _matcher(spec: Mapping[str, Any]) -> Callable[[Headers], bool]:
    """A header matcher of the kinds confgen renders (present, exact, a regex over the whole value), which
    an absent header never matches; any other kind (inverted, absent-as-empty, ...) is Unknown."""
    if spec.get("invert_match") or spec.get("treat_missing_header_as_empty"):
        raise Unknown("an inverted header matcher")
    name = spec["name"].lower()
    if spec.get("present_match") is True:
        return lambda headers: name in headers
    match = spec.get("string_match", {})
    if set(match) == {"exact"}:
        exact = match["exact"]
        return lambda headers: headers.get(name) == exact
    if set(match) == {"safe_regex"}:
        pattern = re.compile(match["safe_regex"]["regex"])  # RE2 and re agree on confgen's alternations
        return lambda headers: name in headers and pattern.fullmatch(headers[name]) is not None
    raise Unknown(f"header matcher {sorted(spec)}")


def _header_value_match(spec: Mapping[str, Any]) -> _Action:
    matchers = [_matcher(h) for h in spec.get("headers", [])]
    expect = spec.get("expect_match", True)
    entry = (spec.get("descriptor_key") or "header_match", spec["descriptor_value"])

    def act(headers: Headers, metadata: Metadata) -> tuple[str, str] | None:
        matched = all(m(headers) for m in matchers)
        return entry if matched == expect else None
    return act


def _request_headers(spec: Mapping[str, Any]) -> _Action:
    name, key, skip = spec["header_name"].lower(), spec["descriptor_key"], bool(spec.get("skip_if_absent"))

    def act(headers: Headers, metadata: Metadata) -> tuple[str, str] | object | None:
        value = headers.get(name)
        if value is None:
            return _SKIP if skip else None
        return key, value
    return act


def _metadata(spec: Mapping[str, Any]) -> _Action:
    if spec.get("source", "DYNAMIC") != "DYNAMIC":
        raise Unknown("route-entry metadata")
    path = spec["metadata_key"]["path"]
    if len(path) != 1:
        raise Unknown("a nested metadata path")
    namespace, field, key = spec["metadata_key"]["key"], path[0]["key"], spec["descriptor_key"]
    default, skip = spec.get("default_value") or None, bool(spec.get("skip_if_absent"))

    def act(headers: Headers, metadata: Metadata) -> tuple[str, str] | object | None:
        value = metadata.get(namespace, {}).get(field) or default  # a string value; anything else: the default
        if value is None:
            return _SKIP if skip else None
        return key, value
    return act


_KINDS: dict[str, Callable[[Mapping[str, Any]], _Action]] = {
    "generic_key": _generic,
    "header_value_match": _header_value_match,
    "request_headers": _request_headers,
    "metadata": _metadata,
}


def _compile(actions: Sequence[Mapping[str, Any]]) -> tuple[_Action, ...]:
    out = []
    for action in actions:
        (kind, spec), = action.items()
        build = _KINDS.get(kind)
        if build is None:
            raise Unknown(f"action {kind}")
        out.append(build(spec))
    return tuple(out)


def _headers_read(actions: Sequence[Mapping[str, Any]]) -> set[str]:
    names = set()
    for action in actions:
        (kind, spec), = action.items()
        if kind == "request_headers":
            names.add(spec["header_name"].lower())
        elif kind == "header_value_match":
            names.update(h["name"].lower() for h in spec.get("headers", []))
    return names


class RouteChecks:
    """Route name -> its request-time descriptors, compiled once per topology; `descriptors` evaluates
    them for one request. Routes with an action it does not know are left out (Envoy checks them)."""

    def __init__(self, table: Mapping[str, Sequence[tuple[Sequence[Mapping[str, Any]], int | None]]]) -> None:
        self._routes: dict[str, tuple[tuple[tuple[_Action, ...], int | None], ...]] = {}
        self.left: dict[str, str] = {}  # route -> why the picker leaves it to Envoy
        headers: set[str] = set()
        for route, checks in table.items():
            try:
                self._routes[route] = tuple((_compile(actions), hits) for actions, hits in checks)
            except Unknown as exc:
                self.left[route] = str(exc)
                continue
            for actions, _ in checks:
                headers |= _headers_read(actions)
        headers.discard(CHECKED_HEADER)  # never read from a request: the proxy removes a client's copy
        self.headers = frozenset(headers)  # the request headers the checks read

    def __contains__(self, route: object) -> bool:
        return route in self._routes

    def __len__(self) -> int:
        return len(self._routes)

    def descriptors(self, route: str, headers: Headers, metadata: Metadata) -> list[Descriptor]:
        """What Envoy's filter would send for this request on `route` (a route not in the table: KeyError)."""
        out = []
        for actions, hits in self._routes[route]:
            entries: list[tuple[str, str]] = []
            for act in actions:
                produced = act(headers, metadata)
                if produced is None:
                    break
                if produced is not _SKIP:
                    entries.append(produced)  # type: ignore[arg-type]
            else:
                if entries:
                    out.append(Descriptor(tuple(entries), hits))
        return out


def budget_metadata(headers: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The admitted answer's x-ratelimit-* values by their key in `confgen.limits.BUDGET_NS`, which the
    route table turns into the response's headers."""
    by_header = {header: key for key, header in BUDGET_HEADERS.items()}
    return {by_header[name]: value for name, value in headers if name in by_header}


def refusal_headers(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """A refusal's headers: the answer's, and its JSON body's type."""
    return [*headers, ("content-type", "application/json")]
