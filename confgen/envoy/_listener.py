"""Listeners (LDS): the HTTP filter chain and the routes to pools.

Filter order, and why:
  1. header_mutation  - drop client-sent copies of our internal header and of Envoy's
                        x-envoy-* request controls before anything reads them.
  1b. confgen.untrusted_headers - only with listeners[].trusted_headers: drop those headers
                        unless the peer is one of the listener's trusted hops (a route's
                        class may depend on them; see _untrusted_headers).
  2. api_key_auth     - reject unauthenticated requests before buffering their bodies;
                        forward the client id, strip the key.
  3. local_ratelimit  - global bucket, then one bucket per client (429).
  3b. buffer          - the listener's max_request_bytes, for every codec: a larger body is
                        413 before anything parses it.
  4. json_to_metadata - read the body's `model` into dynamic metadata; routes match on it
                        (no header a client could forge decides the pool).
     (token budgets: also the estimate from max_tokens, and the answer's usage; then
     sse_to_metadata for the usage of streams)
  5. rbac             - per-route client allow lists, evaluated on the final route.
  5b. local_ratelimit.shed - only with sheddable traffic: on the sheddable routes (their
                        typed_per_filter_config), refuses the runtime share of the pool's
                        sheddable requests the sidecar sets under overload (`_shed_config`);
                        after rbac (a client not allowed still gets 403), before the global
                        budgets and the picker (a refused request uses neither).
  6. ext_proc         - only with a pool on the endpoint picker: confgen-sidecar's endpoint
                        picker reads the buffered body and names the worker
                        (x-gateway-destination-endpoint, which header_mutation strips from
                        clients); fails open within `PICKER_TIMEOUT`. With global limits it
                        decides the budgets first, in the same call (a refused request is not
                        picked), and marks the request checked (limits.CHECKED_HEADER, also
                        stripped from clients).
  7. ratelimit        - global budgets (confgen-sidecar's rate limit service), per-route
                        descriptors; see _ratelimit.py. With the picker: only for a request
                        it did not check (its descriptors need the mark absent).
  7b. local_ratelimit.ceiling - only with requests budgets that fail open: per route, each
                        budget's (and client's) bucket of twice its amount, after the check
                        (either's): bounds what a check that fails open admits; see _ratelimit.py.
  8. router
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .._openai import MODEL_CONTENT_TYPES, models_body
from ..balancing import picker_wanted
from ..limits import BUDGET_NS, CHECKED_HEADER, USAGE_NS, local_client_limits, local_listener_limit
from ..model import Listener, Pool, RateLimit, Topology
from ..plan import Plan, PlannedRoute
from . import _ratelimit
from ._clusters import (
    PICKER_HEADER,
    PICKER_METADATA_NS,
    SIDECAR_CLUSTER,
    SIDECAR_GRPC_CLUSTER,
    SIDECAR_TIMEOUT,
    target_cluster,
)
from ._proto import Json, dur, extension, typed
from ._replies import META_NS, SHED_STATUS, local_reply_config

# Request headers Envoy would obey from a client (retries, timeouts, routing hints).
ENVOY_CONTROL_HEADERS = (
    "x-envoy-max-retries",
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-upstream-alt-stat-name",
    "x-envoy-priority",
    "x-envoy-original-path",
    "x-envoy-internal",
    "x-envoy-force-trace",
    "x-envoy-ip-tags",
)


def _bucket(limit: RateLimit) -> Json:
    return {"max_tokens": limit.bucket, "tokens_per_fill": limit.rate, "fill_interval": dur(limit.period)}


def _percent(key: str) -> Json:
    return {"default_value": {"numerator": 100, "denominator": "HUNDRED"}, "runtime_key": key}


def _remove(names: list[str]) -> Json:
    return {"mutations": {"request_mutations": [{"remove": name} for name in names]}}


TRUSTED_FILTER = "confgen.untrusted_headers"
BODY_LIMIT_FILTER = "envoy.filters.http.buffer"


def _untrusted_headers(lst: Listener) -> Json | None:
    """Removes the listener's trusted headers unless the peer (the connection's own source
    address, not X-Forwarded-For) is in `from`: a header_mutation wrapped in a matcher that skips
    it for those peers (Envoy's ExtensionWithMatcher; checked on Envoy 1.40: a 127.0.0.2 client's
    copy removed, a 127.0.0.1/32 peer's kept)."""
    trusted = lst.trusted_headers
    if trusted is None or not trusted.from_:
        return None
    ranges = []
    for cidr in trusted.from_:
        net = ipaddress.ip_network(cidr)
        ranges.append({"address_prefix": str(net.network_address), "prefix_len": net.prefixlen})
    return extension(TRUSTED_FILTER, "extensions.common.matching.v3.ExtensionWithMatcher", {
        "extension_config": extension(
            "envoy.filters.http.header_mutation", "extensions.filters.http.header_mutation.v3.HeaderMutation",
            _remove(trusted.names)),
        "xds_matcher": {"matcher_tree": {
            "input": extension("envoy.matching.inputs.direct_source_ip",
                               "extensions.matching.common_inputs.network.v3.DirectSourceIPInput", {}),
            "custom_match": {"name": "envoy.matching.custom_matchers.ip_matcher",
                             "typed_config": {"@type": "type.googleapis.com/xds.type.matcher.v3.IPMatcher",
                                              "range_matchers": [{"ranges": ranges, "on_match": {"action": extension(
                                                  "skip", "extensions.filters.common.matcher.action.v3.SkipFilter",
                                                  {})}}]}},
        }},
    })


def _filters(topo: Topology, lst: Listener, secrets: Mapping[str, str], restricted: bool,
             sheddable: bool) -> list[Json]:
    internal = [*ENVOY_CONTROL_HEADERS]
    if topo.auth is not None:
        internal.insert(0, topo.auth.client_header)
    if picker_wanted(topo):
        internal.append(PICKER_HEADER)  # a client must not choose the worker
    if _ratelimit.picker_checks(topo):
        internal.append(CHECKED_HEADER)  # nor skip the budgets' check
    if lst.trusted_headers is not None and not lst.trusted_headers.from_:
        internal += lst.trusted_headers.names  # no peer may send them
    filters = [extension(
        "envoy.filters.http.header_mutation",
        "extensions.filters.http.header_mutation.v3.HeaderMutation",
        _remove(internal),
    )]
    untrusted = _untrusted_headers(lst)
    if untrusted is not None:
        filters.append(untrusted)
    if topo.auth is not None:
        filters.append(extension(
            "envoy.filters.http.api_key_auth",
            "extensions.filters.http.api_key_auth.v3.ApiKeyAuth",
            {
                "credentials": [{"key": secrets[k.client], "client": k.client} for k in topo.auth.api_keys],
                "key_sources": [{"header": "Authorization"}],
                "forwarding": {"header": topo.auth.client_header, "hide_credentials": True},
            },
        ))
    listener_limit = local_listener_limit(topo)
    if listener_limit is not None:
        filters.append(extension(
            "envoy.filters.http.local_ratelimit",
            "extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            {
                "stat_prefix": "global",
                "token_bucket": _bucket(listener_limit),
                "filter_enabled": _percent("confgen.ratelimit.global.enabled"),
                "filter_enforced": _percent("confgen.ratelimit.global.enforced"),
            },
        ))
    per_client = local_client_limits(topo)
    if per_client:
        assert topo.auth is not None
        filters.append(extension(
            "envoy.filters.http.local_ratelimit.per_key",
            "extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            {
                "stat_prefix": "per_key",
                # Every request also draws from this bucket; make it never the one that empties.
                "token_bucket": _ratelimit.NEVER_EMPTY_BUCKET,
                "always_consume_default_token_bucket": False,
                "filter_enabled": _percent("confgen.ratelimit.per_key.enabled"),
                "filter_enforced": _percent("confgen.ratelimit.per_key.enforced"),
                "descriptors": [
                    {"entries": [{"key": "client", "value": client}], "token_bucket": _bucket(limit)}
                    for client, limit in per_client
                ],
                "rate_limits": [{"actions": [{"request_headers": {
                    "header_name": topo.auth.client_header, "descriptor_key": "client"}}]}],
            },
        ))
    tokens = _ratelimit.uses_tokens(topo)
    body_rules: Json = {"request_rules": {
        # The same rule as the nginx target's njs (docs/targets.md): only these
        # Content-Types, or none, and `model` kept as its JSON value, so a number or
        # boolean is a name no route matches (STRING would turn `true` into "1").
        "allow_content_types": list(MODEL_CONTENT_TYPES),
        "allow_empty_content_type": True,
        "rules": [{
            "selectors": [{"key": "model"}],
            "on_present": {"metadata_namespace": META_NS, "key": "model", "type": "PROTOBUF_VALUE"},
        }, *(_ratelimit.usage_request_rules() if tokens else [])],
    }}
    if tokens:  # token budgets: the answer's usage (JSON bodies here, streams in sse_to_metadata)
        body_rules["response_rules"] = {"allow_content_types": list(MODEL_CONTENT_TYPES),
                                        "rules": _ratelimit.usage_response_rules()}
    # The body cap, for every codec: per_connection_buffer_limit_bytes alone bounds HTTP/1 only
    # (measured on Envoy 1.40: an 8 MB body over HTTP/2 went through a 2 MiB listener cap and cost
    # +686 MiB in json_to_metadata). The buffer filter refuses a body past max_request_bytes with
    # 413 before the next filter sees any of it.
    filters.append(extension(
        BODY_LIMIT_FILTER, "extensions.filters.http.buffer.v3.Buffer", {"max_request_bytes": lst.max_request_bytes},
    ))
    filters.append(extension(
        "envoy.filters.http.json_to_metadata", "extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        body_rules,
    ))
    if tokens:
        filters.append(_ratelimit.sse_filter())
    if restricted:
        # No rules here: allow everything unless a route narrows it (typed_per_filter_config).
        filters.append(extension("envoy.filters.http.rbac", "extensions.filters.http.rbac.v3.RBAC", {}))
    if sheddable:
        # No limit here: only the sheddable routes' own settings (typed_per_filter_config) act.
        filters.append(extension(SHED_FILTER, "extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                                 {"stat_prefix": "confgen_shed"}))
    # Global budgets: asked once the route is final (it carries the descriptors) and the
    # client is allowed on it; before the router, so a refused prompt never reaches a worker.
    if picker_wanted(topo):
        filters.append(_picker_filter(_picker_metadata(topo)))
    filters += _ratelimit.filters(topo)
    filters.append(extension(
        "envoy.filters.http.router", "extensions.filters.http.router.v3.Router",
        {"suppress_envoy_headers": True},
    ))
    return filters


PICKER_FILTER = "envoy.filters.http.ext_proc"
# The largest JSON answer whose usage the token budgets read (json_to_metadata buffers it whole)
RESPONSE_BUFFER_BYTES = 16 * 1024 * 1024
ROUTE_NAME_ATTRIBUTE = "xds.route_name"
# when Envoy received the request (RFC 3339, microseconds): the picker answers a request that
# reached it late without a pick (PICKER_LATE_MODE), so Envoy balances it now
REQUEST_TIME_ATTRIBUTE = "request.time"
PICKER_TIMEOUT = "0.2s"  # per message; then Envoy's own balancer picks (failure_mode_allow)
# The longest the picker may extend that timeout for one message (ext_proc's override_message_timeout):
# a request it holds while every slot of its pool is taken (its `hold` policy) waits at most this.
PICKER_MAX_HOLD_S = 5
# The one mode the picker may switch a stream to, on its answer to the request headers: nothing
# more sent to it (no body, no response), so the stream ends with that answer. The picker's way
# to shed its own work when requests reach it late; Envoy refuses any other override.
PICKER_LATE_MODE: Json = {"request_header_mode": "SEND", "request_body_mode": "NONE",
                          "request_trailer_mode": "SKIP", "response_header_mode": "SKIP",
                          "response_body_mode": "NONE", "response_trailer_mode": "SKIP"}


# The share (a percentage, 0 by default) of requests that skip the picker altogether: Envoy balances
# them with least_request without a round trip to it. The sidecar raises it while requests reach its
# picker late (it cannot keep up: sustained, not a burst) and lowers it once they no longer do (admin
# runtime in file mode, the RTDS layer in ADS mode). Drawn on a hash of x-request-id, which Envoy sets
# itself on requests from outside (use_remote_address; a client's is not preserved).
PICKER_BYPASS_RUNTIME_KEY = "confgen.picker.bypass"


def _picker_filter(metadata: Json | None = None) -> Json:
    """The picker's ext_proc filter, skipped for the runtime share PICKER_BYPASS_RUNTIME_KEY of requests
    (an ExtensionWithMatcher around it: the generic way to skip an HTTP filter per request; ext_proc has no
    runtime switch of its own). Inner and outer names are the filter's own, so its per-route settings
    and the attributes it sends are filed under the same name either way."""
    bypass = {"single_predicate": {
        "input": extension("request-id", "type.matcher.v3.HttpRequestHeaderMatchInput",
                           {"header_name": "x-request-id"}),
        "custom_match": extension("bypass", "extensions.matching.input_matchers.runtime_fraction.v3.RuntimeFraction", {
            "runtime_fraction": {"default_value": {"numerator": 0, "denominator": "HUNDRED"},
                                 "runtime_key": PICKER_BYPASS_RUNTIME_KEY}}),
    }}
    skip = extension("skip", "extensions.filters.common.matcher.action.v3.SkipFilter", {})
    return extension(PICKER_FILTER, "extensions.common.matching.v3.ExtensionWithMatcher", {
        "extension_config": _ext_proc(metadata),
        "xds_matcher": {"matcher_list": {"matchers": [{"predicate": bypass, "on_match": {"action": skip}}]}},
    })


def _ext_proc(metadata: Json | None = None) -> Json:
    """ext_proc to the sidecar's endpoint picker, for every request of the listener.

    Not per route: the route depends on the body's model (json_to_metadata), and Envoy
    decides which filters run, and reads their per-route settings, from the route known at
    the headers, before the body is read. So the picker sees every request and finds the
    pool from the model itself (pools' models, default_pool); for a pool that is not
    prefix_affinity it answers at once with nothing (Envoy's own balancer). Its header names
    an endpoint only the pool's override_host cluster obeys; any other cluster ignores it.
    The body is already buffered (json_to_metadata); the picker answers on it. The response
    is not sent to it, but the trailers mode keeps the gRPC stream open until the response
    ends, which is how it counts requests in flight."""
    return extension(PICKER_FILTER, "extensions.filters.http.ext_proc.v3.ExternalProcessor", {
        # the picker answers an admission refusal with SHED_STATUS, which the local reply maps to 429
        # `overloaded` keeping its retry-after (its own 429 was taken for a rate limit's and rewritten)
        "grpc_service": {"envoy_grpc": {"cluster_name": SIDECAR_GRPC_CLUSTER},
                         "initial_metadata": [{"key": "x-confgen-shed-status", "value": str(SHED_STATUS)}]},
        "failure_mode_allow": True,
        "message_timeout": PICKER_TIMEOUT,
        "max_message_timeout": f"{PICKER_MAX_HOLD_S}s",
        "processing_mode": {
            # SEND, though the picker needs only the body: that is what holds the headers in
            # this filter until the body's answer. With SKIP the router already has them and
            # picks the host before the picker answers (measured: the pick was ignored).
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SKIP",
            "response_body_mode": "NONE",
            "response_trailer_mode": "SEND",
        },
        "metadata_options": metadata or {"receiving_namespaces": {"untyped": [PICKER_METADATA_NS]}},
        # the matched route's name (the route known after json_to_metadata: checked on Envoy 1.40),
        # which the picker looks up in `route_classes` for the request's class and pool
        "request_attributes": [ROUTE_NAME_ATTRIBUTE, REQUEST_TIME_ATTRIBUTE],
        "allow_mode_override": True,
        "allowed_override_modes": [PICKER_LATE_MODE],
        "route_cache_action": "RETAIN",  # the destination header matches no route: no re-match
    })


def _rbac_only(topo: Topology, clients: tuple[str, ...]) -> Json:
    assert topo.auth is not None
    header = topo.auth.client_header
    principals = [{"header": {"name": header, "string_match": {"exact": c}}} for c in clients]
    return typed("extensions.filters.http.rbac.v3.RBACPerRoute", {"rbac": {"rules": {
        "action": "ALLOW",
        "policies": {"allowed-clients": {
            "permissions": [{"any": True}],
            "principals": [{"or_ids": {"ids": principals}}] if principals else [{"not_id": {"any": True}}],
        }},
    }}})


def _model_matcher(model: str, present: bool = True) -> Json:
    if present:
        return {"filter": META_NS, "path": [{"key": "model"}], "value": {"string_match": {"exact": model}}}
    return {"filter": META_NS, "path": [{"key": "model"}], "value": {"present_match": True}, "invert": True}


def _action(topo: Topology, plan: Plan, pool: Pool) -> Json:
    action: Json = {
        "cluster": target_cluster(pool),
        "timeout": dur(pool.timeouts.request),
        "idle_timeout": dur(pool.timeouts.idle),
    }
    if pool.retries.attempts > 0:
        action["retry_policy"] = {
            "retry_on": ",".join(pool.retries.retry_on),
            "num_retries": pool.retries.attempts,
            "retry_host_predicate": [extension(
                "envoy.retry_host_predicates.previous_hosts",
                "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate", {},
            )],
            "host_selection_retry_max_attempts": 5,
        }
        if pool.fallback is not None:
            # The failover aggregate re-reads its pools' health only on membership changes
            # (measured: ~1 s of failures after health checks failed every primary
            # worker), so it may still pick a dead pool. The last retry moves on to the
            # next pool (the aggregate's next priority); earlier ones stay in this pool.
            action["retry_policy"]["retry_priority"] = extension(
                "envoy.retry_priorities.previous_priorities",
                "extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
                {"update_frequency": pool.retries.attempts},
            )
    hash_on = pool.balancing.hash_on
    if hash_on is not None and plan.pool(pool.name).hashing:
        if hash_on.header is not None:
            action["hash_policy"] = [{"header": {"header_name": hash_on.header}}]
        elif hash_on.cookie is not None:
            # A session cookie: Envoy sets it on the first answer when the client has none.
            action["hash_policy"] = [{"cookie": {"name": hash_on.cookie, "ttl": "0s"}}]
    return action


def _route(topo: Topology, plan: Plan, name: str, planned: PlannedRoute, match: Json,
           model: str | None = None) -> Json:
    action = _action(topo, plan, planned.pool)
    if planned.traffic_class == "critical":
        # Envoy's HIGH-priority circuit breakers: the sidecar's shedding limit is on DEFAULT only
        action = {**action, "priority": "HIGH"}
    route: Json = {"name": name, "match": match, "route": action}
    per_filter: Json = {}
    if planned.clients is not None:
        per_filter["envoy.filters.http.rbac"] = _rbac_only(topo, planned.clients)
    per_filter.update(_ratelimit.per_route(topo, model, planned.pool))
    if per_filter:
        route["typed_per_filter_config"] = per_filter
    return route


def shed_runtime_key(pool: str) -> str:
    """The runtime key holding the percentage (0-100) of `pool`'s sheddable requests Envoy answers
    429 `overloaded` at once: the render defaults it to 0, the sidecar raises it under overload
    (admin runtime in file mode, the RTDS layer in ADS mode). Pool names are validated names."""
    return f"confgen.shed.{pool}.sheddable"


def shed_stat_prefix(pool: str) -> str:
    """Envoy counts the pool's refused sheddable requests in
    `<prefix>.http_local_rate_limit.rate_limited` (one counter for all its sheddable routes)."""
    return f"confgen_shed_{pool}"


SHED_FILTER = "envoy.filters.http.local_ratelimit.shed"
# One token a day: the bucket must hold at least one, so while the share is enforced one
# sheddable request per route and day can pass it (Envoy's `ok` counter shows it).
_SHED_BUCKET = {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "86400s"}


def _shed_config(pool: str) -> Json:
    """The shed share on one sheddable route: a local rate limit whose `filter_enabled` is the
    pool's runtime share (an integer runtime value is a percentage: checked on Envoy 1.40, 50 ->
    ~50 % refused) over an (almost) empty bucket, answered with SHED_STATUS, which the local
    reply mapper makes 429 `overloaded` + retry-after like the breaker's overflow. Chosen over a
    runtime_fraction route with a direct_response (same effect) because Envoy counts these
    refusals per pool (stat_prefix); a direct_response has no route stats in 1.40."""
    return typed("extensions.filters.http.local_ratelimit.v3.LocalRateLimit", {
        "stat_prefix": shed_stat_prefix(pool),
        "token_bucket": _SHED_BUCKET,
        "filter_enabled": {"default_value": {"numerator": 0, "denominator": "HUNDRED"},
                           "runtime_key": shed_runtime_key(pool)},
        "filter_enforced": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
        "status": {"code": SHED_STATUS},
    })


def _with_shed(route: Json, pool: str) -> Json:
    return {**route, "typed_per_filter_config": {**route.get("typed_per_filter_config", {}),
                                                 SHED_FILTER: _shed_config(pool)}}


def _client_header(topo: Topology, clients: tuple[str, ...]) -> Json:
    """Matches the client id api_key_auth forwards (a client-sent copy is removed first in the chain)."""
    assert topo.auth is not None
    return {"name": topo.auth.client_header,
            "string_match": {"safe_regex": {"regex": "^(" + "|".join(re.escape(c) for c in clients) + ")$"}}}


def _by_class(topo: Topology, routes: list[Json], planned: PlannedRoute) -> list[Json]:
    """Each route of a plan entry with what its classes need, in this order:
    - for the critical API-key clients, unless the route is critical itself: a copy matched on
      their client id at HIGH priority (critical wins over everything);
    - if sheddable clients may use a standard route: a copy matched on their client id that
      carries the pool's shed share (`_shed_config`);
    - the route itself (HIGH if critical; carrying the shed share if sheddable)."""
    pool = planned.pool.name
    if planned.traffic_class == "critical":
        return [_classed(r, "critical", pool) for r in routes]
    critical = topo.critical_clients() if topo.auth is not None else ()
    sheddable = planned.sheddable_clients(topo) if topo.auth is not None else ()
    out: list[Json] = []
    for route in routes:
        if critical:
            match = {**route["match"], "headers": [*route["match"].get("headers", []), _client_header(topo, critical)]}
            out.append(_classed({**route, "name": f"{route['name']}/critical", "match": match,
                                 "route": {**route["route"], "priority": "HIGH"}}, "critical", pool))
        if planned.traffic_class == "sheddable":
            out.append(_classed(_with_shed(route, pool), "sheddable", pool))
            continue
        if sheddable:
            match = {**route["match"], "headers": [*route["match"].get("headers", []), _client_header(topo, sheddable)]}
            out.append(_classed(_with_shed({**route, "name": f"{route['name']}/sheddable", "match": match}, pool),
                                "sheddable", pool))
        out.append(_classed(route, "standard", pool))
    return out


def _picker_metadata(topo: Topology) -> Json:
    """What the picker may write (its pick; with global limits, its check's answer for the
    x-ratelimit-* headers) and, with token budgets, what it reads: the request's max output that
    json_to_metadata wrote (the reservation's estimate, as Envoy's own descriptor would carry it)."""
    if not _ratelimit.picker_checks(topo):
        return {"receiving_namespaces": {"untyped": [PICKER_METADATA_NS]}}
    out: Json = {"receiving_namespaces": {"untyped": [PICKER_METADATA_NS, BUDGET_NS]}}
    if _ratelimit.uses_tokens(topo):
        out["forwarding_namespaces"] = {"untyped": [USAGE_NS]}
    return out


def _classed(route: Json, traffic_class: str, pool: str) -> Json:
    """The route with its class and pool as metadata (namespace `confgen`): what `route_classes`
    reads, and what an operator sees in Envoy's config dump."""
    return {**route, "metadata": {"filter_metadata": {META_NS: {"class": traffic_class, "pool": pool}}}}


@dataclass(frozen=True, slots=True)
class RouteClass:
    traffic_class: str  # critical | standard | sheddable
    pool: str


def route_classes(topo: Topology, plan: Plan) -> dict[str, RouteClass]:
    """Each inference route's class and pool by the route's name (names are unique in the route
    table): the endpoint picker reads the name Envoy matched (ext_proc attribute
    ROUTE_NAME_ATTRIBUTE), so a route matched on a header or a path has its class there too."""
    out: dict[str, RouteClass] = {}
    for route in routes(topo, plan):
        meta = route.get("metadata", {}).get("filter_metadata", {}).get(META_NS)
        if meta is not None:
            out[route["name"]] = RouteClass(meta["class"], meta["pool"])
    return out


def route_checks(topo: Topology, plan: Plan) -> dict[str, tuple[tuple[tuple[Json, ...], int | None], ...]]:
    """Each route's request-time rate limit descriptors (actions and hits_addend, as rendered) by the route's
    name, for routes that have any: what the endpoint picker evaluates to decide the budgets itself
    (`_ratelimit.picker_checks`), so the descriptors it sends are the ones Envoy's filter would."""
    out: dict[str, tuple[tuple[tuple[Json, ...], int | None], ...]] = {}
    for route in routes(topo, plan):
        checks = _ratelimit.checks_of(route)
        if checks:
            out[route["name"]] = checks
    return out


def _routes_for(topo: Topology, plan: Plan, planned: PlannedRoute) -> list[Json]:
    """Envoy routes for one plan entry: an explicit route naming models is one route per model."""
    if planned.kind == "default":
        return [_route(topo, plan, planned.name, planned,
                       {"prefix": "/", "dynamic_metadata": [_model_matcher("", present=False)]})]
    if planned.kind == "model":
        assert planned.models is not None
        return [_route(topo, plan, planned.name, planned,
                       {"prefix": "/", "dynamic_metadata": [_model_matcher(planned.models[0])]}, planned.models[0])]
    base: Json = {"prefix": planned.path_prefix or "/"}
    if planned.headers:
        base["headers"] = [_header_matcher(h.name, h.exact, h.prefix, h.present) for h in planned.headers]
    if not planned.models:
        return [_route(topo, plan, planned.name, planned, base)]
    return [
        _route(topo, plan, f"{planned.name}/{mi}", planned, {**base, "dynamic_metadata": [_model_matcher(model)]},
               model)
        for mi, model in enumerate(planned.models)
    ]


def _header_matcher(name: str, exact: str | None, prefix: str | None, present: bool | None) -> Json:
    if exact is not None:
        return {"name": name, "string_match": {"exact": exact}}
    if prefix is not None:
        return {"name": name, "string_match": {"prefix": prefix}}
    return {"name": name, "present_match": True, "invert_match": not present}


MODELS_PATH = "/v1/models"
DIRECT_RESPONSE_MAX = 1024 * 1024  # Envoy's route-wide cap on direct_response bodies (default 4 KB)


def direct_response_limit(topo: Topology) -> int:
    """max_direct_response_body_size_bytes: room for the /v1/models list however many models."""
    return max(DIRECT_RESPONSE_MAX, len(models_body(topo)) if topo.models_endpoint else 0)


def routes(topo: Topology, plan: Plan) -> list[Json]:
    out: list[Json] = []
    if topo.models_endpoint:
        match = {"path": MODELS_PATH, "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]}
        if topo.sidecar.models:
            # The sidecar answers from its health view; when it cannot be reached, the
            # local reply for this path is the full list (see _replies.local_reply_config).
            out.append({"name": "models-list", "match": match, "route": {
                "cluster": SIDECAR_CLUSTER, "timeout": SIDECAR_TIMEOUT,
                "retry_policy": {"retry_on": "connect-failure,reset", "num_retries": 0}}})
        else:
            out.append({
                "name": "models-list",
                "match": match,
                "direct_response": {"status": 200, "body": {
                    "inline_string": models_body(topo)}},
                "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            })
    for planned in plan.routes:
        out.extend(_by_class(topo, _routes_for(topo, plan, planned), planned))
    return out


def listener(topo: Topology, plan: Plan, lst: Listener, secrets: Mapping[str, str]) -> Json:
    shedding = bool(plan.sheddable_pools(topo))
    hcm: Json = {
        "stat_prefix": lst.name,
        "codec_type": "AUTO",
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "stream_idle_timeout": dur(lst.stream_idle_timeout),
        "request_timeout": "0s",  # a generation may take minutes; idle timeouts bound silence
        "request_headers_timeout": dur(lst.request_headers_timeout),
        "route_config": {
            "name": f"{lst.name}-routes",
            "max_direct_response_body_size_bytes": direct_response_limit(topo),
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": routes(topo, plan)}],
        },
        "http_filters": _filters(topo, lst, secrets, plan.restricted, shedding),
        "local_reply_config": local_reply_config(topo, shedding=shedding, picker=picker_wanted(topo)),
        "access_log": [extension(
            "envoy.access_loggers.stdout",
            "extensions.access_loggers.stream.v3.StdoutAccessLog",
            {"log_format": {"json_format": {
                "time": "%START_TIME%", "method": "%REQ(:METHOD)%", "path": "%REQ(:PATH)%",
                "status": "%RESPONSE_CODE%", "flags": "%RESPONSE_FLAGS%",
                "model": f"%DYNAMIC_METADATA({META_NS}:model)%",
                "cluster": "%UPSTREAM_CLUSTER%", "upstream": "%UPSTREAM_HOST%",
                "duration_ms": "%DURATION%", "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
            }}},
        )],
    }
    budget_headers = _ratelimit.budget_response_headers(topo)
    if budget_headers:
        hcm["route_config"]["response_headers_to_add"] = budget_headers
    if topo.auth is not None:
        hcm["access_log"][0]["typed_config"]["log_format"]["json_format"]["client"] = (
            f"%REQ({topo.auth.client_header})%")
    return typed("config.listener.v3.Listener", {
        "name": lst.name,
        "address": {"socket_address": {"address": lst.address, "port_value": lst.port}},
        # json_to_metadata buffers the request body (the buffer filter caps it at max_request_bytes first), and
        # with token budgets the JSON answer too, for its usage: an embeddings batch or an answer with logprobs
        # past 2 MiB was a plain-text 500 after the work was done
        "per_connection_buffer_limit_bytes": max(lst.max_request_bytes, RESPONSE_BUFFER_BYTES)
        if _ratelimit.uses_tokens(topo) else lst.max_request_bytes,
        "filter_chains": [{"filters": [extension(
            "envoy.filters.network.http_connection_manager",
            "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            hcm,
        )]}],
    })


def listeners(topo: Topology, plan: Plan, secrets: Mapping[str, str]) -> list[Json]:
    return [listener(topo, plan, lst, secrets) for lst in topo.listeners]
