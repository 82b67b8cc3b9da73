"""Aggregated Discovery over gRPC: state of the world and delta, on a server of the one builder.

Nothing is answered before the first whole configuration is in the cache (an Envoy
connecting to a control plane that is still starting waits, rather than starting empty).
Every stream belongs to one Envoy (its node id, sent in the first request) and is driven
by one wake-up event, set by the stream's request reader and by every cache change; on
each wake the stream handles the requests that arrived, then sends, type by type in make-
before-break order (CDS, EDS, LDS, RTDS), what that Envoy does not have yet.

State of the world: a type is sent when its version or the set of subscribed names moved
since the last response; LDS/CDS are wildcard (every resource), EDS/RTDS the names asked
for. Delta: per resource, what the Envoy has (its initial_resource_versions, then what was
sent) against the cache; removals for names it has that are gone.

ACK/NACK: a request carrying the nonce of the latest response of its type answers it; with
error_detail it is a NACK of the version that response carried (recorded with Envoy's
message; the same version is not sent again, the next change is). A request with an older
nonce is stale and changes nothing but its subscriptions. A nonce is answered once: a
repeated ACK/NACK of it is stale too.

Bounded (`AdsBounds`): each request is applied to the stream's per-type state as it arrives
(nothing queues: a client that sends and never reads holds one state per type, not its
requests); subscriptions, node ids and the NACK text kept are capped; the server caps
message size, streams, connections and handshake time (`ads_limits`). Who may speak for which
node: with mTLS the node id must be bound to the client certificate
(`sidecar.outputs.tls.node_bound`), checked on the first request; refused streams end with
PERMISSION_DENIED, and what clients make the server log is rate-limited per client
(`sidecar.logs.LogBudget`). Each node is recorded with what its connection proved
(`sidecar.outputs.tls.credential_of`): the limits count Envoys per credential, not per node id
(`Nodes.counted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from sidecar.logs import LogBudget, clip
from sidecar.outputs.grpc import GrpcLimits, GrpcServer, GrpcSettings
from sidecar.outputs.tls import credential_of, node_bound, peer_identities
from sidecar.outputs.xds.cache import CDS, LDS, SHORT, TYPE_ORDER, XdsCache
from sidecar.outputs.xds.nodes import Nodes

__all__ = ["AdsBounds", "AdsServicer", "ads_limits", "ads_server"]

_log = logging.getLogger("sidecar.outputs.xds")
_WILDCARD_TYPES = (CDS, LDS)
_MAX_NONCES = 32


@dataclass(frozen=True, slots=True)
class AdsBounds:
    """What one client can make the control plane hold or do."""

    max_node_id: int = 256  # characters; a longer node id is refused (never shown)
    max_text: int = 512  # characters of a NACK's error text kept, logged and shown
    max_names: int = 10_000  # resource names one stream may subscribe to, per type
    max_unknown_names: int = 1024  # of which not served now (a pool just removed, a typo, an attack)
    max_name: int = 256  # characters of a resource name (pool names are at most 63)
    max_streams: int = 2_000  # concurrent streams on the server (RESOURCE_EXHAUSTED beyond)
    max_streams_per_connection: int = 8  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS (an Envoy uses 1)
    max_connections: int = 2_000
    # One request. Envoy's are a few KiB plus a NACK's text; a delta reconnect lists every resource it
    # has (initial_resource_versions: ~85 bytes a pool, 10,000 pools ~0.85 MiB). grpc refuses a longer
    # message from its length prefix, before buffering it.
    max_receive_bytes: int = 1024 * 1024
    handshake_timeout_s: float = 10.0  # TCP + TLS handshake, then the HTTP/2 preface
    # a stream that has not named its node by then is ended (DEADLINE_EXCEEDED): one that sends nothing
    # would otherwise hold one of `max_streams` for good (Envoy names it in its first request, at once)
    first_request_s: float = 10.0
    idle_timeout_s: float = 300.0  # a connection with no stream open is closed after this
    log_burst: int = 20  # lines one client (node id or peer address) can cause per window
    log_window_s: float = 60.0
    # What one stream may make the server parse: a token bucket in bytes (each request costs
    # at least min_request_cost). Beyond it the stream is not read (HTTP/2 flow control holds
    # the sender back). Envoy sends a few small requests per response: far below.
    read_rate_bytes_s: float = 1024 * 1024
    read_burst_bytes: float = 8 * 1024 * 1024
    min_request_cost: int = 4096


class _Pace:
    """A token bucket: how long to wait before reading on after a request of `cost` bytes."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self._rate, self._burst, self._clock = rate, burst, clock
        self._tokens, self._last = burst, clock()

    def delay(self, cost: float) -> float:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate) - cost
        self._last = now
        return max(0.0, -self._tokens / self._rate)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def _peer_host(context: Any) -> str:
    peer = str(context.peer() or "")
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def _nack_message(request: Any) -> str | None:
    """Envoy's error text when the request is a NACK, else None."""
    if not request.HasField("error_detail"):
        return None
    detail = request.error_detail
    if detail.code == 0 and not detail.message:
        return None
    return str(detail.message) or f"code {detail.code}"


