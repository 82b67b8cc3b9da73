"""Global limits in Envoy: the rate limit filter, per-route descriptors, usage into metadata.

Per request, Envoy's global rate limit filter asks confgen-sidecar's rate limit service
(cluster `confgen_sidecar_grpc`) about one descriptor per budget that applies to the
request (confgen.limits documents the entries). Every descriptor is in the route's
RateLimitPerRoute, the only place Envoy honours per-descriptor `hits_addend` and
`apply_on_stream_done`:

  requests budget   checked and counted (cost 1) before the request is forwarded
  token budget      checked with cost 0 before the request is forwarded (a key over budget
                    gets 429 before its prompt reaches a worker; the service reserves the
                    request's estimate until its answer ends), and charged when the stream
                    ends with the tokens in dynamic metadata confgen.usage:<key>

The usage keys come from the answer: a JSON body's usage (json_to_metadata response rules) or
a stream's usage chunk (sse_to_metadata, when the client asked stream_options.include_usage).
The request writes only confgen.usage:max_output (max_completion_tokens, else max_tokens; absent,
the route's descriptor says its pool's max_output_tokens), sent with the check with the route's
hold (its pool's request timeout): the service reserves the request's estimate until its end,
or until the hold has passed. At stream end, a descriptor charges the usage (Envoy drops it when there is none: a
refused request, a stream without usage, an error) and a second one (phase: done, cost 0)
settles what is left: a reservation still held is charged its estimate, none charges nothing,
so a stream without usage is charged its estimate. Budgets with fail_closed go through a
second filter instance with failure_mode_deny, the others fail open.

A check that fails open (the service did not answer within limits.store.check_timeout) is not
unlimited: after the global filters, each route carries a local rate limit
(`envoy.filters.http.local_ratelimit.ceiling`, stats `confgen_ceiling.http_local_rate_limit.*`)
with one bucket per requests budget and client (confgen.limits.Ceiling): it sees only the requests
the global check let through, never refuses one the budget admits, and bounds each Envoy to twice
the budget, then the budget per window, on each route while the checks fail open.
"""

from __future__ import annotations

from ..balancing import picker_wanted
from ..limits import (
    ANY_MODEL,
    BODY_BYTES_KEY,
    BUDGET_HEADERS,
    BUDGET_NS,
    CHECK_KEY,
    CHECKED_HEADER,
    CLIENT_KEY,
    HOLD_KEY,
    LIMIT_KEY,
    MAX_OUTPUT_KEY,
    MODEL_KEY,
    PHASE_DONE,
    PHASE_KEY,
    REQUEST_ID_KEY,
    USAGE_KEYS,
    USAGE_NS,
    Budget,
    budget_clients,
    budgets,
    ceilings,
    domain,
    hold_seconds,
    max_output_tokens,
)
from ..model import Pool, Topology
from ._clusters import SIDECAR_GRPC_CLUSTER
from ._proto import Json, dur, extension, typed

FILTER_OPEN = "envoy.filters.http.ratelimit"
FILTER_CLOSED = "envoy.filters.http.ratelimit.fail_closed"
CEILING_FILTER = "envoy.filters.http.local_ratelimit.ceiling"
CEILING_STAT_PREFIX = "confgen_ceiling"
# The default bucket of a descriptor filter (per_key, ceiling): never the one that empties.
NEVER_EMPTY_BUCKET = {"max_tokens": 1_000_000_000, "tokens_per_fill": 1_000_000_000, "fill_interval": "1s"}
_ALL = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}


def uses_tokens(topo: Topology) -> bool:
    return any(b.tokens for b in budgets(topo))


def _filter(topo: Topology, name: str, deny: bool) -> Json:
    store = topo.limits.store
    assert store is not None  # checked on load
    return extension(name, "extensions.filters.http.ratelimit.v3.RateLimit", {
        "domain": domain(topo),
        "stat_prefix": "confgen_global_closed" if deny else "confgen_global",
        "timeout": dur(store.check_timeout),
        "failure_mode_deny": deny,
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        "rate_limited_status": {"code": 429},
        "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": SIDECAR_GRPC_CLUSTER}},
                               "transport_api_version": "V3"},
    })


