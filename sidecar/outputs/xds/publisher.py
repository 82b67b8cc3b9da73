"""The daemon's publisher in ADS mode: endpoints, the tree and the limits go into the cache.

Same duties as the file publisher (`sidecar.outputs.files.publisher.EdsPublisher`) towards the daemon:
`offer` a pool's endpoints (never an empty list), `forget` a pool that left, publish the
whole tree after a topology (re)load, `close`. The resources are confgen's: the tree is
`confgen.envoy.ads.resources`, a pool's endpoints `confgen.envoy.build_cla`. Every
connected Envoy gets the same; what each accepted is in `nodes` (ACK/NACK per type).

A NACK does not make the sidecar not-ready: the Envoy keeps its last accepted version, and
taking the control plane out of its Service would only stop every other Envoy's updates.
It is logged at error level, counted per node and type, and shown in /state.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from confgen.endpoints import Endpoint
from confgen.envoy import ads, build_cla
from confgen.errors import SecretError
from confgen.model import XDS_SOCKET, Topology
from confgen.plan import sheddable_pools
from confgen.secrets import resolve as resolve_secrets
from sidecar.config import grpc_transport_for
from sidecar.fleet import XdsView
from sidecar.logs import log_event
from sidecar.outputs.contract import Built, OutputStatus, Wiring, published
from sidecar.outputs.grpc import GrpcServer, GrpcSettings, settings_for
from sidecar.outputs.xds.cache import CDS, ECDS, EDS, LDS, RTDS, SHORT, XdsCache
from sidecar.outputs.xds.limits import RtdsLimiter
from sidecar.outputs.xds.metrics import register_xds
from sidecar.outputs.xds.nodes import Nodes
from sidecar.outputs.xds.server import AdsBounds, AdsServicer, ads_server

if TYPE_CHECKING:
    from sidecar.fleet import Cycle, Snapshot

__all__ = ["AdsPublisher", "XdsView", "build"]

_log = logging.getLogger("sidecar.outputs.xds")


class AdsPublisher:
    """Serves the fleet's resources to every connected Envoy over ADS (a `Publisher`)."""

    name = "ads"

    def __init__(self, settings: GrpcSettings, *, clock: Callable[[], float],
                 on_nodes_changed: Callable[[], None] | None = None, max_nodes: int = 1000,
                 per_credential: int = 1, bounds: AdsBounds | None = None) -> None:
        self._settings = settings
        self.cache = XdsCache()
        self._runtime_parts: dict[str, dict[str, int]] = {}  # RTDS: the limiter's values, other outputs'
        self.nodes = Nodes(clock, on_nodes_changed, max_nodes=max_nodes, per_credential=per_credential)
        self.servicer = AdsServicer(self.cache, self.nodes, bounds, clock)
        self._server: GrpcServer | None = None
        self.bound_port: int | None = None
        self.publishes: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()  # file publisher's view; NACKs are per node here
        self.rejected: set[str] = set()
        self.versions: dict[str, str] = {}
        self._keys_missing: str | None = None  # why the listeners cannot be served yet

    async def start(self) -> None:
        """Serve ADS where the settings say (the one gRPC builder, `sidecar.outputs.grpc`);
        ConfigError (a ConfgenError) when it cannot bind, the certificates are unusable, the
        socket's directory is not private or plaintext is asked for beyond loopback."""
        server = ads_server(self.servicer, self._settings)
        self.bound_port = await server.start()
        self._server = server
        log_event(_log, logging.INFO, "xds.serving", listen=self.listen, transport=self._settings.transport)

    @property
    def listen(self) -> str:
        return self._server.listen if self._server is not None else self._settings.address

    async def close(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    # -- what the daemon calls --------------------------------------------------------------

    def offer(self, pool: str, endpoints: Sequence[Endpoint]) -> None:
        if not endpoints:
            log_event(_log, logging.WARNING, "eds.empty_refused", pool=pool,
                      note="no endpoint to publish; keeping the current assignment")
            return
        if self.cache.set_one(EDS, pool, build_cla(pool, endpoints)):
            self.publishes[pool] += 1
            self.versions[pool] = self.cache.resources(EDS)[pool].version

    def adopt(self, pool: str) -> list[Endpoint]:
        """Nothing to adopt: a restarted control plane starts from what it decides now."""
        return []

    async def check_published(self) -> bool:
        return True  # what is served is held in memory or re-derived each cycle

    async def apply(self, cycle: Cycle) -> None:
        """Nothing more: the cycle's endpoints came through `offer` / `publish_all`, its limits
        through the RTDS limiter (`set_runtime`)."""

    def update(self, fleet: Snapshot) -> None:
        """Nothing: it serves what the daemon decided, not the fleet view."""

    def problems(self) -> list[str]:
        # A NACK does not make the sidecar not-ready (see the module docstring); `rejected` stays empty.
        reasons = [f"last {name} update rejected by Envoy" for name in sorted(self.rejected)]
        if self._keys_missing is not None:
            reasons.append(f"nothing served over ADS yet: {self._keys_missing}")
        return reasons

    def check_reload(self, old: Topology, new: Topology) -> Callable[[], None]:
        """ADS serves the listeners: a topology with API keys needs them readable (SecretError)."""
        if new.auth is not None:
            resolve_secrets(new)
        return lambda: None

    def status(self) -> OutputStatus:
        """Nothing is written here (no write failures, no external changes); the control plane's view."""
        return OutputStatus(problems=tuple(self.problems()),
                            pools=published(self.publishes, self.rejections, self.rejected), xds=self.view())

    async def publish_all(self, topo: Topology, endpoints: Mapping[str, Sequence[Endpoint]]) -> bool:
        """After a topology (re)load: the resources confgen renders for it (in a thread), with
        `endpoints`. False while the API keys cannot be read (startup without them): said each
        cycle, never fatal, retried by the daemon."""
        try:
            secrets = await asyncio.to_thread(resolve_secrets, topo) if topo.auth is not None else {}
        except SecretError as exc:
            self._keys_missing = str(exc)
            log_event(_log, logging.ERROR, "ads.needs_keys", error=str(exc),
                      note="the listeners (LDS) cannot be served without the API keys; retrying every cycle")
            return False
        self._keys_missing = None
        served = await asyncio.to_thread(ads.resources, topo, secrets)
        await self.publish_tree(served, endpoints)
        return True

    def forget(self, pool: str) -> None:
        self.cache.remove(EDS, pool)
        for table in (self.publishes, self.rejections, self.versions):
            table.pop(pool, None)

    async def publish_tree(self, served: ads.Resources, per_pool: Mapping[str, Sequence[Endpoint]]) -> None:
        """The whole configuration after a topology (re)load: clusters, endpoints, listeners.

        A pool with no endpoint resolved yet keeps what it had, else starts from the
        topology's own view (`served.assignments`), never from nothing. Parsing into
        protobuf runs in a thread (thousands of clusters take a while).
        """
        prepared = await asyncio.to_thread(lambda: [
            (t, self.cache.prepare(t, {str(r["name"]): r for r in items}))
            for t, items in ((CDS, served.clusters), (ECDS, served.extension_configs), (LDS, served.listeners))])
        eds = self.cache.resources(EDS)
        for pool, cla in served.assignments.items():
            endpoints = per_pool.get(pool)
            if endpoints:
                self.offer(pool, endpoints)
            elif pool not in eds:
                self.cache.set_one(EDS, pool, cla)
        for gone in [name for name in eds if name not in served.assignments]:
            self.forget(gone)
        changed = [SHORT[t] for t, resources in prepared if self.cache.install(t, resources)]
        self.cache.prime()
        log_event(_log, logging.INFO, "xds.tree", changed=changed, clusters=len(served.clusters),
                  listeners=len(served.listeners))

    def set_runtime(self, values: Mapping[str, int], part: str = "limits") -> bool:
        """One part of the RTDS layer (`limits`: the limiter's in-flight limits and shed shares;
        `outputs`: other outputs', through `Wiring.runtime`: the picker's bypass share), the layer
        being every part's values; True when it changed."""
        self._runtime_parts[part] = dict(values)
        layer: dict[str, Any] = dict(sorted((k, v) for values_ in self._runtime_parts.values()
                                            for k, v in values_.items()))
        return self.cache.set_one(RTDS, ads.RUNTIME_LAYER, {
            "@type": RTDS, "name": ads.RUNTIME_LAYER, "layer": layer,
        })

    def view(self) -> XdsView:
        return XdsView(
            listen=self.listen,
            versions={SHORT[t]: self.cache.version(t) for t in SHORT},
            resources={SHORT[t]: len(self.cache.resources(t)) for t in SHORT},
            updates={SHORT[t]: n for t, n in self.cache.updates.items()},
            responses={SHORT[t]: n for t, n in self.servicer.sent.items()},
            nodes=self.nodes.view(),
            nacks_total=self.nodes.nacks_total,
            transport=self._settings.transport,
            counted=self.nodes.counted(),
            refused=dict(self.servicer.refused),
            logs_suppressed=self.servicer.logs_suppressed,
        )


def build(wiring: Wiring) -> Built:
    """The ADS publisher (`sidecar.outputs.registry.OUTPUTS["ads"]`), and its limits served over RTDS."""
    config = wiring.config
    assert config.serve_xds is not None  # SidecarConfig.publisher named "ads"
    settings = settings_for(grpc_transport_for(config, wiring.topo), config.serve_xds, XDS_SOCKET)
    publisher = AdsPublisher(settings, clock=wiring.clock, max_nodes=config.xds_max_nodes,
                             per_credential=config.xds_nodes_per_identity)
    register_xds(wiring.registry, publisher.view)
    topology = wiring.topology
    limiter = RtdsLimiter(publisher, wiring.config.saturation, sheddable=lambda: sheddable_pools(topology()))

    async def write(values: Mapping[str, int]) -> bool:
        """Other outputs' runtime values, served in the same RTDS layer as the limits."""
        publisher.set_runtime(values, part="outputs")
        return True

    wiring.runtime.writer = write
    return Built((limiter,), publisher=publisher)
