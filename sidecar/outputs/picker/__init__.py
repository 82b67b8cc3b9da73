"""The endpoint picker: per-request routing for pools with `policy: prefix_affinity`.

Envoy's ext_proc filter hands it each request (headers and body); it answers with the
endpoint to use in the Endpoint Picker Protocol's header and metadata, which Envoy's
override_host load-balancing policy obeys (falling back to least_request when the picker
says nothing or cannot be reached). Pieces:

    prompt      body -> prompt text, size, chained block hashes
    datastore   endpoints per pool: the fleet view's facts + in-flight counts + prefix indexes
    scheduling  filters, scorers (prefix, load, kv, cost) and the picker
    extproc     the gRPC ext_proc servicer (protocol, bounds)
    budgets     the global budgets' check, decided in the ext_proc call (Envoy's filter checks the rest)
    lateness    how late requests reach it; bypass: the share Envoy sends past it while it cannot keep up
    peers       the other picker replicas: placements and in-flight counts streamed both ways
    metrics     Prometheus
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from confgen.balancing import uses_picker
from confgen.envoy import PICKER_BYPASS_RUNTIME_KEY, route_checks, route_classes
from confgen.model import Topology, join_address
from confgen.plan import plan
from sidecar.config import ConfigError
from sidecar.logs import log_event
from sidecar.observe.probe import LoopLag
from sidecar.outputs.contract import Built, OutputStatus

from .admission import WaitBudgets
from .budgets import RouteChecks
from .bypass import Bypass, BypassPolicy
from .datastore import Classes, Datastore, EndpointFacts, PoolFacts
from .extproc import DESTINATION, POOL_METADATA, ExtProcLimits, PickerServicer
from .metrics import PickerMetrics
from .peers import PeerLimits, PeerLinks, PeerLoads, PeerServicer
from .scheduling import Picker, PickerPolicy

if TYPE_CHECKING:
    import grpc

    from sidecar.fleet import Cycle, Snapshot
    from sidecar.outputs.contract import Wiring

_log = logging.getLogger("sidecar.picker")

__all__ = ["DESTINATION", "POOL_METADATA", "PickerPolicy", "PickerService", "admission_budgets", "budget_checks",
           "build", "facts", "routes"]


def routes(topo: Topology) -> dict[str | None, str]:
    """The pool each model's requests go to (None: requests naming no model), in the routing
    plan's order: explicit routes that match on models alone, per-model routes (aliases
    included), default_pool. A route that also matches on headers or a path is not knowable
    from the body; its models keep the pool their per-model route gives."""
    out: dict[str | None, str] = {}
    for planned in plan(topo).routes:
        if planned.kind == "default":
            out.setdefault(None, planned.pool.name)
        elif planned.models and not planned.headers and (planned.path_prefix or "/") == "/":
            for model in planned.models:
                out.setdefault(model, planned.pool.name)
    return out


def classes(topo: Topology) -> Classes:
    """What decides a request's class where the picker sees it: the authenticated client (the header
    the proxy's api_key_auth sets after removing any client-sent copy) and the route its model takes
    (routes matched on models alone; a route matched on a header or a path is not knowable here)."""
    by_model: dict[str | None, str] = {}
    blind: set[str] = set()
    for planned in plan(topo).routes:
        if planned.kind == "default":
            by_model.setdefault(None, planned.traffic_class)
        elif planned.models and not planned.headers and (planned.path_prefix or "/") == "/":
            for model in planned.models:
                by_model.setdefault(model, planned.traffic_class)
        elif planned.traffic_class == "critical":
            blind.add(planned.pool.name)
    clients = {k.client: k.class_ for k in topo.auth.api_keys} if topo.auth is not None else {}
    named = {name: (rc.traffic_class, rc.pool) for name, rc in route_classes(topo, plan(topo)).items()}
    return Classes(topo.auth.client_header if topo.auth is not None else None, clients, by_model, frozenset(blind),
                   named)


def budget_checks(topo: Topology) -> RouteChecks | None:
    """The global budgets the picker decides in its own call, per route (None: the topology has none)."""
    checks = RouteChecks(route_checks(topo, plan(topo)))
    for route, why in sorted(checks.left.items()):
        log_event(_log, logging.WARNING, "picker.budgets_left_to_envoy", route=route, reason=why)
    return checks if len(checks) else None


def admission_budgets(topo: Topology, policy: PickerPolicy) -> dict[str, WaitBudgets]:
    """The picker's pools whose topology sets admission budgets (`pools[].admission`), each with the
    policy's (the sidecar's --picker budget_*) where it leaves one unset."""
    out = {}
    for pool in topo.pools:
        adm = pool.admission
        if not uses_picker(topo, pool) or not adm.given():
            continue
        out[pool.name] = WaitBudgets(
            policy.budget_standard if adm.standard is None else adm.standard,
            policy.budget_sheddable if adm.sheddable is None else adm.sheddable,
            policy.budget_floor_s if adm.min_wait is None else adm.min_wait.seconds)
    return out


def facts(view: Snapshot, topo: Topology) -> list[PoolFacts]:
    """The picker's pools (policy prefix_affinity), from the daemon's fleet view."""
    pools = {p.name: p for p in topo.pools if uses_picker(topo, p)}
    out = []
    for pv in view.pools:
        pool = pools.get(pv.name)
        if pool is None:
            continue
        endpoints = []
        for ev in pv.endpoints:
            s = ev.sample
            endpoints.append(EndpointFacts(
                address=join_address(ev.key.address, ev.key.port),
                serving=ev.serving and ev.status in ("HEALTHY", "DEGRADED"),
                capacity=max(1, ev.capacity or 1),
                running=s.running if s else 0.0,
                waiting=s.waiting if s else 0.0,
                kv_usage=s.kv_usage if s else None,
                token_latency_s=ev.token_latency_s,
                kv_blocks=int(s.kv_blocks) if s and s.kv_blocks else None,
                itl_sum=s.token_latency_s if s else None,
                itl_count=s.token_latency_n if s else None,
                prefill_seconds=s.prefill_seconds if s else None,
                prefill_tokens=s.prefill_tokens if s else None,
                finished=s.finished if s else None,
                finished_tokens=s.finished_tokens if s else None,
                finished_bounded=s.finished_bounded if s else None,
            ))
        out.append(PoolFacts(pv.name, tuple(pool.models), tuple(endpoints), saturated=pv.saturated))
    return out


class PickerService:
    """The picker as a `sidecar.outputs.contract.Output`: it answers from the newest fleet view."""

    name = "picker"

    def __init__(self, wiring: Wiring, policy: PickerPolicy | None = None,
                 peer_limits: PeerLimits | None = None) -> None:
        self._topology = wiring.topology
        self.store = Datastore()
        # with peers, the arrivals are split among this picker and the peers it streams to (the
        # spike rule counts its own times that many); without, --ingresses of them (the policy's)
        self.picker = picker = Picker(policy, pickers=(lambda: 1 + self.links.connected())
                                      if wiring.config.picker_peers else None)
        self.metrics = PickerMetrics(wiring.registry, self.store.pools, picker.admission.pressures,
                                     lambda pool: picker.admission.admitting(pool) or self.store.saturated(pool))
        # Until the daemon's first view arrives the store is empty: every request is left to
        # the proxy's own balancer (least_request).
        self._lag = LoopLag()
        limits = peer_limits or PeerLimits()
        config = wiring.config
        self.links = PeerLinks(config.picker_peers, self.store, tls=config.grpc_tls, limits=limits,
                               on_sent=self.metrics.peer_placements.labels(kind="sent").inc,
                               on_dropped=self.metrics.peer_placements.labels(kind="dropped").inc)
        self.metrics.peers_connected.set_function(self.links.connected)
        self.peers = PeerServicer(self.store, PeerLoads(self.store, wiring.clock, limits.stale_s),
                                  self.metrics.observe_peer_batch, replica=self.links.replica,
                                  own_cert=config.grpc_tls.cert if config.grpc_tls is not None else None)
        self.servicer = PickerServicer(self.store, picker, self.metrics,
                                       limits=ExtProcLimits(late_s=picker.policy.late_s,
                                                            wait_s=picker.policy.bypass_wait_s), lag=self._lag,
                                       on_placed=self.links.placed if config.picker_peers else None,
                                       budgets=wiring.budgets)
        self._checks_of: Topology | None = None
        self._follow(wiring.topo)
        self._runtime = wiring.runtime
        self._bypass = Bypass(BypassPolicy(max_percent=picker.policy.bypass_max))
        self._bypass_task: asyncio.Task[None] | None = None
        self._bypass_held: int | None = None  # the share the Envoys hold
        self._counted = (0, 0, 0)  # the servicer's (seen, waited, late) at the last tick

    def add_to(self, server: grpc.aio.Server) -> None:
        """Its servicers (ext_proc, the peers' stream) on the sidecar's gRPC server."""
        pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, server)
        self.peers.add_to(server)

    async def start(self) -> None:
        self._lag.start()
        await self.links.start()
        # also with bypass_max=0: it writes 0 once, over whatever share an earlier picker left in the Envoys
        self._bypass_task = asyncio.create_task(self._bypass_loop(), name="picker-bypass")

    async def _bypass_loop(self) -> None:
        while True:
            await self.bypass_tick()
            await asyncio.sleep(self._bypass.policy.interval_s)

    async def bypass_tick(self) -> int | None:
        """One interval of the share of requests Envoy sends past the picker (bypass.py), from the requests
        that reached it since the last tick, written when it differs from what the Envoys hold (first: 0,
        whatever a picker before this one left in their runtime); a write not confirmed is tried again
        next tick. The share the Envoys hold (None: not known yet)."""
        servicer = self.servicer
        seen, waited, late = self._counted
        queued = max(servicer.waited - waited, servicer.late - late)  # queued before the picker, or answered late
        store, picker = self.store, self.picker
        surging = any(picker.admission.surging(pool) or store.saturated(pool) for pool in store.pools())
        percent = self._bypass.step(servicer.seen - seen, queued, surging)
        self._counted = (servicer.seen, servicer.waited, servicer.late)
        held = self._bypass_held
        if percent != held and await self._runtime.set({PICKER_BYPASS_RUNTIME_KEY: percent}):
            if held is not None or percent:
                log_event(_log, logging.WARNING if percent > (held or 0) else logging.INFO,
                          "picker.bypass", percent=percent, before=held)
            self._bypass_held = percent
            self.metrics.bypass.set(percent)
        return self._bypass_held

    async def apply(self, cycle: Cycle) -> None:
        """Nothing: it answers from the fleet view (`update`)."""

    def update(self, fleet: Snapshot) -> None:
        topo = self._topology()
        self._follow(topo)
        self.store.update(facts(fleet, topo), routes(topo), classes(topo))

    def _follow(self, topo: Topology) -> None:
        """The routes' budget checks and the pools' admission budgets of `topo`, when the topology changes."""
        if topo is not self._checks_of:
            self._checks_of = topo
            self.servicer.checks = budget_checks(topo)
            self.picker.admission.pool_budgets = admission_budgets(topo, self.picker.policy)

    def forget(self, pool: str) -> None:
        """Nothing: the next fleet view no longer has the pool."""

    def status(self) -> OutputStatus:
        """Problems, each "picker: ...": before the first fleet view every request is left to Envoy's own
        balancer (no problem); a peer not reached is one (its conversations' placements are not shared
        while it lasts). Refused: the requests its admission answered 429, by (pool, class)."""
        return OutputStatus(problems=tuple(f"{self.name}: {problem}" for problem in self.links.problems()),
                            refused={(self.name, pool, cls): n for (pool, cls), n in self.metrics.refusals().items()})

    async def close(self) -> None:
        if self._bypass_task is not None:
            self._bypass_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._bypass_task
        await self.links.close()
        self._lag.stop()


def build(wiring: Wiring) -> Built:
    """The picker with the sidecar's --picker overrides, its servicers added to the sidecar's gRPC
    server; ConfigError when an override is bad."""
    try:
        # Each Envoy of a file-mode fleet has its own sidecar, so its own picker: --ingresses of them.
        # With peers the placements are shared: nothing is presumed of the other replicas' requests.
        replicas = 1 if wiring.config.picker_peers else wiring.config.ingresses
        policy = PickerPolicy(replicas=replicas).with_overrides(wiring.config.picker)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if wiring.config.ingresses > 1 and not wiring.config.picker_peers:
        log_event(_log, logging.WARNING, "picker.alone", ingresses=wiring.config.ingresses,
                  hint="give each sidecar the others as --picker-peer: without, each picker knows only its own "
                       "Envoy's requests (two Envoys: 68-71 % prefix-cache hits against 85-87 % as peers, measured)")
    service = PickerService(wiring, policy)
    wiring.grpc.add(service.add_to, service.name)
    return Built((service,))
