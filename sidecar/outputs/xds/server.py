"""Aggregated Discovery over gRPC: state of the world and delta, one grpc.aio server.

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
nonce is stale and changes nothing but its subscriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from sidecar.logs import log_event
from sidecar.outputs.xds.cache import CDS, LDS, SHORT, TYPE_ORDER, XdsCache
from sidecar.outputs.xds.nodes import Nodes

__all__ = ["AdsServicer", "serve"]

_log = logging.getLogger("sidecar.outputs.xds")
_WILDCARD_TYPES = (CDS, LDS)
_MAX_NONCES = 32


def _nack_message(request: Any) -> str | None:
    """Envoy's error text when the request is a NACK, else None."""
    if not request.HasField("error_detail"):
        return None
    detail = request.error_detail
    if detail.code == 0 and not detail.message:
        return None
    return str(detail.message) or f"code {detail.code}"


class _Stream:
    """What every stream does: its node, its wake-up, its requests."""

    def __init__(self, cache: XdsCache, nodes: Nodes, protocol: str) -> None:
        self.cache = cache
        self.nodes = nodes
        self.protocol = protocol
        self.node: str | None = None
        self.wake = asyncio.Event()
        self.inbox: list[Any] = []
        self.closed = False
        self._nonce = 0

    def nonce(self) -> str:
        self._nonce += 1
        return str(self._nonce)

    async def read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                self.inbox.append(request)
                self.wake.set()
        finally:
            self.closed = True
            self.wake.set()

    def identify(self, request: Any) -> None:
        if self.node is None:
            node = request.node.id if request.HasField("node") else ""
            if not node:
                raise _NoNode
            self.node = str(node)
            self.nodes.connect(self.node, str(request.node.cluster), self.protocol)
            log_event(_log, logging.INFO, "xds.connected", node=self.node, protocol=self.protocol)


class _NoNode(Exception):
    pass


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
    def __init__(self, cache: XdsCache, nodes: Nodes) -> None:
        self._cache = cache
        self._nodes = nodes
        self.sent: dict[str, int] = dict.fromkeys(TYPE_ORDER, 0)  # responses, by type
        self.on_sent: Callable[[str, str, str], None] | None = None  # (node, type_url, version), for benches

    async def _run(self, stream: _Stream, requests: AsyncIterator[Any], context: Any,
                   step: Callable[[], list[Any]]) -> AsyncIterator[Any]:
        listener = self._cache.listen(stream.wake)
        reader = asyncio.create_task(stream.read(requests))
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                try:
                    responses = step()
                except _NoNode:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request must carry node.id")
                    return
                for response in responses:
                    yield response
                if stream.closed and not stream.inbox:
                    return
        finally:
            self._cache.unlisten(listener)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            if stream.node is not None:
                self._nodes.disconnect(stream.node)
                log_event(_log, logging.INFO, "xds.disconnected", node=stream.node, protocol=stream.protocol)

    # -- state of the world ---------------------------------------------------------------

    async def StreamAggregatedResources(self, request_iterator: AsyncIterator[Any],
                                        context: Any) -> AsyncIterator[Any]:
        stream = _Stream(self._cache, self._nodes, "sotw")
        types: dict[str, _SotwType] = {}

        def step() -> list[Any]:
            inbox, stream.inbox = stream.inbox, []
            for request in inbox:
                stream.identify(request)
                self._sotw_request(stream, types, request)
            return self._sotw_responses(stream, types) if self._cache.primed else []

        async for response in self._run(stream, request_iterator, context, step):
            yield response

    def _sotw_request(self, stream: _Stream, types: dict[str, _SotwType], request: Any) -> None:
        type_url = str(request.type_url)
        if type_url not in SHORT:
            return
        state = types.setdefault(type_url, _SotwType())
        names = frozenset(str(n) for n in request.resource_names)
        if type_url in _WILDCARD_TYPES and (not names or "*" in names):
            state.names = None
        else:
            state.names = names - {"*"}
        nonce = str(request.response_nonce)
        if not nonce or nonce != state.nonce:
            return  # first request, or an answer to an older response
        assert stream.node is not None
        message = _nack_message(request)
        if message is None:
            self._nodes.ack(stream.node, type_url, str(request.version_info))
        else:
            self._nodes.nack(stream.node, type_url, state.nonce_version, message)
            log_event(_log, logging.ERROR, "xds.nack", node=stream.node, type=SHORT[type_url],
                      version=state.nonce_version, error=message,
                      note="Envoy keeps the version it last accepted")

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
        stream = _Stream(self._cache, self._nodes, "delta")
        types: dict[str, _DeltaType] = {}

        def step() -> list[Any]:
            inbox, stream.inbox = stream.inbox, []
            for request in inbox:
                stream.identify(request)
                self._delta_request(stream, types, request)
            return self._delta_responses(stream, types) if self._cache.primed else []

        async for response in self._run(stream, request_iterator, context, step):
            yield response

    def _delta_request(self, stream: _Stream, types: dict[str, _DeltaType], request: Any) -> None:
        type_url = str(request.type_url)
        if type_url not in SHORT:
            return
        subscribe = {str(n) for n in request.resource_names_subscribe}
        unsubscribe = {str(n) for n in request.resource_names_unsubscribe}
        state = types.get(type_url)
        if state is None:
            state = types[type_url] = _DeltaType()
            state.wildcard = "*" in subscribe or (type_url in _WILDCARD_TYPES and not subscribe)
            state.known = {str(k): str(v) for k, v in request.initial_resource_versions.items()}
        state.wildcard = (state.wildcard or "*" in subscribe) and "*" not in unsubscribe
        state.names |= subscribe - {"*"}
        state.names -= unsubscribe
        for name in unsubscribe:
            state.known.pop(name, None)
        nonce = str(request.response_nonce)
        version = state.nonces.pop(nonce, None) if nonce else None
        if version is None:
            return
        assert stream.node is not None
        message = _nack_message(request)
        if message is None:
            self._nodes.ack(stream.node, type_url, version)
        else:
            self._nodes.nack(stream.node, type_url, version, message)
            log_event(_log, logging.ERROR, "xds.nack", node=stream.node, type=SHORT[type_url], version=version,
                      error=message, note="Envoy keeps the version it last accepted")

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


async def serve(servicer: AdsServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server with the ADS service on host:port; (server, bound port)."""
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", 256 * 1024 * 1024),
        # Envoy pings over idle streams (the bootstrap's keepalive); let it.
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
    ])
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server, bound
