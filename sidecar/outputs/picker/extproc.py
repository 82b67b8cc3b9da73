"""Envoy's ext_proc, speaking the Endpoint Picker Protocol (Gateway API Inference Extension).

One gRPC stream per HTTP request. What it answers:
- the pick: header `x-gateway-destination-endpoint: ip:port` (the best), and in dynamic
  metadata `envoy.lb` -> `x-gateway-destination-endpoint` the best then the fallbacks for
  retries, `ip:port,ip:port,...` (the extension's EPP does the same: an ORIGINAL_DST
  cluster reads the header and takes exactly one address; the list starts with it);
- no pick (no pool, no eligible endpoint without a subset hint, a body it cannot read):
  the header removed and nothing else, so the proxy's own balancer decides;
- a subset hint (`envoy.lb.subset_hint` -> `x-gateway-destination-endpoint-subset`) with
  nothing eligible in it: 503 ImmediateResponse (the protocol's MUST).
A client-sent `x-gateway-destination-endpoint` is never passed on: the picker overwrites
or removes it (a client must not choose the endpoint).

Body modes: BUFFERED (confgen's render: the headers are answered at once, the pick rides on
the body answer) and FULL_DUPLEX_STREAMED (the extension's documented Envoy config: the
headers answer waits for the body's end, then the body goes back as streamed chunks).
The stream stays open until the HTTP stream ends (response end-of-stream, trailers, or the
proxy closing/resetting it); that is when the endpoint's in-flight count drops.

Bounded: the body read for the prompt is capped (`body_cap`; beyond it the pick is by load
alone), the body must arrive within `body_timeout_s` and a stream lives at most
`max_stream_s` (a generation's length); a stream that breaks either is dropped and its
request released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from confgen._openai import error_body

from .datastore import Datastore, Endpoint
from .metrics import PickerMetrics
from .prompt import block_hashes, parse_body
from .scheduling import Pick, Picker, PickRequest

__all__ = ["DESTINATION", "POOL_METADATA", "ExtProcLimits", "PickerServicer"]

DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
POOL_METADATA = "x-confgen-pool"  # gRPC initial metadata confgen's render sends per route

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_log = logging.getLogger("sidecar.picker")


@dataclass(frozen=True, slots=True)
class ExtProcLimits:
    body_cap: int = 2 * 1024 * 1024  # bytes of body read for the prompt
    body_timeout_s: float = 30.0  # from the stream's start to the body's end
    max_stream_s: float = 1800.0  # a stream (one request, its generation included) at most this long
    block_chars: int = 64
    max_blocks: int = 256


class _Stream:
    """One request's passage through the picker."""

    __slots__ = ("body", "client", "decided", "endpoint", "expired", "headers_held", "oversize", "picked_at", "pool",
                 "predicted", "streamed", "streamed_response", "subset", "task")

    def __init__(self, pool: str | None) -> None:
        self.pool = pool
        self.streamed = False  # FULL_DUPLEX_STREAMED request body
        self.streamed_response = False
        self.headers_held = False  # full duplex: the headers answer waits for the pick
        self.body = bytearray()
        self.oversize = False
        self.subset: frozenset[str] | None = None
        self.endpoint: Endpoint | None = None  # in flight there until released
        self.decided = False  # picked, or left to the proxy
        self.expired = False
        self.task: asyncio.Task[Any] | None = None  # the RPC's, to end it when past its bound
        self.client: str | None = None  # the authenticated client id the proxy forwarded
        self.picked_at = 0.0
        self.predicted: float | None = None  # seconds to finish, as predicted at the pick


def _subset(msg: pb.ProcessingRequest) -> frozenset[str] | None:
    meta = msg.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    value = meta[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(a.strip() for a in value.string_value.split(",") if a.strip())


_OVERLOADED = json.dumps(error_body("overloaded"), separators=(",", ":")).encode()


def _overloaded(past_budget_s: float) -> pb.ProcessingResponse:
    """429 at once: the earliest predicted start is `past_budget_s` beyond the class's budget."""
    retry = str(max(1, min(60, math.ceil(past_budget_s))))
    headers = pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=retry.encode()),
                                   append_action=_OVERWRITE),
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
                                   append_action=_OVERWRITE)])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=http_status_pb2.TooManyRequests), headers=headers,
        body=_OVERLOADED, details="confgen picker: predicted wait past the class's budget"))


class PickerServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, store: Datastore, picker: Picker, metrics: PickerMetrics, *,
                 limits: ExtProcLimits | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.store = store
        self.picker = picker
        self.metrics = metrics
        self.limits = limits or ExtProcLimits()
        self._clock = clock

    # -- the pick -----------------------------------------------------------------------

    def choose(self, st: _Stream) -> pb.ProcessingResponse | tuple[base_pb2.HeaderValueOption | None, Pick | None]:
        """The destination header for this request (None: leave it to the proxy), or a 503."""
        started = self._clock()
        st.decided = True
        prompt = parse_body(bytes(st.body)) if st.body and not st.oversize else None
        pool = st.pool or self.store.pool_for(prompt.model if prompt else None)
        if pool is None and st.subset:
            pool = self.store.pool_holding(st.subset)
        if pool is None:  # another policy's pool, or a model no pool serves
            self.metrics.unpicked.labels(reason="not_ours").inc()
            return None, None
        hashes = block_hashes(prompt.text, prompt.model, block_chars=self.limits.block_chars,
                              max_blocks=self.limits.max_blocks) if prompt else []
        traffic_class = self.store.classes.of(st.client, prompt.model if prompt else None)
        pick = self.picker.pick(PickRequest(pool, prompt, hashes, st.subset, traffic_class), self.store.endpoints(pool))
        if pick.refused_for_s is not None:
            self.metrics.refused.labels(pool=pool, **{"class": traffic_class}).inc()
            return _overloaded(pick.refused_for_s)
        if not pick.endpoints:
            if st.subset is not None:
                self.metrics.picks.labels(pool=pool, reason="unavailable").inc()
                return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
                    status=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
                    body=b'{"error":{"message":"no ready endpoint in the requested subset","type":"unavailable"}}',
                    details="confgen picker: no eligible endpoint in subset"))
            self.metrics.unpicked.labels(reason="none_ready").inc()
            return None, None
        chosen = pick.endpoints[0]
        chosen.in_flight += 1
        st.endpoint = chosen
        st.pool = pool
        st.picked_at = self._clock()
        st.predicted = pick.predicted.own_s if pick.predicted is not None else None
        if hashes:
            chosen.index.add(hashes)
        self.metrics.observe_pick(pool, pick, self._clock() - started)
        header = base_pb2.HeaderValue(key=DESTINATION, raw_value=chosen.address.encode())
        return base_pb2.HeaderValueOption(header=header, append_action=_OVERWRITE), pick

    def release(self, st: _Stream, *, finished: bool = False) -> None:
        """The request's in-flight count ends; `finished`: its response ended normally, so its
        time is compared with the prediction."""
        if st.endpoint is not None:
            st.endpoint.in_flight = max(0, st.endpoint.in_flight - 1)
            if finished and st.predicted is not None and st.pool is not None:
                self.metrics.observe_finish(st.pool, st.predicted, self._clock() - st.picked_at)
            st.endpoint = None

    @staticmethod
    def _answer(kind: str, decision: base_pb2.HeaderValueOption | None,
                pick: Pick | None) -> pb.ProcessingResponse:
        mutation = (pb.HeaderMutation(set_headers=[decision]) if decision is not None
                    else pb.HeaderMutation(remove_headers=[DESTINATION]))
        common = pb.CommonResponse(header_mutation=mutation)
        if kind == "headers":
            out = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
        else:
            out = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
        if decision is not None and pick is not None:
            lb = struct_pb2.Struct()
            lb.update({DESTINATION: ",".join(e.address for e in pick.endpoints)})
            out.dynamic_metadata.fields[LB_NAMESPACE].struct_value.CopyFrom(lb)
        return out

    def _picked(self, st: _Stream, kind: str) -> pb.ProcessingResponse:
        result = self.choose(st)
        if isinstance(result, pb.ProcessingResponse):
            return result
        return self._answer(kind, *result)

    # -- the stream ---------------------------------------------------------------------

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.ProcessingResponse]:
        pool = next((v for k, v in context.invocation_metadata() or () if k == POOL_METADATA), None)
        st = _Stream(pool if isinstance(pool, str) else None)
        self.metrics.streams.inc()
        loop = asyncio.get_running_loop()
        st.task = asyncio.current_task()
        # One timer per stream, not one per message: the body's bound, then the generation's.
        timer = loop.call_at(loop.time() + self.limits.body_timeout_s, self._expire, st, context)
        try:
            async for msg in request_iterator:
                was_decided = st.decided
                for out in self._step(st, msg):
                    yield out
                if st.decided and not was_decided:
                    timer.cancel()
                    timer = loop.call_at(loop.time() + self.limits.max_stream_s, self._expire, st, context)
            self.release(st, finished=True)  # the proxy closed the stream: the response has ended
        except asyncio.CancelledError:
            if not st.expired:
                raise
        finally:  # ended, reset by the proxy (cancelled) or timed out
            timer.cancel()
            self.release(st)

    def _expire(self, st: _Stream, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """A stream past its bound: count it, release its request and end the RPC."""
        st.expired = True
        self.metrics.unpicked.labels(reason="timeout" if not st.decided else "stream_timeout").inc()
        self.release(st)
        task = st.task
        if task is not None:
            task.cancel()

    def _step(self, st: _Stream, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            st.streamed = msg.protocol_config.request_body_mode == _FULL_DUPLEX
            st.streamed_response = msg.protocol_config.response_body_mode == _FULL_DUPLEX
        if msg.metadata_context.filter_metadata:
            subset = _subset(msg)
            if subset is not None:
                st.subset = subset
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            header = self.store.classes.client_header
            if header is not None:
                st.client = next((h.raw_value.decode("utf-8", "replace") or h.value
                                  for h in msg.request_headers.headers.headers if h.key == header), None)
            if msg.request_headers.end_of_stream:
                # No body: not an inference request (GET /v1/models, /health). Leave it to the proxy,
                # unless it came with a subset hint, which the protocol says must be honoured.
                if st.subset is None:
                    st.decided = True
                    self.metrics.unpicked.labels(reason="no_body").inc()
                    return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                        header_mutation=pb.HeaderMutation(remove_headers=[DESTINATION]))))]
                return [self._picked(st, "headers")]
            if st.streamed:
                st.headers_held = True
                return []
            # BUFFERED: answer now (drop any client copy of the header); the pick rides on the body.
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(remove_headers=[DESTINATION]))))]
        if kind == "request_body":
            return self._body(st, msg.request_body)
        if kind == "request_trailers":
            out = self._flush(st) if st.headers_held else []
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            if msg.response_headers.end_of_stream:
                self.release(st, finished=True)
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if kind == "response_body":
            body = msg.response_body
            if body.end_of_stream:
                self.release(st, finished=True)
            if st.streamed_response:
                return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=body.body, end_of_stream=body.end_of_stream)))))]
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if kind == "response_trailers":
            self.release(st, finished=True)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _body(self, st: _Stream, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if not st.streamed:
            if len(body.body) > self.limits.body_cap:
                st.oversize = True
            else:
                st.body += body.body
            return [self._picked(st, "body")]
        if not st.headers_held:  # picked already (oversize): pass the chunk through
            return [self._chunk(body.body, body.end_of_stream)]
        st.body += body.body
        if len(st.body) > self.limits.body_cap:
            st.oversize = True
            return self._flush(st, end_of_stream=body.end_of_stream)
        if body.end_of_stream:
            return self._flush(st, end_of_stream=True)
        return []

    def _flush(self, st: _Stream, end_of_stream: bool = False) -> list[pb.ProcessingResponse]:
        """Full duplex: pick, answer the held headers, then send the body held so far back."""
        st.headers_held = False
        answer = self._picked(st, "headers")
        if answer.HasField("immediate_response"):
            return [answer]
        body, st.body = bytes(st.body), bytearray()
        return [answer, self._chunk(body, end_of_stream)]

    @staticmethod
    def _chunk(data: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=data, end_of_stream=end_of_stream)))))


