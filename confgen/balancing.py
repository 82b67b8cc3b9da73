"""Balancing policies, one table: what each policy is, and what each target runs for it.

    POLICIES[name] -> BalancingPolicy(hashing, envoy lb_policy, nginx method)

`is_hashing` is THE test for "this policy keeps a session on one worker" (it needs
`hash_on`; the validator, the plan and both renderers ask it here). A new policy is one
line here plus its name in `model.Policy` (which the schema and the decoder read).
`uses_picker` is THE test for "Envoy asks confgen-sidecar's endpoint picker" (ext_proc).

`auto` (the default) is not a row: `choose` resolves it per pool to `prefix_affinity` (the endpoint
picker, which predicts each request's finish time on each worker from the engines' metrics) where
the picker can work as rendered, and to `least_request` where it cannot, with the reason
(`validate` prints it). Every reader asks `policy_of` / `uses_picker` with the topology, never
`pool.balancing.policy` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .limits import needs_store
from .model import (
    PICKER_MAX_BODY_BYTES,
    Balancing,
    Pool,
    Topology,
    admin_tcp,
    grpc_reachable,
    grpc_transport,
    split_address,
)

__all__ = ["AUTO", "POLICIES", "BalancingPolicy", "Choice", "choose", "grpc_wanted", "is_hashing", "nginx_method",
           "picker_pools", "picker_wanted", "policy_of", "uses_picker"]

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class BalancingPolicy:
    hashing: bool  # keeps a session on one worker: needs hash_on
    envoy: str  # Envoy's Cluster.lb_policy
    # nginx's balancing method: "round_robin" (its default), "random", "random_two", "least_conn", "hash"
    nginx: Callable[[Balancing], str]
    # Envoy asks confgen-sidecar's endpoint picker (ext_proc) per request and obeys it
    # (override_host over the pool's endpoints, `envoy` as the fallback). nginx has no
    # picker: it runs `nginx` (validate --nginx warns).
    picker: bool = False


def _least_request_nginx(bal: Balancing) -> str:
    # nginx samples two (random two least_conn) or all workers (least_conn); see nginx._features.
    return "random_two" if bal.choice_count == 2 else "least_conn"


POLICIES: dict[str, BalancingPolicy] = {
    "round_robin": BalancingPolicy(hashing=False, envoy="ROUND_ROBIN", nginx=lambda _: "round_robin"),
    "random": BalancingPolicy(hashing=False, envoy="RANDOM", nginx=lambda _: "random"),
    "least_request": BalancingPolicy(hashing=False, envoy="LEAST_REQUEST", nginx=_least_request_nginx),
    "ring_hash": BalancingPolicy(hashing=True, envoy="RING_HASH", nginx=lambda _: "hash"),
    "maglev": BalancingPolicy(hashing=True, envoy="MAGLEV", nginx=lambda _: "hash"),
    "prefix_affinity": BalancingPolicy(hashing=False, envoy="LEAST_REQUEST", nginx=_least_request_nginx, picker=True),
}


# Engines whose metrics the picker's predictor learns from (queue, KV cache, token timings:
# sidecar/observe/engines.py). `openai` is any OpenAI-compatible server: no metrics to learn from.
PREDICTABLE_ENGINES = frozenset({"vllm", "sglang", "tgi", "llamacpp"})
# ... of which these report no time per output token (TGI: only a per-request mean histogram): the picker
# cannot predict a finish time there and places by load and prefix (its fallback rule)
_NO_TOKEN_TIMING = frozenset({"tgi"})


@dataclass(frozen=True, slots=True)
class Choice:
    """The policy a pool runs, and why when `auto` chose it ("" for a policy the topology names)."""

    policy: str
    reason: str = ""


def choose(topo: Topology, pool: Pool) -> Choice:
    """The policy `pool` runs. An explicit policy is itself; `auto` is the endpoint picker unless
    something about this pool or this topology keeps the picker from working as rendered (then
    least_request, which is also what Envoy runs whenever the picker does not answer)."""
    if pool.balancing.policy != AUTO:
        return Choice(pool.balancing.policy)
    blocker = _picker_blocker(topo, pool)
    if blocker:
        return Choice("least_request", f"auto is least_request here: {blocker}")
    if pool.engine in _NO_TOKEN_TIMING:
        return Choice("prefix_affinity", "auto is the endpoint picker (prefix_affinity); tgi reports no per-token "
                      "timing, so it places requests by load and prefix (its fallback rule), not by predicted finish")
    return Choice("prefix_affinity", "auto is the endpoint picker (prefix_affinity): it predicts each request's "
                  f"finish time on every worker from what {pool.engine} reports")


def _picker_blocker(topo: Topology, pool: Pool) -> str:
    """Why the picker cannot be this pool's default, or "": what keeps it from working as rendered,
    so a default never turns a valid topology invalid. Each reason but the ADS one is a check that
    refuses a named prefix_affinity too; two control planes on one host are not refused for it (yet)."""
    if pool.engine not in PREDICTABLE_ENGINES:
        return f"engine {pool.engine} reports no load metrics for the endpoint picker to predict from"
    if pool.discovery == "strict_dns":
        return "discovery strict_dns: Envoy resolves the workers itself and no sidecar sees them"
    if not grpc_reachable(topo):
        return ("Envoy reaches the sidecar's gRPC services beyond loopback only over mutual TLS: set "
                "sidecar.grpc_tls for the endpoint picker")
    big = [lst.name for lst in topo.listeners if lst.max_request_bytes > PICKER_MAX_BODY_BYTES]
    if big:
        return (f"listener {big[0]!r} takes bodies over {PICKER_MAX_BODY_BYTES} bytes (max_request_bytes), more "
                "than the endpoint picker reads in one message")
    if topo.envoy.xds.mode == "ads":
        hosts = [parts[0] for parts in map(split_address, topo.envoy.xds.servers) if parts is not None]
        if len(set(hosts)) < len(hosts):
            return ("two control planes on one host (envoy.xds.servers) would both serve the endpoint picker on "
                    "sidecar.grpc_port")
    taken = {topo.sidecar.port, admin_tcp(topo)[1], *(lst.port for lst in topo.listeners)}
    if topo.sidecar.grpc_port in taken and grpc_transport(topo) != "unix":
        return f"sidecar.grpc_port {topo.sidecar.grpc_port} is taken by another of the product's servers"
    return ""


def policy_of(topo: Topology, pool: Pool) -> str:
    """The concrete policy `pool` runs (`auto` resolved): a key of POLICIES."""
    return choose(topo, pool).policy


def uses_picker(topo: Topology, pool: Pool) -> bool:
    """Whether Envoy asks the sidecar's endpoint picker for every request of this pool."""
    return POLICIES[policy_of(topo, pool)].picker


def picker_wanted(topo: Topology) -> bool:
    """Whether any pool of `topo` runs the endpoint picker."""
    return any(uses_picker(topo, pool) for pool in topo.pools)


def picker_pools(topo: Topology) -> tuple[str, ...]:
    """The pools whose requests the endpoint picker sees, and so admits per request."""
    return tuple(pool.name for pool in topo.pools if uses_picker(topo, pool))


def is_hashing(policy: str) -> bool:
    """Whether `policy` keeps a session on one worker (consistent hashing on `hash_on`)."""
    return policy != AUTO and POLICIES[policy].hashing


def nginx_method(bal: Balancing) -> str:
    """nginx's method for a pool (nginx has no picker: `auto` and prefix_affinity balance as least_request)."""
    return POLICIES["least_request" if bal.policy == AUTO else bal.policy].nginx(bal)


def grpc_wanted(topo: Topology) -> bool:
    """THE test for "the sidecar (or the control plane) serves gRPC to Envoy": the endpoint picker (a pool
    on it), the rate limit service (global limits), or both. Its cluster, ports, transport and
    deployment follow from it."""
    return picker_wanted(topo) or needs_store(topo)