class _Stream:
    """What every stream does: its node, its client's certificate names, its wake-up."""

    def __init__(self, servicer: AdsServicer, protocol: str, context: Any) -> None:
        self.servicer = servicer
        self.protocol = protocol
        self.identities = peer_identities(context)  # None: plaintext (loopback only)
        self.peer = _peer_host(context)
        self.credential = credential_of(self.identities, str(context.peer() or ""))
        self.node: str | None = None
        self.wake = asyncio.Event()
        self.closed = False
        self.refused: _Refused | None = None
        self._nonce = 0

    def nonce(self) -> str:
        self._nonce += 1
        return str(self._nonce)

    async def read(self, requests: AsyncIterator[Any], handle: Callable[[Any], None]) -> None:
        """Apply each request to the stream's state as it arrives (paced); stop at the first refused one."""
        bounds = self.servicer.bounds
        pace = _Pace(bounds.read_rate_bytes_s, bounds.read_burst_bytes, _monotonic)
        try:
            async for request in requests:
                cost = max(request.ByteSize(), bounds.min_request_cost)
                handle(request)
                del request  # not held while paced
                self.wake.set()
                wait = pace.delay(cost)
                if wait > 0:  # rate limiting, not synchronisation: the client sends faster than allowed
                    self.servicer.paced += 1
                    await asyncio.sleep(wait)
        except _Refused as exc:
            self.refused = exc
        finally:
            self.closed = True
            self.wake.set()

    def identify(self, request: Any) -> None:
        """The first request names the node: present, short, bound to the certificate, room for it."""
        if self.node is not None:
            return
        bounds = self.servicer.bounds
        node = str(request.node.id) if request.HasField("node") else ""
        if not node:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the first request must carry node.id")
        if len(node) > bounds.max_node_id:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"node.id longer than {bounds.max_node_id} characters")
        if not node_bound(node, self.identities):
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"node.id {clip(node, 64)!r} is not a name of the client certificate "
                           "(its SAN or CN, or <name>/<anything>)")
        if not self.servicer.nodes.connect(node, clip(str(request.node.cluster), 128), self.protocol,
                                           self.credential):
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"serving the most Envoys allowed ({self.servicer.nodes.max_nodes})")
        self.node = node
        self.servicer.say(node, logging.INFO, "xds.connected", node=node, protocol=self.protocol,
                          peer=self.peer, identity=self._identity())

    def _identity(self) -> str:
        if self.identities is None:
            return "plaintext"
        return clip(",".join(sorted(self.identities)), 200)


@dataclass(slots=True)
class _SotwType:
    names: frozenset[str] | None = None  # None: wildcard
    sent: tuple[str, frozenset[str]] | None = None  # (type version, names) of the last response
    nonce: str | None = None
    nonce_version: str = ""