def filters(topo: Topology) -> list[Json]:
    """The global rate limit filter(s), placed after the route is final (after json_to_metadata)."""
    found = budgets(topo)
    out = []
    if any(not b.limit.fail_closed for b in found):
        out.append(_filter(topo, FILTER_OPEN, deny=False))
    if any(b.limit.fail_closed for b in found):
        out.append(_filter(topo, FILTER_CLOSED, deny=True))
    if ceilings(topo):
        # No limit here: only the routes' own buckets (typed_per_filter_config) act.
        out.append(extension(CEILING_FILTER, "extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                             {"stat_prefix": CEILING_STAT_PREFIX}))
    return out


def _ceiling_config(topo: Topology) -> Json | None:
    """The ceilings on one route: one descriptor per requests budget (and client), produced by the
    same actions as the budget's global descriptor; a request none applies to draws from nothing."""
    found = ceilings(topo)
    if not found:
        return None
    descriptors: list[Json] = []
    clients = 1
    for ceiling in found:
        budget = ceiling.budget
        bucket = {"max_tokens": ceiling.max_tokens, "tokens_per_fill": ceiling.tokens_per_fill,
                  "fill_interval": f"{ceiling.fill_seconds}s"}
        first = {"key": LIMIT_KEY, "value": budget.id}
        if not budget.per_client:
            descriptors.append({"entries": [first], "token_bucket": bucket})
            continue
        # The client entry without a value is a wildcard: Envoy keeps one bucket per client id it
        # sees (only api_key_auth's, the client-sent header is removed first), so the config does
        # not grow with the clients; max_dynamic_descriptors holds every client the budget counts.
        descriptors.append({"entries": [first, {"key": CLIENT_KEY}], "token_bucket": bucket})
        clients = max(clients, len(budget_clients(topo, budget)))
    return typed("extensions.filters.http.local_ratelimit.v3.LocalRateLimit", {
        "stat_prefix": CEILING_STAT_PREFIX,
        "token_bucket": NEVER_EMPTY_BUCKET,
        "always_consume_default_token_bucket": False,
        "filter_enabled": _ALL,
        "filter_enforced": _ALL,
        "descriptors": descriptors,
        "rate_limits": [{"actions": _selector(topo, c.budget)} for c in found],
        "max_dynamic_descriptors": clients,
    })


def usage_request_rules() -> list[Json]:
    """json_to_metadata request rules: the request's max output, for its reservation (see above).

    STRING: Envoy's metadata rate limit action takes string values only (a NUMBER was
    measured to fall back to the action's default)."""
    rules: list[Json] = []
    # later rules overwrite earlier ones: max_completion_tokens wins over max_tokens; neither
    # there, the route's descriptor default (its pool's max_output_tokens) applies
    rules.append({"selectors": [{"key": "max_tokens"}],
                  "on_present": {"metadata_namespace": USAGE_NS, "key": MAX_OUTPUT_KEY, "type": "STRING"}})
    rules.append({"selectors": [{"key": "max_completion_tokens"}],
                  "on_present": {"metadata_namespace": USAGE_NS, "key": MAX_OUTPUT_KEY, "type": "STRING"}})
    return rules


def usage_response_rules() -> list[Json]:
    """json_to_metadata response rules: a JSON body's usage."""
    return [{
        "selectors": [{"key": "usage"}, {"key": key}],
        "on_present": {"metadata_namespace": USAGE_NS, "key": key, "type": "NUMBER"},
    } for key in sorted(set(USAGE_KEYS.values()))]


def sse_filter() -> Json:
    """sse_to_metadata: the usage chunk of a stream (stream_options.include_usage)."""
    return extension("envoy.filters.http.sse_to_metadata", "extensions.filters.http.sse_to_metadata.v3.SseToMetadata", {
        "response_rules": {"content_parser": extension(
            "envoy.content_parsers.json", "extensions.content_parsers.json.v3.JsonContentParser",
            {"rules": [{"rule": {
                "selectors": [{"key": "usage"}, {"key": key}],
                "on_present": {"metadata_namespace": USAGE_NS, "key": key, "type": "NUMBER"},
            }} for key in sorted(set(USAGE_KEYS.values()))]},
        )},
    })


def _selector(topo: Topology, budget: Budget) -> list[Json]:
    """The actions naming the budget (and its client), producing no descriptor when it does not apply."""
    if not budget.per_client:
        return [{"generic_key": {"descriptor_key": LIMIT_KEY, "descriptor_value": budget.id}}]
    assert topo.auth is not None
    header = topo.auth.client_header
    if budget.clients is not None:
        first: Json = {"header_value_match": {
            "descriptor_key": LIMIT_KEY, "descriptor_value": budget.id, "expect_match": True,
            "headers": [{"name": header, "string_match": {"exact": c}} for c in budget.clients[:1]]}}
    elif budget.except_clients:
        # client names are [a-z0-9_-] (the topology's pattern): safe inside a regex alternation
        regex = "^(" + "|".join(budget.except_clients) + ")$"
        first = {"header_value_match": {
            "descriptor_key": LIMIT_KEY, "descriptor_value": budget.id, "expect_match": False,
            "headers": [{"name": header, "string_match": {"safe_regex": {"regex": regex}}}]}}
    else:
        first = {"generic_key": {"descriptor_key": LIMIT_KEY, "descriptor_value": budget.id}}
    return [first, {"request_headers": {"header_name": header, "descriptor_key": CLIENT_KEY}}]


def picker_checks(topo: Topology) -> bool:
    """The endpoint picker decides the budgets (its ext_proc call) and Envoy's filter only the requests
    it did not check: with global limits and the picker in the chain."""
    return picker_wanted(topo) and bool(budgets(topo))


# Produces the descriptor only while the request is not marked checked by the picker (see limits.CHECKED_HEADER).
_UNCHECKED: Json = {"header_value_match": {
    "descriptor_key": CHECK_KEY, "descriptor_value": "envoy", "expect_match": False,
    "headers": [{"name": CHECKED_HEADER, "present_match": True}]}}


def _entries(topo: Topology, budget: Budget, model: str | None, pool: Pool | None) -> list[Json]:
    actions = _selector(topo, budget)
    chain: list[Pool | None] = [*_chain(topo, pool)] or [None]
    if budget.limit.per_model:
        actions.append({"generic_key": {"descriptor_key": MODEL_KEY, "descriptor_value": model or ANY_MODEL}})
    unchecked = [_UNCHECKED] if picker_checks(topo) else []
    if not budget.tokens:
        return [{"actions": [*actions, *unchecked]}]
    # Envoy sets x-request-id itself on outside requests (use_remote_address, ids not preserved):
    # it ties the request's reservation to its charge, and no client can choose it.
    request_id = {"request_headers": {"header_name": "x-request-id", "descriptor_key": REQUEST_ID_KEY}}
    hold = max(hold_seconds(p) for p in chain)
    check = [*actions, *unchecked, request_id,
             {"metadata": {"descriptor_key": MAX_OUTPUT_KEY, "source": "DYNAMIC",
                           "metadata_key": {"key": USAGE_NS, "path": [{"key": MAX_OUTPUT_KEY}]},
                           "default_value": str(max(max_output_tokens(p) for p in chain))}},
             {"request_headers": {"header_name": "content-length", "descriptor_key": BODY_BYTES_KEY,
                                  "skip_if_absent": True}},
             {"generic_key": {"descriptor_key": HOLD_KEY, "descriptor_value": str(hold)}}]
    return [
        # checked (cost 0) and the request's estimate reserved: refused once spent + reserved reach the budget
        {"actions": check, "hits_addend": {"number": 0}},
        # charged the answer's usage when the stream ends, the reservation released (no usage in
        # metadata: Envoy drops this descriptor)
        {"actions": [*actions, request_id], "apply_on_stream_done": True,
         "hits_addend": {"format": f"%DYNAMIC_METADATA({USAGE_NS}:{USAGE_KEYS[budget.limit.unit]})%"}},
        # then, always: a reservation still held (an answer without usage) is charged its estimate
        {"actions": [*actions, request_id, {"generic_key": {"descriptor_key": PHASE_KEY,
                                                             "descriptor_value": PHASE_DONE}}],
         "apply_on_stream_done": True, "hits_addend": {"number": 0}},
    ]


def _chain(topo: Topology, pool: Pool | None) -> list[Pool]:
    """The pool and the fallbacks its traffic may move to (an answer may come from any of them)."""
    by_name = {p.name: p for p in topo.pools}
    out: list[Pool] = []
    while pool is not None and pool not in out:
        out.append(pool)
        pool = by_name.get(pool.fallback) if pool.fallback is not None else None
    return out


def per_route(topo: Topology, model: str | None, pool: Pool | None = None) -> Json:
    """typed_per_filter_config entries of one route (model: the one it serves, if exactly one;
    pool: the pool it sends to, whose max_output_tokens and request timeout bound a reservation)."""
    found = budgets(topo)
    out: Json = {}
    for name, closed in ((FILTER_OPEN, False), (FILTER_CLOSED, True)):
        chosen = [b for b in found if b.limit.fail_closed == closed]
        if chosen:
            out[name] = typed("extensions.filters.http.ratelimit.v3.RateLimitPerRoute", {
                "rate_limits": [entry for b in chosen for entry in _entries(topo, b, model, pool)]})
    ceiling = _ceiling_config(topo)
    if ceiling is not None:
        out[CEILING_FILTER] = ceiling
    return out


def checks_of(route: Json) -> tuple[tuple[tuple[Json, ...], int | None], ...]:
    """The request-time descriptors of a rendered route (both filters', fail_closed last), in the order
    Envoy evaluates them, each as (its actions, its fixed hits_addend or None for the request's 1): what
    the picker evaluates for a request on that route when it checks the budgets itself. The stream-done
    descriptors (the charges) stay Envoy's."""
    out: list[tuple[tuple[Json, ...], int | None]] = []
    per_filter = route.get("typed_per_filter_config", {})
    for name in (FILTER_OPEN, FILTER_CLOSED):
        config = per_filter.get(name)
        if config is None:
            continue
        for entry in config["rate_limits"]:
            if not entry.get("apply_on_stream_done"):
                hits = entry.get("hits_addend", {}).get("number")
                out.append((tuple(entry["actions"]), None if hits is None else int(hits)))
    return tuple(out)


def budget_response_headers(topo: Topology) -> list[Json]:
    """The route table's x-ratelimit-* response headers from the picker's check (BUDGET_NS metadata);
    empty, and so left out, when the picker did not check (Envoy's filter then adds its own)."""
    if not picker_checks(topo):
        return []
    return [{"header": {"key": header, "value": f"%DYNAMIC_METADATA({BUDGET_NS}:{key})%"},
             "append_action": "ADD_IF_ABSENT", "keep_empty_value": False}
            for key, header in BUDGET_HEADERS.items()]
