"""The one contract every output of the sidecar implements, and what it is built from.

    EdsPublisher     (sidecar.outputs.files.publisher)    EDS files + the whole Envoy tree, confirmed via admin stats
    InflightLimiter  (sidecar.outputs.files.limiter)      Envoy's in-flight limits through its admin runtime
    NginxPublisher   (sidecar.outputs.nginx.publisher)    upstream include files, nginx -t, graceful reload
    AdsPublisher     (sidecar.outputs.xds.publisher)      ADS over gRPC to every connected Envoy (--serve-xds)
    RtdsLimiter      (sidecar.outputs.xds.limits)         the in-flight limits as one RTDS layer
    PickerService    (sidecar.outputs.picker)             the endpoint picker (Envoy ext_proc)
    RateLimitService (sidecar.outputs.ratelimit)          Envoy's rate limit service on a shared store

Every output is an `Output`: `sidecar.main` starts each (in the registry's order), the daemon
applies every cycle to each (`apply`, then `update` with the fleet view that cycle left),
tells each of a pool that left the topology (`forget`), and reads each one's `status`, which
is all the fleet view, /state, /readyz and the metrics know of the outputs (the daemon keeps
no counters of theirs); `sidecar.main` closes them in reverse. One output, the `Publisher`
the flags select, also carries the daemon's decided endpoints to the proxy through the
richer interface below.

Each output is made by a `build(Wiring) -> Built` function named by one line of
`sidecar.outputs.registry.OUTPUTS` (a publisher's build makes its limiter too); adding an
output is its module and that line (and, when the topology selects it, its test in
`registry.wanted`). This module imports no implementation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from confgen.endpoints import Endpoint
from confgen.model import Topology

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from sidecar.config import SidecarConfig
    from sidecar.fleet import Cycle, Snapshot, XdsView
    from sidecar.outputs.envoy_admin import EnvoyAdmin
    from sidecar.outputs.grpc import Servicers

__all__ = ["BudgetAnswer", "BudgetCheck", "Budgets", "Built", "Descriptor", "EnvoyRuntime", "Output", "OutputStatus",
           "PoolStatus", "Publisher", "Wiring", "combine", "published"]

_T = TypeVar("_T")
_K = TypeVar("_K")


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """What one output reports of one pool. The fleet view's row is every output's combined
    (`combine`): counts add up, flags hold when any output's holds, a value is the first given."""

    publishes: int = 0  # updates put in place (files written, resources changed)
    rejections: int = 0  # updates the proxy refused
    rejected: bool = False  # the proxy refused the newest one
    inflight_limit: int | None = None  # the in-flight limit the proxy runs with (confirmed)
    inflight_past_batch: float | None = None  # the in-flight watch's signal (None: not watched)
    saturated: str = ""  # why this output finds the pool saturated ("": it does not)
    shed: Mapping[str, int] = field(default_factory=dict)  # requests the proxy refused, by reason
    shedding: bool = False  # the limit follows the shedding controller, not the safety cap
    sheddable_share: int | None = None  # percent of sheddable requests refused at once (None: no such traffic)

    def __add__(self, other: PoolStatus) -> PoolStatus:
        return PoolStatus(
            publishes=self.publishes + other.publishes,
            rejections=self.rejections + other.rejections,
            rejected=self.rejected or other.rejected,
            inflight_limit=_first(self.inflight_limit, other.inflight_limit),
            inflight_past_batch=_first(self.inflight_past_batch, other.inflight_past_batch),
            saturated=self.saturated or other.saturated,
            shed=_summed(self.shed, other.shed),
            shedding=self.shedding or other.shedding,
            sheddable_share=_first(self.sheddable_share, other.sheddable_share),
        )


_NO_POOL = PoolStatus()


def published(publishes: Mapping[str, int], rejections: Mapping[str, int],
              rejected: Collection[str]) -> dict[str, PoolStatus]:
    """A publisher's per-pool status from its tallies: updates put in place and refused, per pool
    (or resource kind), and the ones whose newest update the proxy refused."""
    return {name: PoolStatus(publishes=publishes.get(name, 0), rejections=rejections.get(name, 0),
                             rejected=name in rejected)
            for name in {*publishes, *rejections, *rejected}}