@dataclass(slots=True)
class _DeltaType:
    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    known: dict[str, str] = field(default_factory=dict)  # name -> version the Envoy has (or refused)
    nonces: dict[str, str] = field(default_factory=dict)  # nonce -> type version it carried


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(self, cache: XdsCache, nodes: Nodes, bounds: AdsBounds | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self._cache = cache
        self.nodes = nodes
        self.bounds = bounds or AdsBounds()
        self._budget = LogBudget(clock or _monotonic, self.bounds.log_burst, self.bounds.log_window_s)
        self.sent: dict[str, int] = dict.fromkeys(TYPE_ORDER, 0)  # responses, by type
        self.refused: dict[str, int] = {}  # streams refused, by status code name
        self.paced = 0  # times a stream was not read for a while (it sent beyond its budget)
        self.on_sent: Callable[[str, str, str], None] | None = None  # (node, type_url, version), for benches

    def say(self, key: str, level: int, event: str, **fields: Any) -> None:
        """Log what a client caused, within its budget (`AdsBounds.log_burst` per window)."""
        self._budget.log(_log, level, clip(key, 64), event, **fields)

    @property
    def logs_suppressed(self) -> int:
        return self._budget.suppressed_total

    async def _run(self, stream: _Stream, requests: AsyncIterator[Any], context: Any,
                   handle: Callable[[Any], None], step: Callable[[], list[Any]]) -> AsyncIterator[Any]:
        listener = self._cache.listen(stream.wake)
        reader = asyncio.create_task(stream.read(requests, handle))
        first = asyncio.get_running_loop().call_later(self.bounds.first_request_s, self._first_due, stream)
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                if stream.refused is not None:
                    refused = stream.refused
                    self.refused[refused.code.name] = self.refused.get(refused.code.name, 0) + 1
                    self.say(stream.node or stream.peer, logging.WARNING, "xds.refused", code=refused.code.name,
                             reason=refused.details, peer=stream.peer, identity=stream._identity())
                    await context.abort(refused.code, refused.details)
                    return
                for response in step() if self._cache.primed else ():
                    yield response
                if stream.closed:
                    return
        finally:
            first.cancel()
            self._cache.unlisten(listener)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            if stream.node is not None:
                self.nodes.disconnect(stream.node)
                self.say(stream.node, logging.INFO, "xds.disconnected", node=stream.node, protocol=stream.protocol)

    def _first_due(self, stream: _Stream) -> None:
        """`first_request_s` after the stream opened: ended unless it has named its node."""
        if stream.node is None and stream.refused is None and not stream.closed:
            stream.refused = _Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no first request naming the node within {self.bounds.first_request_s:g} s")
            stream.wake.set()

    # -- state of the world ---------------------------------------------------------------

    async def StreamAggregatedResources(self, request_iterator: AsyncIterator[Any],
                                        context: Any) -> AsyncIterator[Any]:
        stream = _Stream(self, "sotw", context)
        types: dict[str, _SotwType] = {}

        def handle(request: Any) -> None:
            stream.identify(request)
            self._sotw_request(stream, types, request)

        async for response in self._run(stream, request_iterator, context, handle,
                                        lambda: self._sotw_responses(stream, types)):
            yield response

    def _sotw_request(self, stream: _Stream, types: dict[str, _SotwType], request: Any) -> None:
        type_url = str(request.type_url)
        if type_url not in SHORT:
            return
        if len(request.resource_names) > self.bounds.max_names:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"more than {self.bounds.max_names} resource names for {SHORT[type_url]}")
        state = types.setdefault(type_url, _SotwType())
        names = frozenset(str(n) for n in request.resource_names)
        self._check_names(type_url, names)
        if type_url in _WILDCARD_TYPES and (not names or "*" in names):
            state.names = None
        else:
            state.names = names - {"*"}
        nonce = str(request.response_nonce)
        if not nonce or nonce != state.nonce:
            return  # first request, or an answer to an older response
        state.nonce = None  # answered: the same nonce again is stale
        self._answer(stream, type_url, state.nonce_version, request)

    def _sotw_responses(self, stream: _Stream, types: dict[str, _SotwType]) -> list[Any]:
        out = []
        for type_url in TYPE_ORDER:
            state = types.get(type_url)
            if state is None:
                continue
            version = self._cache.version(type_url)
            have = self._cache.resources(type_url)
            names = frozenset(have) if state.names is None else state.names & have.keys()
            if state.sent == (version, names):
                continue
            nonce = stream.nonce()
            out.append(discovery_pb2.DiscoveryResponse(
                version_info=version, type_url=type_url, nonce=nonce,
                resources=[have[name].body for name in sorted(names)],
            ))
            state.sent, state.nonce, state.nonce_version = (version, names), nonce, version
            self._count(stream, type_url, version)
        return out

    # -- delta ----------------------------------------------------------------------------

    async def DeltaAggregatedResources(self, request_iterator: AsyncIterator[Any],
                                       context: Any) -> AsyncIterator[Any]:
        stream = _Stream(self, "delta", context)
        types: dict[str, _DeltaType] = {}

        def handle(request: Any) -> None:
            stream.identify(request)
            self._delta_request(stream, types, request)

        async for response in self._run(stream, request_iterator, context, handle,
                                        lambda: self._delta_responses(stream, types)):
            yield response

    def _delta_request(self, stream: _Stream, types: dict[str, _DeltaType], request: Any) -> None:
        type_url = str(request.type_url)
        if type_url not in SHORT:
            return
        limit = self.bounds.max_names
        if max(len(request.resource_names_subscribe), len(request.initial_resource_versions)) > limit:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"more than {limit} resource names for {SHORT[type_url]}")
        subscribe = {str(n) for n in request.resource_names_subscribe}
        unsubscribe = {str(n) for n in request.resource_names_unsubscribe}
        state = types.get(type_url)
        created = state is None
        if state is None:
            state = types[type_url] = _DeltaType()
            state.wildcard = "*" in subscribe or (type_url in _WILDCARD_TYPES and not subscribe)
            state.known = {str(k): str(v) for k, v in request.initial_resource_versions.items()}
        state.wildcard = (state.wildcard or "*" in subscribe) and "*" not in unsubscribe
        state.names |= subscribe - {"*"}
        state.names -= unsubscribe
        for name in unsubscribe:
            state.known.pop(name, None)
        if len(state.names) > limit:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"more than {limit} resource names for {SHORT[type_url]}")
        self._check_names(type_url, state.names)
        if created:
            self._bound_known(type_url, state)
        nonce = str(request.response_nonce)
        version = state.nonces.pop(nonce, None) if nonce else None
        if version is None:
            return  # no nonce, an unknown one, or one already answered
        self._answer(stream, type_url, version, request)

    def _bound_known(self, type_url: str, state: _DeltaType) -> None:
        """What Envoy says it holds on a reconnect (`initial_resource_versions`) is kept where it may be
        answered: a served name, one it subscribes to, or for a wildcard type a name to tell it was
        removed, at most `max_unknown_names` of those (the first in order; a topology that dropped more
        while the control plane was away leaves the rest in Envoy, unrouted). Never refused for that: every
        Envoy reconnects with such a list after a restart. A name past `max_name` is refused."""
        if any(len(n) > self.bounds.max_name for n in state.known):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"a resource name longer than {self.bounds.max_name}")
        have = self._cache.resources(type_url)
        kept = {n: v for n, v in state.known.items() if n in have or n in state.names}
        if state.wildcard:
            gone = sorted(n for n in state.known if n not in kept)[: self.bounds.max_unknown_names]
            kept.update((n, state.known[n]) for n in gone)
        state.known = kept

    def _check_names(self, type_url: str, names: Iterable[str]) -> None:
        """What a stream keeps per type is bounded by what is served: few unknown names, none too long."""
        have = self._cache.resources(type_url)
        unknown = 0
        for name in names:
            if len(name) > self.bounds.max_name:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"a resource name longer than {self.bounds.max_name} characters")
            unknown += name not in have and name != "*"
        if unknown > self.bounds.max_unknown_names:
            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{unknown} {SHORT[type_url]} names that are not served "
                           f"(at most {self.bounds.max_unknown_names})")

    def _answer(self, stream: _Stream, type_url: str, version: str, request: Any) -> None:
        """An ACK or NACK of the response that carried `version` (each nonce answered once)."""
        assert stream.node is not None
        message = _nack_message(request)
        if message is None:
            self.nodes.ack(stream.node, type_url, version)
            return
        text = clip(message, self.bounds.max_text)
        self.nodes.nack(stream.node, type_url, version, text)
        self.say(stream.node, logging.ERROR, "xds.nack", node=stream.node, type=SHORT[type_url], version=version,
                 error=text, note="Envoy keeps the version it last accepted")

    def _delta_responses(self, stream: _Stream, types: dict[str, _DeltaType]) -> list[Any]:
        out = []
        for type_url in TYPE_ORDER:
            state = types.get(type_url)
            if state is None:
                continue
            have = self._cache.resources(type_url)
            wanted = have.keys() if state.wildcard else state.names & have.keys()
            changed = [have[n] for n in sorted(wanted) if state.known.get(n) != have[n].version]
            removed = sorted(n for n in state.known if n not in have and (state.wildcard or n in state.names))
            if not changed and not removed:
                continue
            version = self._cache.version(type_url)
            nonce = stream.nonce()
            out.append(discovery_pb2.DeltaDiscoveryResponse(
                system_version_info=version, type_url=type_url, nonce=nonce, removed_resources=removed,
                resources=[discovery_pb2.Resource(name=r.name, version=r.version, resource=r.body)
                           for r in changed],
            ))
            for res in changed:
                state.known[res.name] = res.version
            for name in removed:
                del state.known[name]
            state.nonces[nonce] = version
            while len(state.nonces) > _MAX_NONCES:  # answers superseded by later responses
                del state.nonces[next(iter(state.nonces))]
            self._count(stream, type_url, version)
        return out

    def _count(self, stream: _Stream, type_url: str, version: str) -> None:
        self.sent[type_url] += 1
        if self.on_sent is not None and stream.node is not None:
            self.on_sent(stream.node, type_url, version)


