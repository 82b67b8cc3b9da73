"""Balancing policies, one table: what each policy is, and what each target runs for it.

    POLICIES[name] -> BalancingPolicy(hashing, envoy lb_policy, nginx method)

`is_hashing` is THE test for "this policy keeps a session on one worker" (it needs
`hash_on`; the validator, the plan and both renderers ask it here). A new policy is one
line here plus its name in `model.Policy` (which the schema and the decoder read).
`uses_picker` is THE test for "Envoy asks confgen-sidecar's endpoint picker" (ext_proc).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .model import Balancing

__all__ = ["POLICIES", "BalancingPolicy", "is_hashing", "nginx_method", "uses_picker"]


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


def is_hashing(policy: str) -> bool:
    """Whether `policy` keeps a session on one worker (consistent hashing on `hash_on`)."""
    return POLICIES[policy].hashing


def uses_picker(policy: str) -> bool:
    """Whether Envoy asks the sidecar's endpoint picker for every request of this policy's pools."""
    return POLICIES[policy].picker


def nginx_method(bal: Balancing) -> str:
    return POLICIES[bal.policy].nginx(bal)
