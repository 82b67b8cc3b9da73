"""The routing plan: what the topology means for routing, resolved once, read by every target.

    plan(topo) -> Plan
        routes    in the order a proxy tries them: the explicit routes (one entry per route),
                  then one per served model name no explicit route claims (to its primary
                  pool), then the default pool for requests that name no model
        pools     each pool with its fallback chain and whether it hashes

Every rule that decides where a request goes lives here once: the fallback chain, the
primary pool of a model name served by several pools, the implicit per-model routes, the
effective client rule of a route (its own, else its pool's). The validator (`_checks`)
judges the inputs these rules read (unknown pools, cycles, ambiguous names) and the
renderers read only the plan, never the validator. The functions stay total on a topology
that failed validation (they stop at a cycle, skip an unknown name), because the validator
itself calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .balancing import is_hashing
from .model import HeaderMatch, Pool, Topology

__all__ = ["Plan", "PlannedPool", "PlannedRoute", "fallback_chain", "implicit_model_routes", "plan",
           "primary_pool_for", "sheddable_pools"]


@dataclass(frozen=True, slots=True)
class PlannedRoute:
    """One entry of the route table, tried in order."""

    name: str  # the topology's route name; "model/<name>" for implicit routes; "default"
    kind: Literal["explicit", "model", "default"]  # from `routes`, one per served model, the default pool
    pool: Pool
    clients: tuple[str, ...] | None  # who may use it (None: anyone authenticated, or no auth)
    models: tuple[str, ...] | None = None  # the body's `model` is one of these (None: any)
    path_prefix: str | None = None
    headers: tuple[HeaderMatch, ...] | None = None
    traffic_class: str = "standard"  # critical: Envoy's HIGH priority (the sidecar never lowers its limit);
    # sheddable: refused first under overload (a runtime share the sidecar raises; see sheddable_pools)

    def sheddable_clients(self, topo: Topology) -> tuple[str, ...]:
        """The sheddable API-key clients who may use this route when it is standard (a critical
        route stays critical for them; a sheddable one is sheddable for everyone already)."""
        if self.traffic_class != "standard":
            return ()
        return tuple(c for c in topo.sheddable_clients() if self.clients is None or c in self.clients)

    def carries_sheddable(self, topo: Topology) -> bool:
        return self.traffic_class == "sheddable" or bool(self.sheddable_clients(topo))


@dataclass(frozen=True, slots=True)
class PlannedPool:
    pool: Pool
    chain: tuple[Pool, ...]  # the pool, then the pools it falls back to, in order
    hashing: bool  # balancing keeps a session on one worker (ring_hash, maglev)

    @property
    def name(self) -> str:
        return self.pool.name

    @property
    def next_pool(self) -> Pool | None:
        """Where requests go when this pool's attempts failed (None: the last resort)."""
        return self.chain[1] if len(self.chain) > 1 else None


@dataclass(frozen=True, slots=True)
class Plan:
    routes: tuple[PlannedRoute, ...]
    pools: tuple[PlannedPool, ...]  # in topology order
    restricted: bool  # some route limits its clients (the per-route client filter is needed)

    def sheddable_pools(self, topo: Topology) -> tuple[str, ...]:
        """Pools some sheddable traffic is routed to (a route's class, or a sheddable client on a
        standard route): the render refuses a runtime share of it first under overload."""
        return tuple(dict.fromkeys(r.pool.name for r in self.routes if r.carries_sheddable(topo)))

    def pool(self, name: str) -> PlannedPool:
        for planned in self.pools:
            if planned.name == name:
                return planned
        raise KeyError(name)


def fallback_chain(topo: Topology, pool: Pool) -> list[Pool]:
    """The pool and the pools it falls back to, in order (stops at a cycle or unknown)."""
    by_name = {p.name: p for p in topo.pools}
    chain, seen = [pool], {pool.name}  # names, not pools: comparing whole pools made a long chain cubic
    while (nxt := chain[-1].fallback) in by_name and nxt not in seen:
        chain.append(by_name[nxt])
        seen.add(nxt)
    return chain


def primary_pool_for(topo: Topology, model: str) -> Pool | None:
    """The pool that answers `model` by the implicit per-model routes, if unambiguous.

    A name served by several pools belongs to the one whose fallback chain holds all the
    others (70B -> 7B both serving "chat": the 70B pool answers, the 7B one is its fallback).
    """
    serving = [p for p in topo.pools if model in p.served_names]
    for pool in serving:
        chain = {p.name for p in fallback_chain(topo, pool)}
        if all(p.name in chain for p in serving):
            return pool
    return None


def implicit_model_routes(topo: Topology) -> list[tuple[str, Pool]]:
    """(model name, pool) for every served name no explicit route claims, in topology order."""
    out: list[tuple[str, Pool]] = []
    seen: set[str] = set()
    for pool in topo.pools:
        for model in pool.served_names:
            if model in seen:
                continue
            seen.add(model)
            owner = primary_pool_for(topo, model)
            if owner is not None:  # None: claimed by an explicit route (checked on load)
                out.append((model, owner))
    return out


def _clients(own: list[str] | None, pool: Pool) -> tuple[str, ...] | None:
    rule = own if own is not None else pool.allow_clients
    return tuple(rule) if rule is not None else None


def plan(topo: Topology) -> Plan:
    """The routing plan of a validated topology."""
    routes: list[PlannedRoute] = []
    for route in topo.routes:
        pool = topo.pool(route.pool)
        match = route.match
        routes.append(PlannedRoute(
            name=route.name,
            kind="explicit",
            pool=pool,
            clients=_clients(route.allow_clients, pool),
            models=tuple(match.models) if match.models is not None else None,
            path_prefix=match.path_prefix,
            headers=tuple(match.headers) if match.headers else None,
            traffic_class=route.class_,
        ))
    for model, owner in implicit_model_routes(topo):
        routes.append(PlannedRoute(name=f"model/{model}", kind="model", pool=owner,
                                   clients=_clients(None, owner), models=(model,)))
    if topo.default_pool is not None:
        pool = topo.pool(topo.default_pool)
        routes.append(PlannedRoute(name="default", kind="default", pool=pool, clients=_clients(None, pool)))
    pools = tuple(
        PlannedPool(pool, tuple(fallback_chain(topo, pool)), is_hashing(pool.balancing.policy)) for pool in topo.pools
    )
    restricted = any(r.allow_clients is not None for r in topo.routes) or any(
        p.allow_clients is not None for p in topo.pools)
    return Plan(routes=tuple(routes), pools=pools, restricted=restricted)


def sheddable_pools(topo: Topology) -> tuple[str, ...]:
    """Pools the Envoy render gives a shed share of sheddable traffic (`Plan.sheddable_pools`)."""
    return plan(topo).sheddable_pools(topo)