def _monotonic() -> float:
    return asyncio.get_running_loop().time()


def ads_limits(bounds: AdsBounds) -> GrpcLimits:
    """ADS's profile of the one builder's caps (`sidecar.outputs.grpc`): one stream per Envoy."""
    return GrpcLimits(
        max_message_bytes=bounds.max_receive_bytes,
        max_send_bytes=256 * 1024 * 1024,  # a whole tree to one Envoy (thousands of clusters)
        max_concurrent_streams=bounds.max_streams_per_connection,
        min_client_ping_s=5.0,  # Envoy pings over idle streams (the bootstrap's keepalive); let it
        max_connection_idle_s=bounds.idle_timeout_s,
        max_connection_age_s=None,  # an Envoy's stream lives as long as it can: no forced re-connect
        max_connections=bounds.max_connections,
        handshake_timeout_s=bounds.handshake_timeout_s,
        max_concurrent_rpcs=bounds.max_streams,
        fixed_window_bytes=64 * 1024,
    )


def ads_server(servicer: AdsServicer, settings: GrpcSettings) -> GrpcServer:
    """The ADS service on a server of the one builder, with ADS's caps (`ads_limits`), over the
    transport `settings` names (mTLS, a Unix socket, or plaintext on loopback); not started."""
    server = GrpcServer(dataclasses.replace(settings, limits=ads_limits(servicer.bounds)))
    server.add(lambda s: ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(servicer, s), "ads")
    return server
