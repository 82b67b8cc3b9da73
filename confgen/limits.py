"""Rate limits resolved once: each proxy's local buckets and the fleet's global budgets.

The renderers (Envoy's filters, nginx's limit_req) read the local side; Envoy's global rate
limit filter and confgen-sidecar's rate limit service read the same `Budget` list, so the
descriptor Envoy sends and the limit the service applies come from one place:

    descriptor  [("confgen_limit", budget.id), ("client", <client>)?, ("model", <model>)?,
                 token budgets: ("request_id", <x-request-id>), and when the request is checked
                 ("max_output", <tokens>), ("body_bytes", <content-length>)?]
    Redis key   confgen:<domain>:<budget.id>:<client>:<model>:<window start>

A budget id is its place in the topology ("global/0", "per_key/1", "client/alice/0"), so a
topology edit that changes an amount keeps counting in the same key.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import WINDOW_SECONDS, RateLimit, Topology, limit_list

# Descriptor entry keys (Envoy -> the rate limit service); every descriptor starts with the budget.
LIMIT_KEY = "confgen_limit"
CLIENT_KEY = "client"
MODEL_KEY = "model"
ANY_MODEL = "*"  # the model entry of a per_model budget on a route that names no model
# Token budgets only: the request's id (Envoy's x-request-id, which it sets itself for outside
# requests) ties a request's reservation to its charge; the reservation is the request's
# max output (max_completion_tokens, max_tokens or ESTIMATE_OUTPUT_TOKENS) plus, for prompt
# tokens, its body's length / BYTES_PER_TOKEN.
REQUEST_ID_KEY = "request_id"
MAX_OUTPUT_KEY = "max_output"
BODY_BYTES_KEY = "body_bytes"
ESTIMATE_OUTPUT_TOKENS = 256
BYTES_PER_TOKEN = 4
# At stream end a second descriptor per token budget ("phase": "done", cost 0) settles a
# reservation the answer's usage did not (no usage: its estimate is charged).
PHASE_KEY = "phase"
PHASE_DONE = "done"
RESERVATION_HOLD_S = 600  # a reservation whose answer has not come after this (or its window) is dropped

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


def _place(path: str, value: object, index: int) -> str:
    return f"{path}[{index}]" if isinstance(value, list) else path


def needs_store(topo: Topology) -> bool:
    return bool(budgets(topo))
