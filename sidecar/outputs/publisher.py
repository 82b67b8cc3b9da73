"""What the daemon needs of a publisher: the one interface every output of the sidecar implements.

    EdsPublisher    (sidecar.outputs.files.publisher)        EDS files + the whole Envoy tree, confirmed via admin stats
    NginxPublisher  (sidecar.outputs.nginx.publisher)  upstream include files, nginx -t, graceful reload
    AdsPublisher    (sidecar.outputs.xds.publisher)  ADS over gRPC to every connected Envoy (--serve-xds)

`sidecar.main` builds one by its name (`SidecarConfig.publisher`) from
`sidecar.outputs.registry.PUBLISHERS`, together with the `Limiter` that keeps the proxy's
in-flight limits (if the proxy has them); `sidecar.daemon` only ever talks to these
interfaces, never to a concrete class. Adding a publisher: a module with a class that
satisfies `Publisher` and a `build(Wiring) -> Built` function, plus its line in `PUBLISHERS`
(its flags, and the name they select, in `sidecar.config`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from confgen.endpoints import Endpoint
from confgen.model import Topology

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from sidecar.config import SidecarConfig
    from sidecar.decide.saturation import PoolLoad
    from sidecar.fleet import XdsView
    from sidecar.outputs.envoy_admin import EnvoyAdmin

__all__ = ["Built", "Limiter", "NoLimiter", "Publisher", "Wiring"]


class Publisher(Protocol):
    """Puts the daemon's decisions where the proxy reads them, and says whether it took them.

    Every method runs on the daemon's event loop; blocking work (files, renders, fsync,
    subprocesses) happens in threads or subprocesses inside the implementation.
    """

    publishes: Counter[str]  # writes per pool
    rejections: Counter[str]  # refusals by the proxy per pool (or per resource kind)
    rejected: set[str]  # pools (or kinds) whose newest content the proxy refused
    write_failures: Counter[str]  # writes that failed (disk read-only, full...), by pool or "tree"
    external_changes: Counter[str]  # published files someone else replaced (then restored)

    async def start(self) -> None:
        """Before the first cycle: bind or open what it serves from; OSError when it cannot."""
        ...

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

    def forget(self, pool: str) -> None:
        """`pool` left the topology: drop what is kept about it."""
        ...

    async def check_published(self) -> bool:
        """Each cycle: whether what was published is still in place. False when someone else
        changed it and publish_all is due again (the daemon then calls it)."""
        ...

    def problems(self) -> list[str]:
        """Why the proxy does not run what the sidecar decided ([] when it does): /readyz."""
        ...

    def xds_view(self) -> XdsView | None:
        """The control plane's state for /state when the publisher serves xDS, else None."""
        ...

    async def close(self) -> None:
        """Let a write in progress finish, then stop."""
        ...


class Limiter(Protocol):
    """Keeps each pool's in-flight limit in the proxy (sidecar.outputs.files.limiter's rule)."""

    in_force: dict[str, int]  # pool -> limit the proxy runs with
    shed: dict[str, dict[str, int]]  # pool -> reason ("saturated" | "cap" | "share") -> requests refused (seen)
    sheddable_share: dict[str, int]  # pool -> percent of its sheddable requests the proxy refuses at once

    async def apply(self, loads: Mapping[str, PoolLoad], now: float) -> None: ...

    @property
    def watch_interval_s(self) -> float | None:
        """How often `watch` wants to run between cycles (None: it has nothing to watch)."""
        ...

    async def watch(self, now: float) -> None:
        """Between cycles: react to what the proxy alone can tell at once (its in-flight count)."""
        ...

    def shedding(self, pool: str) -> bool: ...

    def inflight_signal(self, pool: str) -> float | None:
        """The watch's last signal for the pool (None: not watched, or no fresh metrics)."""
        ...

    def inflight_saturated(self, pool: str) -> bool:
        """The in-flight watch finds the pool saturated (False where there is no watch)."""
        ...

    def forget(self, pool: str) -> None: ...


class NoLimiter:
    """The `Limiter` of a proxy without in-flight limits the sidecar keeps: limits nothing, sees nothing."""

    watch_interval_s: float | None = None

    def __init__(self) -> None:
        self.in_force: dict[str, int] = {}
        self.shed: dict[str, dict[str, int]] = {}
        self.sheddable_share: dict[str, int] = {}

    async def apply(self, loads: Mapping[str, PoolLoad], now: float) -> None:
        return None

    async def watch(self, now: float) -> None:
        return None

    def shedding(self, pool: str) -> bool:
        return False

    def inflight_signal(self, pool: str) -> float | None:
        return None

    def inflight_saturated(self, pool: str) -> bool:
        return False

    def forget(self, pool: str) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Wiring:
    """What `sidecar.main` hands a publisher's `build`."""

    config: SidecarConfig
    topo: Topology  # as loaded at startup
    topology: Callable[[], Topology]  # the daemon's current one (it changes on reload)
    admin: EnvoyAdmin  # Envoy's admin API (its stats confirm writes)
    registry: CollectorRegistry  # for the publisher's own metrics, if any
    clock: Callable[[], float]  # the event loop's


@dataclass(frozen=True, slots=True)
class Built:
    publisher: Publisher
    limiter: Limiter | None  # None: the proxy has no in-flight limit the sidecar keeps
