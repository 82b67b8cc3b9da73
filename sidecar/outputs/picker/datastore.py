"""The picker's one datastore: the endpoints of the pools it picks for, what the fleet view
says of each (refreshed every probe cycle) and what only the picker knows (refreshed at
every request): requests in flight through it, and the prompt blocks it sent there.

Keyed by pool, then by "ip:port" (the form Envoy's override_host and the Endpoint Picker
Protocol name a host by). An endpoint that stays across updates keeps its in-flight count
and its prefix index; one that leaves takes both with it.

Index memory is capped: each endpoint's LRU holds at most the engine's reported KV blocks
(else `default_blocks`, 31,250: the inference extension's default, ~500k tokens), and all
of them together at most `total_blocks` (1,000,000 hashes: ~130 MiB of RSS at worst,
measured on CPython 3.11, see BlockLRU), shared evenly when the fleet is large.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice

from .predict import CostPolicy, Learner

__all__ = ["BlockLRU", "Classes", "Datastore", "Endpoint", "EndpointFacts", "PoolFacts"]



@dataclass(frozen=True, slots=True)
class Classes:
    """A request's traffic class: critical if its client or its route says so, else sheddable if
    either does, else standard (the topology's rule)."""

    client_header: str | None = None  # None: no API keys
    clients: Mapping[str, str] = field(default_factory=dict)
    routes: Mapping[str | None, str] = field(default_factory=dict)
    # pools a critical route reaches on a header or a path: without the matched route's name
    # (a proxy not configured by confgen's render) the picker cannot tell those requests apart, so
    # it takes every request to them as critical (never refused)
    blind: frozenset[str] = frozenset()
    # the render's route names -> (class, pool): the route Envoy matched, header and path included
    named: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # the classes a model route can give (the default's included): at most three, whatever the models
    _kinds: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_kinds", frozenset({*self.routes.values(), self.routes.get(None, "standard")}))

    def _own(self, client: str | None) -> str:
        return self.clients.get(client, "standard") if client is not None else "standard"

    @staticmethod
    def _combined(route: str, own: str) -> str:
        if "critical" in (route, own):
            return "critical"
        return "sheddable" if "sheddable" in (route, own) else "standard"

    def of(self, client: str | None, model: str | None, pool: str | None = None, route_name: str | None = None) -> str:
        known = self.named.get(route_name) if route_name is not None else None
        if known is not None:
            route = known[0]
        elif pool is not None and pool in self.blind:
            return "critical"
        else:
            route = self.routes.get(model, self.routes.get(None, "standard"))
        return self._combined(route, self._own(client))

    def without_body(self, client: str | None, pool: str | None, route_name: str | None) -> str | None:
        """The class of a request whose body (its model) is unread, for admission: the route's (by its
        name) and its client's; where only the model could tell (no named route, the topology's model
        routes differ in class), the most lenient class any model would give it, so that it is refused
        only where its own class would be too; None where a model would make it critical (not refused)."""
        if (route_name is not None and route_name in self.named) or (pool is not None and pool in self.blind):
            return self.of(client, None, pool, route_name)
        own = self._own(client)
        possible = {self._combined(route, own) for route in self._kinds}
        if "critical" in possible:
            return None if len(possible) > 1 else "critical"
        return "standard" if "standard" in possible else "sheddable"


class BlockLRU:
    """The block hashes last sent to one endpoint, least recently used evicted first.

    A plain dict in recency order (a re-sent block is deleted and appended), not an
    OrderedDict, whose linked list costs a node per block (measured, CPython 3.11, 1,000,000
    64-bit hashes held over 1 or 32 endpoints after 5,000,000 added: OrderedDict +192..220
    MiB RSS, this +127 MiB, the hash ints included). The
    oldest are evicted from the front in batches of up to capacity/8 (the size held stays
    within capacity - capacity/8 .. capacity), so the holes a dict keeps at its front are
    scanned once per batch, not once per block."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._blocks: dict[int, None] = {}

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain are held (chained: the first miss ends it)."""
        n = 0
        blocks = self._blocks
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def add(self, hashes: Iterable[int]) -> None:
        blocks = self._blocks
        for h in hashes:
            blocks.pop(h, None)  # to the end: the most recent
            blocks[h] = None
        self._trim()

    def resize(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._trim()

    def _trim(self) -> None:
        blocks = self._blocks
        over = len(blocks) - self.capacity
        if over <= 0:
            return
        for h in list(islice(blocks, over + self.capacity // 8)):
            del blocks[h]

    def __len__(self) -> int:
        return len(self._blocks)


@dataclass(frozen=True, slots=True)
class EndpointFacts:
    """What the fleet view says of one endpoint (the daemon's last cycle)."""

    address: str  # ip:port
    serving: bool  # in rotation and not known to be failing
    capacity: int = 1  # sequences it runs at once (the topology's capacity)
    running: float = 0.0  # engine-reported, may be a cycle old
    waiting: float = 0.0
    kv_usage: float | None = None  # 0..1
    token_latency_s: float | None = None  # measured time per output token (smoothed)
    kv_blocks: int | None = None  # the engine's KV cache in blocks, when reported
    # the engine's cumulative counters the picker learns this endpoint's costs from (predict.Learner)
    itl_sum: float | None = None  # inter-token latency histogram: seconds
    itl_count: float | None = None  # ... and tokens
    prefill_seconds: float | None = None
    prefill_tokens: float | None = None  # prompt tokens prefilled, cached ones excluded
    finished: float | None = None  # requests finished
    finished_tokens: float | None = None  # tokens they generated
    finished_bounded: float | None = None  # requests finished because they reached their max_tokens


@dataclass(frozen=True, slots=True)
class PoolFacts:
    name: str
    models: tuple[str, ...]
    endpoints: tuple[EndpointFacts, ...]
    saturated: bool = False  # the daemon's saturation verdict for the pool, as of its last cycle


@dataclass(slots=True, eq=False)
class Endpoint:
    facts: EndpointFacts
    index: BlockLRU
    in_flight: int = 0  # requests this picker sent here that have not ended
    # what the engine ran or queued beyond this picker's own requests when its facts came in (other
    # pickers', clients bypassing the proxy): the only part of the engine's count that a probe-old
    # figure is needed for; the picker's own part is exact now
    bypass: float = 0.0
    # requests the other picker replicas have in flight here, as of their last batch (peers.py)
    peers: float = 0.0
    learner: Learner = field(default_factory=Learner)  # its costs, learned from its engine's counters

    @property
    def address(self) -> str:
        return self.facts.address


@dataclass(slots=True)
class _Pool:
    models: tuple[str, ...]
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    saturated: bool = False


class Datastore:
    def __init__(self, *, default_blocks: int = 31_250, total_blocks: int = 1_000_000,
                 cost: CostPolicy | None = None) -> None:
        self.cost = cost or CostPolicy()
        self.default_blocks = default_blocks
        self.total_blocks = total_blocks
        self._pools: dict[str, _Pool] = {}
        self._routes: dict[str | None, str] = {}
        self.classes = Classes()
        self._peer_totals: dict[tuple[str, str], int] = {}

    def update(self, pools: Sequence[PoolFacts], routes: Mapping[str | None, str] | None = None,
               classes: Classes | None = None) -> None:
        """Replace the fleet facts; keep the in-flight counts and indexes of endpoints that stay.

        `routes`: the pool each model goes to (None: requests naming no model), every pool of
        the topology, the picker's or not; default: each picker pool's own models."""
        count = sum(len(p.endpoints) for p in pools) or 1
        share = max(1, self.total_blocks // count)
        fresh: dict[str, _Pool] = {}
        for pool in pools:
            old = self._pools.get(pool.name)
            entry = _Pool(pool.models, saturated=pool.saturated)
            for facts in pool.endpoints:
                cap = min(facts.kv_blocks or self.default_blocks, share)
                kept = old.endpoints.get(facts.address) if old is not None else None
                if kept is None:
                    peers = float(self._peer_totals.get((pool.name, facts.address), 0))
                    kept = Endpoint(facts, BlockLRU(cap), peers=peers)
                else:
                    kept.facts = facts
                    if kept.index.capacity != cap:
                        kept.index.resize(cap)
                kept.bypass = max(0.0, facts.running + facts.waiting - kept.in_flight - kept.peers)
                kept.learner.observe(running=facts.running, itl_sum=facts.itl_sum, itl_count=facts.itl_count,
                                     prefill_s=facts.prefill_seconds, prefill_tokens=facts.prefill_tokens,
                                     finished=facts.finished, finished_tokens=facts.finished_tokens,
                                     finished_bounded=facts.finished_bounded,
                                     policy=self.cost)
                entry.endpoints[facts.address] = kept
            fresh[pool.name] = entry
        self._pools = fresh
        if classes is not None:
            self.classes = classes
        self._routes = dict(routes) if routes is not None else {m: p.name for p in pools for m in p.models}

    def pools(self) -> Mapping[str, Sequence[Endpoint]]:
        return {name: list(p.endpoints.values()) for name, p in self._pools.items()}

    def serves(self, pool: str | None) -> bool:
        """Is this one of the picker's pools."""
        return pool in self._pools

    def saturated(self, pool: str) -> bool:
        """The pool's saturation verdict as of the last update (False for a pool not known)."""
        entry = self._pools.get(pool)
        return entry is not None and entry.saturated

    def endpoints(self, pool: str) -> list[Endpoint]:
        entry = self._pools.get(pool)
        return list(entry.endpoints.values()) if entry is not None else []

    def pool_of_route(self, route_name: str | None) -> tuple[bool, str | None]:
        """(known, pool): whether the render named this route, and then its pool if it is the
        picker's (None: another policy's pool)."""
        known = self.classes.named.get(route_name) if route_name is not None else None
        if known is None:
            return False, None
        return True, known[1] if known[1] in self._pools else None

    def pool_for(self, model: str | None) -> str | None:
        """The picker's pool a request goes to when the proxy did not say: the one its model
        routes to (None when that pool is not the picker's); without routes, the only pool."""
        if self._routes:
            pool = self._routes.get(model)
            return pool if pool in self._pools else None
        return next(iter(self._pools)) if len(self._pools) == 1 else None

    def pool_holding(self, addresses: Iterable[str]) -> str | None:
        """The picker's pool one of these endpoints belongs to (a subset hint without a model)."""
        wanted = set(addresses)
        return next((name for name, p in self._pools.items() if wanted & p.endpoints.keys()), None)

    def add_placements(self, picks: Iterable[tuple[str, str, Sequence[int]]]) -> int:
        """Another picker replica's placements (pool, address, block hashes) into the endpoints'
        prefix indexes; how many named an endpoint this store holds (the rest are skipped)."""
        applied = 0
        for pool, address, hashes in picks:
            entry = self._pools.get(pool)
            endpoint = entry.endpoints.get(address) if entry is not None else None
            if endpoint is not None:
                endpoint.index.add(hashes)
                applied += 1
        return applied

    def set_peer_loads(self, totals: Mapping[tuple[str, str], int]) -> None:
        """The other replicas' requests in flight per (pool, address); every other endpoint: 0.
        Touches only the endpoints whose figure is or was non-zero (a batch every few ms per peer)."""
        previous, self._peer_totals = self._peer_totals, dict(totals)
        for key in previous.keys() | totals.keys():
            entry = self._pools.get(key[0])
            endpoint = entry.endpoints.get(key[1]) if entry is not None else None
            if endpoint is not None:
                endpoint.peers = float(totals.get(key, 0))

    def own_in_flight(self) -> dict[str, dict[str, int]]:
        """This picker's requests in flight per pool and address (endpoints with none left out)."""
        return {name: {a: e.in_flight for a, e in entry.endpoints.items() if e.in_flight > 0}
                for name, entry in self._pools.items()}

    def index_size(self) -> int:
        return sum(len(e.index) for p in self._pools.values() for e in p.endpoints.values())