@dataclass(frozen=True, slots=True)
class OutputStatus:
    """What one output (or all of them, `combine`d) reports now: read on every view."""

    # Why the proxy does not run what the sidecar decided, or why the output cannot answer as
    # configured, in the words /readyz's body, /state, the status page and confgen_sidecar_problems
    # show (an output that answers the proxy per request prefixes its name: "picker: ..."); never a
    # readiness failure ([] when all is well).
    problems: tuple[str, ...] = ()
    pools: Mapping[str, PoolStatus] = field(default_factory=dict)
    # Requests answered 429 for overload, by (output name, pool, class): counted, as reason `name`, in
    # confgen_sidecar_shed_requests_total beside the limiter's (the picker's admission).
    refused: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    write_failures: Mapping[str, int] = field(default_factory=dict)  # writes that failed, by pool or "tree"
    external_changes: Mapping[str, int] = field(default_factory=dict)  # published files someone else replaced
    xds: XdsView | None = None  # the control plane's state, from the output that serves xDS

    def pool(self, name: str) -> PoolStatus:
        """The pool's status (every field at its default when no output reports the pool)."""
        return self.pools.get(name, _NO_POOL)


def combine(statuses: Iterable[OutputStatus]) -> OutputStatus:
    """Every output's status as one, in the outputs' order (problems listed in that order)."""
    problems: list[str] = []
    pools: dict[str, PoolStatus] = {}
    refused: dict[tuple[str, str, str], int] = {}
    write_failures: dict[str, int] = {}
    external_changes: dict[str, int] = {}
    xds: XdsView | None = None
    for status in statuses:
        problems.extend(status.problems)
        for name, pool in status.pools.items():
            pools[name] = pools[name] + pool if name in pools else pool
        _add(refused, status.refused)
        _add(write_failures, status.write_failures)
        _add(external_changes, status.external_changes)
        xds = _first(xds, status.xds)
    return OutputStatus(tuple(problems), pools, refused, write_failures, external_changes, xds)


def _first(a: _T | None, b: _T | None) -> _T | None:
    return a if a is not None else b


def _add(table: dict[_K, int], more: Mapping[_K, int]) -> None:
    for key, count in more.items():
        table[key] = table.get(key, 0) + count


def _summed(a: Mapping[str, int], b: Mapping[str, int]) -> Mapping[str, int]:
    if not b:
        return a
    out = dict(a)
    _add(out, b)
    return out


class Output(Protocol):
    """One place the sidecar's decisions go, or one service it answers the proxy with.

    Every method runs on the daemon's event loop and never blocks it: blocking work (files,
    renders, fsync, subprocesses) happens in threads or subprocesses inside the implementation,
    and work per request is bounded.
    """

    name: str  # its line in sidecar.outputs.registry.OUTPUTS

    async def start(self) -> None:
        """Before the first cycle: open, bind or start what it needs (its own background tasks
        included); OSError or a ConfgenError when it cannot (startup is refused)."""
        ...

    async def apply(self, cycle: Cycle) -> None:
        """What a cycle (or a republish after a drain call) decided, once the publisher has
        published it: in-flight limits are set here. Not called while nothing could be published."""
        ...

    def update(self, fleet: Snapshot) -> None:
        """The fleet view after every probe cycle, once every output has applied it (an output
        answering per request answers from the newest one); cheap, never blocks."""
        ...

    def forget(self, pool: str) -> None:
        """`pool` left the topology: drop what is kept about it."""
        ...

    def status(self) -> OutputStatus:
        """What it reports now (problems, counts, limits, its view of the proxy); cheap."""
        ...

    async def close(self) -> None:
        """Let work in progress finish (a write, calls within their deadlines), then stop."""
        ...


