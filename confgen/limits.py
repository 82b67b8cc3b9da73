"""Rate limits resolved once: each proxy's local buckets and the fleet's global budgets.

The renderers (Envoy's filters, nginx's limit_req) read the local side; Envoy's global rate
limit filter and confgen-sidecar's rate limit service read the same `Budget` list, so the
descriptor Envoy sends and the limit the service applies come from one place:

    descriptor  [("confgen_limit", budget.id), ("client", <client>)?, ("model", <model>)?,
                 token budgets: ("request_id", <x-request-id>), and when the request is checked
                 ("max_output", <tokens>), ("body_bytes", <content-length>)?, ("hold_s", <seconds>)]
    Redis key   confgen:<domain>:<budget.id>:<client>:<model>:<window start>

A budget id is its place in the topology ("global/0", "per_key/1", "client/alice/0"), so a
topology edit that changes an amount keeps counting in the same key.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import WINDOW_SECONDS, Pool, RateLimit, Topology, limit_list

# Descriptor entry keys (Envoy -> the rate limit service); every descriptor starts with the budget.
LIMIT_KEY = "confgen_limit"
CLIENT_KEY = "client"
MODEL_KEY = "model"
ANY_MODEL = "*"  # the model entry of a per_model budget on a route that names no model
# Token budgets only: the request's id (Envoy's x-request-id, which it sets itself for outside
# requests) ties a request's reservation to its charge; the reservation is the request's
# max output (max_completion_tokens, max_tokens, else its pool's max_output_tokens or
# DEFAULT_MAX_OUTPUT_TOKENS) plus, for prompt tokens, its body's length / BYTES_PER_TOKEN.
REQUEST_ID_KEY = "request_id"
MAX_OUTPUT_KEY = "max_output"
BODY_BYTES_KEY = "body_bytes"
DEFAULT_MAX_OUTPUT_TOKENS = 4096  # a pool without max_output_tokens: what a request without max_tokens reserves
BYTES_PER_TOKEN = 4
# The route's own bound on how long its answer may take (its pool's timeouts.request, or
# RESERVATION_HOLD_S when that is 0s: no timeout): a reservation whose answer has not come by
# then, plus RESERVATION_MARGIN_S, is dropped. A body without content-length (chunked) reserves
# the largest body the listener accepts (max_request_bytes / BYTES_PER_TOKEN prompt tokens).
HOLD_KEY = "hold_s"
# At stream end a second descriptor per token budget ("phase": "done", cost 0) settles a
# reservation the answer's usage did not (no usage: its estimate is charged).
PHASE_KEY = "phase"
PHASE_DONE = "done"
RESERVATION_HOLD_S = 600  # the hold of a route whose pool has no request timeout
RESERVATION_MARGIN_S = 30  # past the request's own timeout: the stream-done call's own delay

# With the endpoint picker in the chain, the picker decides the budgets in the ext_proc call every
# request already makes (one Redis script, no second gRPC call), and marks the request checked with
# CHECKED_HEADER (a client's copy is removed first); the rate limit filter's request-time
# descriptors carry an action that produces nothing when the header is there, so Envoy calls the
# service itself only for a request the picker did not check (skipped, behind, unreachable).
CHECKED_HEADER = "x-confgen-budgets-checked"
CHECK_KEY = "confgen_check"  # the marker's descriptor entry (the service ignores it)
# The picker's check answer, for the x-ratelimit-* headers of an admitted request's response
# (Envoy's rate limit filter adds them itself when it is the one that checked).
BUDGET_NS = "confgen.budgets"
BUDGET_HEADERS: dict[str, str] = {
    "limit": "x-ratelimit-limit",
    "remaining": "x-ratelimit-remaining",
    "reset": "x-ratelimit-reset",
}

# Dynamic metadata the response's usage is written to (json_to_metadata for JSON bodies,
# sse_to_metadata for streams), read by the stream-done descriptors' hits_addend.
USAGE_NS = "confgen.usage"
USAGE_KEYS: dict[str, str] = {
    "input_tokens": "prompt_tokens",
    "output_tokens": "completion_tokens",
    "total_tokens": "total_tokens",
}


@dataclass(frozen=True)
class Budget:
    """One global limit: who it counts, in what, over which window."""

    id: str  # descriptor value and Redis key part; its topology place
    path: str  # the topology field, for messages
    limit: RateLimit
    per_client: bool  # counted per API-key client (else: all requests of the listener together)
    clients: tuple[str, ...] | None  # the clients it applies to; None: every client not in `except_clients`
    except_clients: tuple[str, ...] = ()

    @property
    def amount(self) -> int:
        return self.limit.rate

    @property
    def window_seconds(self) -> int:
        return WINDOW_SECONDS[self.limit.window or "second"]

    @property
    def tokens(self) -> bool:
        return self.limit.unit != "requests"


def domain(topo: Topology) -> str:
    """The rate limit domain Envoy sends: one per topology, so two deployments can share a store."""
    return f"confgen.{topo.name}"


def _overridden(topo: Topology) -> dict[str, list[RateLimit]]:
    if topo.auth is None:
        return {}
    return {k.client: limit_list(k.rate_limit) for k in topo.auth.api_keys if k.rate_limit is not None}


def local_listener_limit(topo: Topology) -> RateLimit | None:
    """The listener-wide token bucket each proxy keeps (the checks allow at most one)."""
    return next((lim for lim in limit_list(topo.limits.global_) if lim.scope == "local"), None)


def local_client_limits(topo: Topology) -> list[tuple[str, RateLimit]]:
    """(client, its token bucket) for every client with a local limit (its own or limits.per_key)."""
    if topo.auth is None:
        return []
    default = [lim for lim in limit_list(topo.limits.per_key) if lim.scope == "local"]
    overrides = _overridden(topo)
    out = []
    for key in topo.auth.api_keys:
        own = overrides.get(key.client)
        local = [lim for lim in own if lim.scope == "local"] if own is not None else default
        if local:
            out.append((key.client, local[0]))
    return out


def budgets(topo: Topology) -> list[Budget]:
    """Every scope: global limit, in topology order."""
    out: list[Budget] = []
    for i, lim in enumerate(limit_list(topo.limits.global_)):
        if lim.scope == "global":
            out.append(Budget(f"global/{i}", _place("limits.global", topo.limits.global_, i), lim, False, None))
    overrides = _overridden(topo)
    for i, lim in enumerate(limit_list(topo.limits.per_key)):
        if lim.scope == "global":
            out.append(Budget(f"per_key/{i}", _place("limits.per_key", topo.limits.per_key, i), lim, True, None,
                              tuple(sorted(overrides))))
    if topo.auth is not None:
        for ki, key in enumerate(topo.auth.api_keys):
            for i, lim in enumerate(limit_list(key.rate_limit)):
                if lim.scope == "global":
                    out.append(Budget(f"client/{key.client}/{i}",
                                      _place(f"auth.api_keys[{ki}].rate_limit", key.rate_limit, i),
                                      lim, True, (key.client,)))
    return out


@dataclass(frozen=True)
class Ceiling:
    """Each Envoy's own bound on one requests budget, for when its check fails open (the rate
    limit service did not answer within limits.store.check_timeout): a token bucket of twice the
    amount, refilled by the amount every window. It sees only the requests the global check let
    through, so it never refuses one the budget admits (at most the amount in each fixed window is
    at most twice the amount in any span of a window, and the amount per window in the long run);
    while the checks fail open it admits at most that, per Envoy and route, never unlimited."""

    budget: Budget
    max_tokens: int
    tokens_per_fill: int
    fill_seconds: int


def ceilings(topo: Topology) -> list[Ceiling]:
    """The ceiling of every requests budget that fails open (fail_closed budgets are refused by
    Envoy when the service cannot answer; token budgets are known only at the answer's end)."""
    return [Ceiling(b, 2 * b.amount, b.amount, b.window_seconds)
            for b in budgets(topo) if not b.tokens and not b.limit.fail_closed]


def budget_clients(topo: Topology, budget: Budget) -> tuple[str, ...]:
    """The API-key clients a per-client budget counts (its own client, or every client not excepted)."""
    if budget.clients is not None:
        return budget.clients
    if topo.auth is None:
        return ()
    return tuple(k.client for k in topo.auth.api_keys if k.client not in budget.except_clients)


def _place(path: str, value: object, index: int) -> str:
    return f"{path}[{index}]" if isinstance(value, list) else path


def needs_store(topo: Topology) -> bool:
    return bool(budgets(topo))


def max_output_tokens(pool: Pool | None) -> int:
    """What a request without max_tokens may generate on `pool` (reserved until its answer ends)."""
    if pool is None or pool.max_output_tokens is None:
        return DEFAULT_MAX_OUTPUT_TOKENS
    return pool.max_output_tokens


def hold_seconds(pool: Pool | None) -> int:
    """How long a reservation of a request to `pool` waits for its answer: the request's own timeout."""
    if pool is None or pool.timeouts.request.ms <= 0:
        return RESERVATION_HOLD_S
    return max(1, -(-pool.timeouts.request.ms // 1000))


def envoys(topo: Topology) -> int:
    """The rate limit services counting in the store, each with its own local floor: limits.store.envoys,
    else one per Envoy (a sidecar beside each: kubernetes.replicas), or with envoy.xds.mode ads one per
    control-plane server (the control plane serves every Envoy's checks; docs/limits.md)."""
    store = topo.limits.store
    if store is not None and store.envoys is not None:
        return store.envoys
    if topo.envoy.xds.mode == "ads":
        return max(1, len(topo.envoy.xds.servers))
    return topo.kubernetes.replicas


def floor_amount(budget: Budget, count: int) -> int:
    """What one of `count` Envoys admits of `budget` per window while the store is away: its
    share, at least 1 (never unlimited, never nothing: a client keeps a trickle)."""
    return max(1, budget.amount // max(1, count))


def clients_losing_per_key(topo: Topology) -> list[tuple[int, str, list[str]]]:
    """(api_keys index, client, the limits.per_key scopes it loses) for every client whose own
    rate_limit replaces limits.per_key while naming fewer kinds of limit than it."""
    if topo.auth is None:
        return []
    default = limit_list(topo.limits.per_key)
    if not default:
        return []
    out = []
    for ki, key in enumerate(topo.auth.api_keys):
        if key.rate_limit is None:
            continue
        own = {(lim.scope, lim.unit) for lim in limit_list(key.rate_limit)}
        lost = [f"{lim.scope} {lim.unit}" for lim in default if (lim.scope, lim.unit) not in own]
        if lost:
            out.append((ki, key.client, lost))
    return out
