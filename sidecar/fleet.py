"""The fleet view: one immutable snapshot of the fleet that every output and reader uses.

The daemon (observe -> decide) builds a new `Snapshot` after every change; the publishers,
the gRPC services (endpoint picker, rate limits), the metrics collector and /state read it
and never the daemon's mutable state, so nobody sees a half-updated cycle and an endpoint
that left the topology leaves every view with it. Plain data: no I/O, no behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from confgen.endpoints import Endpoint
from confgen.model import Topology
from sidecar.decide.saturation import PoolLoad
from sidecar.observe.engines import LoadSample
from sidecar.observe.histogram import HistogramView

__all__ = ["Cycle", "EndpointKey", "EndpointView", "Nack", "NodeView", "PoolView", "Snapshot", "XdsView"]


@dataclass(frozen=True, order=True, slots=True)
class EndpointKey:
    """One published endpoint: a worker of a pool at one of its IP addresses."""

    pool: str
    worker: str  # as written in the topology (host:port)
    address: str  # IP literal
    port: int


@dataclass(frozen=True, slots=True)
class Nack:
    version: str
    message: str
    at: float


@dataclass(frozen=True, slots=True)
class NodeView:
    node: str
    cluster: str
    protocol: str
    streams: int
    acked: dict[str, str]
    nacked: dict[str, Nack]
    nacks: dict[str, int]


@dataclass(frozen=True, slots=True)
class XdsView:
    """What /state and the metrics show of the control plane."""

    listen: str
    versions: Mapping[str, str]  # short type name -> version served
    resources: Mapping[str, int]
    updates: Mapping[str, int]
    responses: Mapping[str, int]
    nodes: tuple[NodeView, ...]
    nacks_total: int
    transport: str = "plaintext"  # "mtls" | "plaintext" (loopback only)
    counted: int = 0  # Envoys the in-flight limits are shared by (ACKed RTDS, capped)
    refused: Mapping[str, int] = field(default_factory=dict)  # streams refused, by gRPC code
    logs_suppressed: int = 0  # log lines clients caused beyond their budget


@dataclass(frozen=True, slots=True)
class EndpointView:
    key: EndpointKey
    status: str  # published EDS status
    reason: str
    weight: int | None
    sample: LoadSample | None
    probe_latency_s: float | None
    last_outcome: str | None
    last_error: str | None
    errors: Mapping[str, int]
    serving: bool = True  # in rotation and not known to be failing (one kept in only by the ejection cap is not)
    # its probes say it fails (the health state machine's UNHEALTHY), whatever is published: with every
    # endpoint of a pool failing, or past the ejection cap, it stays published at its last status
    failing: bool = False
    token_latency_s: float | None = None  # smoothed time per output token (the weights' speed), when measured
    capacity: int = 0  # the worker's concurrent sequences (`Pool.capacity_of`)


@dataclass(frozen=True, slots=True)
class PoolView:
    name: str
    engine: str
    saturation: float
    queue_depth: float
    publishes: int
    rejections: int
    rejected: bool
    endpoints: tuple[EndpointView, ...]
    inflight_limit: int | None = None  # Envoy's confirmed circuit-breaker override
    saturated: bool = False  # the detector's verdict (sidecar.decide.saturation), as of the last cycle
    saturated_reason: str = ""  # "headroom" (per-worker rule), "queue" (standing queue), "inflight" (Envoy's count)
    queue_per_slot: float | None = None  # the detector's signal: waiting per declared slot (fresh metrics)
    inflight_past_batch: float | None = None  # the in-flight watch's signal (file target): Envoy's in-flight x
    # ingresses / batch - 1
    shed: Mapping[str, int] = field(default_factory=dict)  # requests this Envoy refused, by reason
    shedding: bool = False  # the limit follows the shedding controller, not the safety cap
    sheddable_share: int | None = None  # percent of sheddable requests refused at once (None: no such traffic)
    probe_durations: HistogramView | None = None  # every probe of the pool's endpoints since start
    model: str = ""  # the pool's model (its first `models` entry): the engine metrics' `model` label


@dataclass(frozen=True, slots=True)
class Snapshot:
    topology: str
    pools: tuple[PoolView, ...]
    reloads: Mapping[str, int]
    cycles: int
    not_ready: tuple[str, ...]  # reasons; empty when ready
    problems: tuple[str, ...]  # refused updates, failing writes, services' ("picker: ..."): not a readiness failure
    last_reload_error: str | None
    xds: XdsView | None = None  # --serve-xds: the control plane and its connected Envoys
    write_failures: Mapping[str, int] = field(default_factory=dict)  # by pool or "tree" (file xDS)
    external_changes: Mapping[str, int] = field(default_factory=dict)  # files replaced by someone else
    # requests the running services refused for overload, by (service, pool, class): the picker's admission
    refused: Mapping[tuple[str, str, str], int] = field(default_factory=dict)




@dataclass(frozen=True, slots=True)
class Cycle:
    """What one daemon cycle decided, as every output reads it: the topology it ran on, each EDS
    pool's decided endpoints (weight, health, zone, labels), each pool's safety cap and saturation
    verdict, and the time it ran at (the daemon's clock)."""

    topology: Topology
    endpoints: Mapping[str, tuple[Endpoint, ...]]  # pool -> endpoints as published this cycle
    loads: Mapping[str, PoolLoad]  # pool -> cap and verdict (computed after the publish)
    now: float