class Publisher(Output, Protocol):
    """The output that carries the daemon's decided endpoints to the proxy, and says whether the
    proxy took them (its `status`: rejections, write failures, problems)."""

    def adopt(self, pool: str) -> list[Endpoint]:
        """At startup: what is already published for `pool` (so a restart changes nothing);
        [] when nothing usable is there or the output does not carry endpoint state."""
        ...

    def offer(self, pool: str, endpoints: Sequence[Endpoint]) -> None:
        """Publish `endpoints` for `pool` if they differ from what the proxy has (may defer)."""
        ...

    def check_reload(self, old: Topology, new: Topology) -> Callable[[], None]:
        """Blocking (the daemon runs it in a thread): whether `new` can be published after `old`;
        raises SecretError to refuse the reload (keys needed and unreadable). Returns what to do
        when the daemon adopts `new` (called under its lock)."""
        ...

    async def publish_all(self, topo: Topology, endpoints: Mapping[str, Sequence[Endpoint]]) -> bool:
        """After the first cycle or a reload: publish everything `topo` renders to, with `endpoints`.
        False when it cannot yet (the daemon tries again next cycle)."""
        ...

    async def check_published(self) -> bool:
        """Each cycle: whether what was published is still in place. False when someone else
        changed it and publish_all is due again (the daemon then calls it)."""
        ...


@dataclass(frozen=True, slots=True)
class BudgetAnswer:
    """A decision on one request's global budgets."""

    allowed: bool
    # x-ratelimit-* as Envoy's filter would add them; retry-after too when refused
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One rate limit descriptor as Envoy's filter sends it: its entries and its own hits_addend
    (None: the request's, 1)."""

    entries: tuple[tuple[str, str], ...]
    hits: int | None = None


class BudgetCheck(Protocol):
    """Decides a request's global budgets from the descriptors Envoy's rate limit filter would send."""

    async def check(self, descriptors: Sequence[Descriptor]) -> BudgetAnswer:
        ...


class Budgets:
    """Where an output that answers every request (the endpoint picker) finds the sidecar's decider of
    global budgets, to check them in its own call: set by the rate limit service's build, None without
    global limits. Read per request, so the order the outputs are built in does not matter."""

    __slots__ = ("check",)

    def __init__(self) -> None:
        self.check: BudgetCheck | None = None


class EnvoyRuntime:
    """Runtime values an output other than the publisher's limiter sets on the Envoys (the picker's
    bypass share): the publisher's build installs `writer` (Envoy's admin runtime in file mode, a part of
    its RTDS layer in ADS mode); until one is installed nothing is written (`set` answers False)."""

    __slots__ = ("writer",)

    def __init__(self) -> None:
        self.writer: Callable[[Mapping[str, int]], Awaitable[bool]] | None = None

    async def set(self, values: Mapping[str, int]) -> bool:
        """True once the Envoys (file mode: Envoy's admin; ADS: the layer served) hold `values`."""
        return False if self.writer is None else await self.writer(values)


@dataclass(frozen=True, slots=True)
class Wiring:
    """What `sidecar.main` hands every output's `build`."""

    config: SidecarConfig
    topo: Topology  # as loaded at startup
    topology: Callable[[], Topology]  # the daemon's current one (it changes on reload); from `start` on
    admin: EnvoyAdmin  # Envoy's admin API (its stats confirm writes; its runtime holds limits)
    registry: CollectorRegistry  # for the output's own metrics, if any
    clock: Callable[[], float]  # the event loop's
    grpc: Servicers  # the sidecar's gRPC server: an output answering over gRPC adds its servicers here
    budgets: Budgets = field(default_factory=Budgets)  # the global budgets' decider, for outputs checking them
    runtime: EnvoyRuntime = field(default_factory=EnvoyRuntime)  # runtime values outside the limiter's


@dataclass(frozen=True, slots=True)
class Built:
    """What a `build` returns: the outputs it made, in start order (closed in reverse)."""

    outputs: tuple[Output, ...]  # besides `publisher` (a publisher's limiter; a service)
    publisher: Publisher | None = None  # a publisher's build: the publisher, started before `outputs`
