"""GET /v1/models from the sidecar's health view: what the proxy answers clients with.

The proxies route GET /v1/models here (Envoy through a cluster of its own, nginx's njs
through a subrequest) and fall back to the topology's full list when the sidecar cannot be
reached. A model is listed when some pool serving it has, somewhere in its fallback chain,
a pool with a worker serving (in rotation, and not failing: one the ejection cap keeps
published is failing all the same). Pools the sidecar does not
publish (discovery strict_dns: Envoy resolves and checks them itself) count as in rotation,
and so does everything before the first probe cycle: the sidecar never hides a model it has
no evidence against. The list itself (names, order, bytes) comes from confgen._openai, the
same code that renders the static answer.
"""

from __future__ import annotations

from confgen._openai import models_body
from confgen.model import Topology
from sidecar.fleet import Snapshot

__all__ = ["in_rotation", "models_answer"]


def in_rotation(topo: Topology, snap: Snapshot) -> set[str] | None:
    """Pools with a worker serving now; None when the sidecar has no view it can trust: before
    its first cycle, or when every worker it probes fails at once (more likely its own view is
    wrong, a partition or a bad health path, than the whole fleet dead: the rule the
    ejection cap follows, sidecar.decide.state)."""
    if snap.cycles == 0:
        return None
    endpoints = [ep for pool in snap.pools for ep in pool.endpoints]
    if endpoints and not any(ep.serving for ep in endpoints):
        return None
    published = {pool.name: pool for pool in snap.pools}
    live = {p.name for p in topo.pools if p.name not in published}
    live |= {name for name, pool in published.items() if any(ep.serving for ep in pool.endpoints)}
    return live


def models_answer(topo: Topology, snap: Snapshot) -> str:
    """The body of GET /v1/models (OpenAI's list object)."""
    return models_body(topo, in_rotation(topo, snap))
