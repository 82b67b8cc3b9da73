"""Envoy's ext_proc, speaking the Endpoint Picker Protocol (Gateway API Inference Extension).

One gRPC stream per HTTP request. What it answers:
- the pick: header `x-gateway-destination-endpoint: ip:port` (the best), and in dynamic
  metadata `envoy.lb` -> `x-gateway-destination-endpoint` the best then the fallbacks for
  retries, `ip:port,ip:port,...` (the extension's EPP does the same: an ORIGINAL_DST
  cluster reads the header and takes exactly one address; the list starts with it);
- no pick (no pool, no eligible endpoint, a body it cannot read or over the cap, too many
  open streams): the header removed and nothing else, so the proxy's own balancer decides;
- a subset hint (`envoy.lb.subset_hint` -> `x-gateway-destination-endpoint-subset`), read
  only when the servicer is built with `honour_subset_hint=True` (confgen's render never
  has Envoy send one, so by default a hint is ignored: a client must not narrow the pick):
  the pick is made within it, and nothing eligible in it is a 503 ImmediateResponse (the
  protocol's MUST).
A client-sent `x-gateway-destination-endpoint` is never passed on: the picker overwrites
or removes it (a client must not choose the endpoint).

Global budgets (with `budgets` and the topology's route checks, budgets.py): on a BUFFERED body,
before the pick, the route's budgets are decided in this call; spent: a 429 ImmediateResponse and
no pick; admitted: the answer also marks the request checked (limits.CHECKED_HEADER) and carries
the x-ratelimit-* values in metadata (limits.BUDGET_NS). Not checked here (loop behind, busy, no
body, another body mode): no mark, so Envoy's rate limit filter checks it.

Each stream is a state machine (`Phase`):

    HEADERS --request_headers--> BODY --body read / cap passed--> DECIDED --response--> RESPONSE
       any --stream ends, is reset, times out, or breaks the protocol--> CLOSED

The body mode is the one the stream declares (`protocol_config` on its first message;
none declared: BUFFERED, confgen's render):
- BUFFERED (and BUFFERED_PARTIAL): the headers are answered at once, the one body message
  carries the pick;
- FULL_DUPLEX_STREAMED (the extension's documented Envoy config): the headers answer waits
  for the body's end, then the body goes back as streamed chunks; past the pick, chunks
  pass through unread;
- NONE, STREAMED, GRPC: the router has the headers before any body, so the pick rides on
  the headers answer, by load alone; body chunks are answered and not read.
Exactly one decision (pick or no pick) per stream. A message out of order for the mode
(a second request_headers, a body after a BUFFERED body or after end_of_stream, a response
before the request was decided, anything after the response ended, protocol_config after
the first message) is a protocol error: the stream ends with INVALID_ARGUMENT and releases
what it holds.

Held (the lobby, lobby.py; `PickerPolicy.hold`, on by default): a BUFFERED body whose pool has every
slot taken while admission is off is not answered at once; the stream first gets an
`override_message_timeout` (Envoy's 200 ms message timeout extended, within the rendered
max_message_timeout), waits for a slot, then is decided as any other (placed, or refused once
admission opened with its wait counted). A stream reset while it waits leaves the lobby.

In flight: a picked stream counts one on its endpoint until the response ends (response
end-of-stream or trailers) or the stream does (closed, reset, timed out, protocol error),
whichever comes first, and exactly once.

Bounded: the body read for the prompt is capped in total across its messages (`body_cap`;
past it the request is answered without a pick and nothing more is held); parsing is
bounded in items as well as bytes (see `prompt`); the body must arrive within
`body_timeout_s`, a stream lives at most `max_stream_s` (a generation's length), and at
most `max_open_streams` streams are tracked at once: a stream beyond that is answered
without a pick at once (`confgen_picker_unpicked_total{reason="busy"}`) and counts nothing
in flight, so streams that are held open can neither grow memory nor hold in-flight counts
past `max_stream_s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, json_format, struct_pb2

from confgen._openai import error_body
from confgen.envoy import PICKER_LATE_MODE, PICKER_MAX_HOLD_S, REQUEST_TIME_ATTRIBUTE, ROUTE_NAME_ATTRIBUTE
from confgen.errors import ConfgenError
from confgen.limits import BUDGET_NS, CHECKED_HEADER
from sidecar.observe.probe import LoopLag
from sidecar.outputs.contract import Budgets

from .budgets import RouteChecks, budget_metadata, refusal_headers
from .datastore import Datastore, Endpoint
from .lateness import LATE_S, Lateness, parse_request_time
from .lobby import Lobby, Outcome
from .metrics import PickerMetrics
from .prompt import MAX_ITEMS, block_hashes, parse_body
from .scheduling import Pick, Picker, PickRequest, free_slots

__all__ = ["DESTINATION", "POOL_METADATA", "BodyMode", "ExtProcLimits", "Phase", "PickerServicer", "ProtocolError"]

DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
PICKER_FILTER_NAME = "envoy.filters.http.ext_proc"  # the key Envoy files the request attributes under
# gRPC initial metadata naming the request's pool: a caller's hint, taken only for a pool the picker
# serves (confgen's render sends none: the matched route's name says the pool)
POOL_METADATA = "x-confgen-pool"
# Sent by confgen's rendered Envoy on each stream (grpc_service.initial_metadata, confgen.envoy): the status
# to answer a refusal with, one Envoy never answers on its own, which its local reply maps to 429 `overloaded`
# keeping this picker's retry-after (a 429 of ours was taken for a rate limit's: its body and retry-after
# replaced). Without it (a gateway calling the picker as its EPP) the refusal is a 429 as it stands.
SHED_STATUS_METADATA = "x-confgen-shed-status"
_SHED_STATUSES = frozenset({"507"})

_MODE = processing_mode_pb2.ProcessingMode
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# the one override confgen's render allows (`allowed_override_modes`): nothing more to the picker
_LATE_MODE = json_format.ParseDict(PICKER_LATE_MODE, _MODE())
_log = logging.getLogger("sidecar.picker")
MAX_PEERS = 4096  # gRPC connections whose request ages are floored apart (then all start over)
LOBBY_TICK_S = 0.02  # while requests wait in the lobby: how often slots freed elsewhere (peers, probes) are seen
HOLD_MARGIN_S = 0.5  # the proxy's message timeout, extended for a held request, outlasts its hold by this


class _Hold:
    """The answer to a request is held (the lobby): the stream waits for a slot, then is decided."""


HOLD = _Hold()


@dataclass(frozen=True, slots=True)
class ExtProcLimits:
    body_cap: int = 2 * 1024 * 1024  # bytes of body read for the prompt, all its messages together
    body_timeout_s: float = 30.0  # from the stream's start to the body's end
    max_stream_s: float = 1800.0  # a stream (one request, its generation included) at most this long
    block_chars: int = 64
    max_blocks: int = 256
    max_items: int = MAX_ITEMS  # messages, content parts or token ids read of one body
    max_open_streams: int = 8192  # streams tracked at once; beyond: answered without a pick
    # The loop this late (the proxy's 200 ms message timeout is running on every queued message):
    # answer at once without a pick, so Envoy uses its own balancer now rather than after the timeout.
    behind_s: float = 0.05
    # A request that reaches the picker this late (its age past the floor of recent ages, from the
    # `request.time` confgen's render has Envoy send; `lateness`): answered at once without a pick,
    # on its headers with the stream ended there (PICKER_LATE_MODE), or on its body.
    late_s: float = LATE_S
    # A request read this late or later has queued before the picker (counted in `waited`): the
    # bypass share's signal (bypass.py), so the picker sheds load before its queue reaches `late_s`.
    wait_s: float = 0.005


class Phase(StrEnum):
    HEADERS = "headers"  # expecting request_headers
    BODY = "body"  # the request body is being read
    DECIDED = "decided"  # picked or left to the proxy; the request's rest passes
    RESPONSE = "response"  # the response is passing
    CLOSED = "closed"


class BodyMode(StrEnum):
    BUFFERED = "buffered"  # one body message; the pick rides on its answer
    DUPLEX = "full_duplex"  # headers held until the body's end; the body sent back in chunks
    NONE = "none"  # the picker does not read the body; the pick rides on the headers answer


_MODES = {_MODE.BUFFERED: BodyMode.BUFFERED, _MODE.BUFFERED_PARTIAL: BodyMode.BUFFERED,
          _MODE.FULL_DUPLEX_STREAMED: BodyMode.DUPLEX}


class ProtocolError(ConfgenError):
    """A message out of order for the stream's phase and mode: the stream ends."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind  # the metric's label


class _Stream:
    """One request's passage through the picker."""

    __slots__ = ("body", "body_ended", "checked", "client", "endpoint", "expired", "first", "headers", "lateness",
                 "mode", "peer", "pending", "phase", "picked_at", "pool", "predicted", "response_ended", "route",
                 "sent_at", "shed_status", "skip", "streamed_response", "subset", "task", "trailers")

    def __init__(self, pool: str | None) -> None:
        self.pool = pool
        self.phase = Phase.HEADERS
        self.mode = BodyMode.BUFFERED  # until protocol_config says otherwise
        self.streamed_response = False
        self.first = True  # no message seen yet
        self.body = bytearray()  # full duplex: the body held until the pick (at most body_cap)
        self.body_ended = False
        self.trailers = False
        self.response_ended = False
        self.skip: str | None = None  # decided without a pick before the body is read: the reason
        self.subset: frozenset[str] | None = None
        self.endpoint: Endpoint | None = None  # in flight there until released
        self.expired = False
        self.task: asyncio.Task[Any] | None = None  # the RPC's, to end it when past its bound
        self.client: str | None = None  # the authenticated client id the proxy forwarded
        self.route: str | None = None  # the name of the route Envoy matched (ext_proc attribute)
        self.sent_at: float | None = None  # when the proxy received the request (ext_proc attribute)
        self.peer = ""  # the gRPC connection it came on (one proxy's: its clock is the one sent_at is on)
        self.lateness: Lateness | None = None  # the ages of that connection's requests (None: no request.time)
        self.picked_at = 0.0
        self.predicted: float | None = None  # seconds to finish, as predicted at the pick
        self.headers: dict[str, str] | None = None  # the request headers its budgets' check reads (a route with one)
        self.checked: tuple[tuple[str, str], ...] | None = None  # its budgets admitted it: the x-ratelimit-* headers
        self.pending: PickRequest | None = None  # held in the lobby: the pick to make when it is woken
        self.shed_status: int = http_status_pb2.TooManyRequests  # a refusal's status (SHED_STATUS_METADATA)

    @property
    def decided(self) -> bool:
        return self.phase in (Phase.DECIDED, Phase.RESPONSE, Phase.CLOSED)


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


def _route_name(msg: pb.ProcessingRequest) -> str | None:
    """The matched route's name, which confgen's render has Envoy send with the headers
    (`confgen.envoy.ROUTE_NAME_ATTRIBUTE`, under the filter's name); None when absent."""
    attrs = msg.attributes.get(PICKER_FILTER_NAME)
    if attrs is None:
        return None
    value = attrs.fields.get(ROUTE_NAME_ATTRIBUTE)
    return (value.string_value or None) if value is not None else None


def _request_time(msg: pb.ProcessingRequest) -> float | None:
    """When the proxy received the request (`confgen.envoy.REQUEST_TIME_ATTRIBUTE`), seconds since
    the epoch; None when absent or not a time."""
    attrs = msg.attributes.get(PICKER_FILTER_NAME)
    value = attrs.fields.get(REQUEST_TIME_ATTRIBUTE) if attrs is not None else None
    return parse_request_time(value.string_value) if value is not None else None


def _remove_destination() -> pb.CommonResponse:
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=[DESTINATION]))


def _chunk(data: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=data, end_of_stream=end_of_stream)))))


_OVERLOADED = json.dumps(error_body("overloaded"), separators=(",", ":")).encode()
_RATE_LIMITED = json.dumps(error_body("rate_limited"), separators=(",", ":")).encode()


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                                      append_action=_OVERWRITE)


def _rate_limited(headers: Sequence[tuple[str, str]]) -> pb.ProcessingResponse:
    """429 at once: a global budget of the request is spent (the answer Envoy's rate limit filter gives)."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=http_status_pb2.TooManyRequests),
        headers=pb.HeaderMutation(set_headers=[_set(k, v) for k, v in refusal_headers(headers)]),
        body=_RATE_LIMITED, details="confgen picker: a global budget is spent"))


def _forwarded(msg: pb.ProcessingRequest) -> dict[str, dict[str, str]]:
    """The dynamic metadata the proxy forwarded with the message (its string values)."""
    return {ns: {k: v.string_value for k, v in struct.fields.items() if v.WhichOneof("kind") == "string_value"}
            for ns, struct in msg.metadata_context.filter_metadata.items()}


def _overloaded(past_budget_s: float, status: int = http_status_pb2.TooManyRequests) -> pb.ProcessingResponse:
    """429 at once (or `status`, which the proxy maps to it): the earliest predicted start is `past_budget_s`
    beyond the class's budget."""
    retry = str(max(1, min(60, math.ceil(past_budget_s))))
    headers = pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=retry.encode()),
                                   append_action=_OVERWRITE),
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
                                   append_action=_OVERWRITE)])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=headers,
        body=_OVERLOADED, details="confgen picker: predicted wait past the class's budget"))


# Why a request is answered without a pick although it is the picker's: it reached the picker late, or
# over its cap of tracked streams. Under admission such a request is refused as the pool's last prediction
# says (`PickerServicer._untaken`), so a picker that cannot keep up lets none of a surge past admission.
UNTAKEN = ("behind", "busy")


class PickerServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, store: Datastore, picker: Picker, metrics: PickerMetrics, *,
                 limits: ExtProcLimits | None = None, clock: Callable[[], float] = time.perf_counter,
                 honour_subset_hint: bool = False, lag: LoopLag | None = None, wall: Callable[[], float] = time.time,
                 on_placed: Callable[[str, str, Sequence[int]], None] | None = None,
                 budgets: Budgets | None = None) -> None:
        self.store = store
        self.budgets = budgets  # the sidecar's decider of global budgets (its `check`, None without)
        self.checks: RouteChecks | None = None  # the routes' budget descriptors (set per topology)
        self.on_placed = on_placed  # (pool, address, block hashes) of every pick: the peer replicas' share
        self.picker = picker
        self.metrics = metrics
        self.limits = limits or ExtProcLimits()
        self.honour_subset_hint = honour_subset_hint
        self.lag = lag  # the picker's loop's lateness (None: never considered behind)
        # how late requests reach it (from the proxy's request.time), per gRPC connection: each proxy has
        # its own clock, and a connection's ages never move another's floor
        self.lateness: dict[str, Lateness] = {}
        self._wall = wall  # the clock request.time is compared with
        self._clock = clock
        self._open: set[_Stream] = set()  # streams tracked (not over max_open_streams)
        # the bypass share's input (bypass.py): streams started; of them, those whose headers were read over
        # `wait_s` late, and those answered late (no pick: late headers or body, or the loop behind)
        self.seen = 0
        self.waited = 0
        self.late = 0
        self.lobby = Lobby(clock)  # requests held while every slot of their pool is taken (policy `hold`)
        self._tick: asyncio.TimerHandle | None = None

    def open_streams(self) -> int:
        return len(self._open)

    # -- the decision -------------------------------------------------------------------

    def choose(self, st: _Stream, may_hold: bool = False
               ) -> pb.ProcessingResponse | tuple[base_pb2.HeaderValueOption | None, Pick | None] | _Hold:
        """Decide, once: the destination header for this request (None: leave it to the
        proxy), or a 429 or 503; with `may_hold`, HOLD while every slot of its pool is taken (the
        request waits in the lobby, then `place` decides it). Moves the stream to DECIDED."""
        if st.decided:
            raise ProtocolError("second_decision", "the request was decided already")
        st.phase = Phase.DECIDED
        body, st.body = bytes(st.body), bytearray()
        if st.skip is not None or self._behind(st):
            skip = st.skip or "behind"  # behind: no parse, no score, the proxy decides now
            self.metrics.unpicked.labels(reason=skip).inc()
            if skip not in UNTAKEN:
                return None, None
            self.late += skip == "behind"
            refusal = self._untaken(st)
            return (None, None) if refusal is None else refusal
        started = self._clock()
        limits = self.limits
        prompt = parse_body(body, max_chars=limits.block_chars * limits.max_blocks,
                            max_items=limits.max_items) if body else None
        pool = self._pool_of(st, prompt.model if prompt else None)
        if pool is None and st.subset:
            pool = self.store.pool_holding(st.subset)
        if pool is None:  # another policy's pool, or a model no pool serves
            self.metrics.unpicked.labels(reason="not_ours").inc()
            return None, None
        hashes = block_hashes(prompt.text, prompt.model, block_chars=limits.block_chars,
                              max_blocks=limits.max_blocks) if prompt else []
        traffic_class = self.store.classes.of(st.client, prompt.model if prompt else None, pool, st.route)
        req = PickRequest(pool, prompt, hashes, st.subset, traffic_class, saturated=self.store.saturated(pool))
        endpoints = self.store.endpoints(pool)
        if may_hold and self._holds(req, endpoints):
            st.pending = req
            return HOLD
        return self.place(st, req, endpoints, started)

    def _holds(self, req: PickRequest, endpoints: Sequence[Endpoint]) -> bool:
        """The request waits in the lobby: the policy holds, it is not critical, someone waits already
        or no slot is free, and admission is off in its pool. Admission on: whoever waits is woken to be
        decided now, and this request is placed at once (by the admission rule)."""
        if not self.picker.policy.hold or req.traffic_class == "critical" or req.subset is not None:
            return False
        ahead = self.lobby.depth(req.pool)
        if not ahead and free_slots(endpoints) > self.lobby.claimed(req.pool):
            return False
        opened = self.picker.observe_held(req, endpoints, ahead)
        if opened is None:
            return False
        if opened:
            self.lobby.open(req.pool)
            return False
        return True

    def place(self, st: _Stream, req: PickRequest, endpoints: Sequence[Endpoint], started: float
              ) -> pb.ProcessingResponse | tuple[base_pb2.HeaderValueOption | None, Pick | None]:
        """Pick for the request now (and refuse it, when admission says so)."""
        pool, hashes = req.pool, req.hashes
        pick = self.picker.pick(req, endpoints)
        if self.lobby.depth(pool) and self.picker.admission.admitting(pool):
            self.lobby.open(pool)  # admission opened on this pick: whoever waits is decided now
        if pick.refused_for_s is not None:
            return self._refuse(st, req.pool, req.traffic_class, pick.refused_for_s)
        if not pick.endpoints:
            if st.subset is not None:
                self.metrics.picks.labels(pool=pool, reason="unavailable").inc()
                st.phase = Phase.CLOSED  # the proxy answers and ends the stream
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
            if self.on_placed is not None:
                self.on_placed(pool, chosen.address, hashes)
        self.metrics.observe_pick(pool, pick, self._clock() - started)
        header = base_pb2.HeaderValue(key=DESTINATION, raw_value=chosen.address.encode())
        return base_pb2.HeaderValueOption(header=header, append_action=_OVERWRITE), pick

    def _behind(self, st: _Stream) -> bool:
        """The picker's loop runs late, or this request reached it late (`late_s` past the floor)."""
        if self.lag is not None and self.lag.behind_s() > self.limits.behind_s:
            return True
        return (st.sent_at is not None and st.lateness is not None
                and st.lateness.since(st.sent_at, self._wall()) > self.limits.late_s)

    def _refuse(self, st: _Stream, pool: str, traffic_class: str, past_budget_s: float) -> pb.ProcessingResponse:
        """Admission's 429, counted by pool and class; the proxy answers it and ends the stream."""
        self.metrics.refused.labels(pool=pool, **{"class": traffic_class}).inc()
        st.phase = Phase.CLOSED
        return _overloaded(past_budget_s, st.shed_status)

    def _late_headers(self, st: _Stream) -> list[pb.ProcessingResponse | _Hold]:
        """A request whose headers reached the picker late: no pick, and nothing more of it sent here (the
        stream ends with this answer, so shedding costs one message, not a body and a response)."""
        st.skip = "behind"
        out = self._picked(st, "headers")
        if not out.HasField("immediate_response"):
            out.mode_override.CopyFrom(_LATE_MODE)
        return [out]

    def _pool_of(self, st: _Stream, model: str | None) -> str | None:
        """The picker's pool of the request: the one its matched route names (None: another policy's),
        else the proxy's, else the one its model routes to (None: not the picker's)."""
        named, pool = self.store.pool_of_route(st.route)
        if not named:
            pool = st.pool if self.store.serves(st.pool) else self.store.pool_for(model)
        return pool

    def _untaken(self, st: _Stream) -> pb.ProcessingResponse | None:
        """A request the picker could not take (it came late, or past `max_open_streams`: `UNTAKEN`) still
        arrived: into its pool's spike window (its body unread, so no model: the pool its route names, the
        proxy's, or the only one). While admission is on there it is refused as the pool's last prediction
        says (`Admission.refusal_unread`), where its class is known without its body; else (None) the proxy
        places it, unadmitted."""
        pool = self._pool_of(st, None)
        if pool is None:
            return None
        self.picker.admission.arrived(pool)
        traffic_class = self.store.classes.without_body(st.client, pool, st.route)
        if traffic_class is None:
            return None
        past_s = self.picker.admission.refusal_unread(pool, traffic_class, self.store.saturated(pool))
        return None if past_s is None else self._refuse(st, pool, traffic_class, past_s)

    def release(self, st: _Stream, *, finished: bool = False) -> None:
        """The stream's request no longer in flight; idempotent. `finished`: its response ended
        normally, so its time is compared with the prediction. A slot freed: the lobby's first waiter
        of the pool is woken."""
        if st.endpoint is not None:
            st.endpoint.in_flight -= 1
            if finished and st.predicted is not None and st.pool is not None:
                self.metrics.observe_finish(st.pool, st.predicted, self._clock() - st.picked_at)
            st.endpoint = None
            if st.pool is not None and self.lobby.depth(st.pool):
                self._wake(st.pool)

    # -- the lobby (policy `hold`) --------------------------------------------------------

    async def _hold(self, st: _Stream) -> AsyncIterator[pb.ProcessingResponse]:
        """Wait in the lobby for a slot (or admission to open, or `hold_max_s`), then answer as `_picked`
        would, the wait counted in the request's delay. The proxy's message timeout is extended first
        (its max_message_timeout, rendered PICKER_MAX_HOLD_S), so it does not give up on the answer."""
        req = st.pending
        assert req is not None
        hold_s = min(self.picker.policy.hold_max_s, PICKER_MAX_HOLD_S - HOLD_MARGIN_S)
        waiter = self.lobby.join(req.pool, req.traffic_class, hold_s)
        self.metrics.lobby.labels(pool=req.pool).set(self.lobby.depth(req.pool))
        self._arm_tick()
        outcome = "reset"  # the stream ended while it waited (the client went, or the proxy gave up on it)
        timeout = duration_pb2.Duration()
        timeout.FromTimedelta(timedelta(seconds=hold_s + HOLD_MARGIN_S))
        try:
            yield pb.ProcessingResponse(override_message_timeout=timeout)
            outcome = (await waiter.future).value
        finally:
            waited = self.lobby.leave(waiter)
            self.metrics.lobby.labels(pool=req.pool).set(self.lobby.depth(req.pool))
            self.metrics.held.labels(pool=req.pool, outcome=outcome).inc()
            self.metrics.held_seconds.observe(waited)
        st.pending = None
        req.waited_s = waited
        # admission as it stands now, not at its arrival; woken because admission opened, it is decided
        # by admission even if the gate has closed since (a spike's gate flickers: placed without it,
        # the waiters of one opening would flood the engines' queues)
        req.saturated = self.store.saturated(req.pool) or outcome == "open"
        budget = self.picker.admission.budget(req.pool, req.traffic_class) if outcome == "open" else None
        if budget is not None and waited > budget:
            # its wait alone is past its budget: refused without a pick (admission opening wakes every
            # waiter at once; a pick for each, on a deep lobby, would stall the loop for the others)
            yield self._refuse(st, req.pool, req.traffic_class, waited - budget)
            return
        started = self._clock()
        yield self._answer_for(st, "body", self.place(st, req, self.store.endpoints(req.pool), started))

    def _arm_tick(self) -> None:
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(LOBBY_TICK_S, self._on_tick)

    def _on_tick(self) -> None:
        """While anyone waits: slots freed where this picker does not see a release (a peer's request,
        one that bypassed the picker, a new endpoint) wake waiters; admission opened (the pressure, a
        spike, the daemon's verdict) wakes them all to be decided; a pool gone from the fleet view wakes
        its waiters to be left to the proxy."""
        self._tick = None
        for pool in self.lobby.pools():
            if not self.store.serves(pool):  # a topology reload removed it: nothing will free a slot there
                self.lobby.open(pool, Outcome.GONE)
            elif self.picker.admission.admitting(pool) or self.store.saturated(pool):
                self.lobby.open(pool)
            else:
                self._wake(pool)
        if self.lobby.pools():
            self._arm_tick()

    def _wake(self, pool: str) -> None:
        """One waiter of the pool woken for each slot free now."""
        self.lobby.wake(pool, free_slots(self.store.endpoints(pool)))

    def finish(self, st: _Stream) -> None:
        """The stream is over, however it ended: release it and forget it."""
        st.phase = Phase.CLOSED
        st.body = bytearray()
        self.release(st)
        if st in self._open:
            self._open.discard(st)
            self.metrics.open_streams.set(len(self._open))

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
        assert not isinstance(result, _Hold)  # only a buffered body may wait (`_picked_or_held`)
        return self._answer_for(st, kind, result)

    def _picked_or_held(self, st: _Stream) -> pb.ProcessingResponse | _Hold:
        """The answer on a BUFFERED body, or HOLD."""
        result = self.choose(st, may_hold=True)
        return result if isinstance(result, _Hold) else self._answer_for(st, "body", result)

    def _answer_for(self, st: _Stream, kind: str, result: pb.ProcessingResponse | tuple[
            base_pb2.HeaderValueOption | None, Pick | None]) -> pb.ProcessingResponse:
        if isinstance(result, pb.ProcessingResponse):
            return result
        out = self._answer(kind, *result)
        if st.checked is not None:  # its budgets admitted it here: Envoy's filter must not check it again
            common = out.request_body.response if kind == "body" else out.request_headers.response
            common.header_mutation.set_headers.append(_set(CHECKED_HEADER, "1"))
            values = budget_metadata(st.checked)
            if values:
                out.dynamic_metadata.fields[BUDGET_NS].struct_value.update(values)
        return out

    # -- the global budgets, decided in this call (budgets.py) --------------------------

    def _check_due(self, st: _Stream, msg: pb.ProcessingRequest) -> bool:
        """The request's budgets are checked here: its route has some, the body is the one BUFFERED message
        (the pick rides on its answer), the stream is tracked, and the loop is not behind (then Envoy's
        filter checks it: no request waits on a late picker)."""
        return (st.headers is not None and st.phase is Phase.BODY and st.mode is BodyMode.BUFFERED
                and msg.HasField("request_body") and st.skip != "busy" and not self._behind(st))

    async def _check_budgets(self, st: _Stream, msg: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        """None: go on (admitted, `st.checked` set; or left to Envoy's filter); else the 429."""
        decider = self.budgets.check if self.budgets is not None else None
        checks = self.checks
        if decider is None or checks is None or st.route is None or st.route not in checks:
            return None
        assert st.headers is not None  # _check_due
        descriptors = checks.descriptors(st.route, st.headers, _forwarded(msg))
        if not descriptors:  # none applies (Envoy's filter would send none either)
            st.checked = ()
            return None
        answer = await decider.check(descriptors)
        self.metrics.budget_checks.labels(code="ok" if answer.allowed else "over_limit").inc()
        if answer.allowed:
            st.checked = answer.headers
            return None
        st.phase = Phase.CLOSED  # the proxy answers and ends the stream; nothing was picked
        return _rate_limited(answer.headers)

    # -- the stream ---------------------------------------------------------------------

    def _lateness_of(self, peer: str) -> Lateness:
        """The ages of the requests on one gRPC connection (one proxy's clock). Past MAX_PEERS connections
        seen, every floor starts over (each learns again from its next request)."""
        found = self.lateness.get(peer)
        if found is None:
            if len(self.lateness) >= MAX_PEERS:
                self.lateness.clear()
            found = self.lateness[peer] = Lateness()
        return found

    def open(self, pool: str | None) -> _Stream:
        """A new stream, tracked unless `max_open_streams` are already (then it is answered
        without a pick and holds nothing)."""
        st = _Stream(pool)
        self.metrics.streams.inc()
        self.seen += 1
        if len(self._open) >= self.limits.max_open_streams:
            st.skip = "busy"
        else:
            self._open.add(st)
            self.metrics.open_streams.set(len(self._open))
        return st

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.ProcessingResponse]:
        metadata = context.invocation_metadata() or ()
        pool = next((v for k, v in metadata if k == POOL_METADATA), None)
        st = self.open(pool if isinstance(pool, str) else None)
        shed = next((v for k, v in metadata if k == SHED_STATUS_METADATA), None)
        if isinstance(shed, str) and shed in _SHED_STATUSES:
            st.shed_status = int(shed)
        st.peer = context.peer() or ""
        loop = asyncio.get_running_loop()
        st.task = asyncio.current_task()
        # One timer per stream, not one per message: the body's bound, then the generation's.
        timer = loop.call_at(loop.time() + self.limits.body_timeout_s, self._expire, st)
        error: ProtocolError | None = None
        try:
            async for msg in request_iterator:
                was_decided = st.decided
                if self._check_due(st, msg):
                    refused = await self._check_budgets(st, msg)
                    if refused is not None:
                        yield refused
                        break
                try:
                    answers = self._step(st, msg)
                except ProtocolError as exc:
                    error = exc
                    break
                for out in answers:
                    if isinstance(out, _Hold):
                        async for held in self._hold(st):
                            yield held
                    else:
                        yield out
                if st.phase is Phase.CLOSED:
                    break
                if st.decided and not was_decided:
                    timer.cancel()
                    timer = loop.call_at(loop.time() + self.limits.max_stream_s, self._expire, st)
            else:
                if error is None and st.decided:  # the proxy closed the stream: the response has ended
                    self.release(st, finished=True)
        except asyncio.CancelledError:
            if not st.expired:
                raise
        finally:  # ended, reset by the proxy (cancelled), timed out or broke the protocol
            timer.cancel()
            self.finish(st)
        if error is not None:
            self.metrics.stream_errors.labels(reason=error.kind).inc()
            _log.debug("ext_proc protocol error: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"confgen picker: {error}")

    def _expire(self, st: _Stream) -> None:
        """A stream past its bound: count it, release its request and end the RPC."""
        st.expired = True
        self.metrics.unpicked.labels(reason="timeout" if not st.decided else "stream_timeout").inc()
        self.finish(st)
        task = st.task
        if task is not None:
            task.cancel()

    def _step(self, st: _Stream, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse | _Hold]:
        """The answers to one message; ProtocolError when it is out of order."""
        if st.phase is Phase.CLOSED:
            raise ProtocolError("after_close", "a message after the stream was done")
        if msg.HasField("protocol_config"):
            if not st.first:
                raise ProtocolError("late_config", "protocol_config after the first message")
            st.mode = _MODES.get(msg.protocol_config.request_body_mode, BodyMode.NONE)
            st.streamed_response = msg.protocol_config.response_body_mode == _MODE.FULL_DUPLEX_STREAMED
        st.first = False
        if self.honour_subset_hint and not st.decided and msg.metadata_context.filter_metadata:
            subset = _subset(msg)
            if subset is not None:
                st.subset = subset
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            st.route = _route_name(msg)
            st.sent_at = _request_time(msg)
            return self._headers(st, msg.request_headers)
        if kind == "request_body":
            return self._body(st, msg.request_body)
        if kind == "request_trailers":
            if st.phase is Phase.HEADERS or st.trailers:
                raise ProtocolError("order", "request trailers before the headers or twice")
            st.trailers = True
            st.body_ended = True
            out = self._flush(st, end_of_stream=False) if st.phase is Phase.BODY else []
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind in ("response_headers", "response_body", "response_trailers"):
            return self._response(st, msg, kind)
        raise ProtocolError("unknown", f"unexpected message {kind!r}")

    def _headers(self, st: _Stream, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse | _Hold]:
        if st.phase is not Phase.HEADERS:
            raise ProtocolError("order", "request_headers twice")
        client_header = self.store.classes.client_header
        if client_header is not None:  # set by the proxy's api_key_auth, a client's own copy removed first
            st.client = next((h.raw_value.decode("utf-8", "replace") or h.value
                              for h in headers.headers.headers if h.key == client_header), None)
        checks = self.checks
        if checks is not None and st.route is not None and st.route in checks:
            st.headers = {}
            for h in headers.headers.headers:
                if h.key in checks.headers:
                    st.headers.setdefault(h.key, h.raw_value.decode("utf-8", "replace") or h.value)
        if headers.end_of_stream:
            st.body_ended = True
            # No body: not an inference request (GET /v1/models, /health). Leave it to the proxy,
            # unless it came with a (honoured) subset hint, which the protocol says must be honoured.
            if st.subset is None and st.skip is None:
                st.skip = "no_body"
            return [self._picked(st, "headers")]
        if st.skip is not None and st.mode is not BodyMode.BUFFERED:
            return [self._picked(st, "headers")]  # decided at once; the body passes unread
        if st.mode is BodyMode.NONE:
            return [self._picked(st, "headers")]  # the router reads these headers next: load alone
        if st.sent_at is not None:
            st.lateness = lateness = self._lateness_of(st.peer)
            late = lateness.observe(st.sent_at, self._wall())
            self.metrics.queued.observe(late)
            self.waited += late > self.limits.wait_s
            if late > self.limits.late_s and st.skip is None and st.mode is BodyMode.BUFFERED:
                return self._late_headers(st)
        st.phase = Phase.BODY
        if st.mode is BodyMode.DUPLEX:
            return []  # held until the pick
        # BUFFERED: answer now (drop any client copy of the header); the pick rides on the body.
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=_remove_destination()))]

    def _body(self, st: _Stream, body: pb.HttpBody) -> list[pb.ProcessingResponse | _Hold]:
        if st.body_ended:
            raise ProtocolError("order", "a body message after the body's end")
        st.body_ended = body.end_of_stream
        if st.phase is Phase.HEADERS and st.mode is BodyMode.BUFFERED:
            st.phase = Phase.BODY  # request headers skipped by the processing mode
        if st.phase is Phase.BODY:
            if st.mode is BodyMode.BUFFERED:
                st.body_ended = True  # BUFFERED sends the body in one message
                if len(body.body) > self.limits.body_cap:
                    st.skip = st.skip or "body_too_large"
                elif st.skip is None:
                    st.body += body.body
                return [self._picked_or_held(st)]
            # full duplex: hold up to the cap
            if len(st.body) + len(body.body) > self.limits.body_cap:
                st.skip = st.skip or "body_too_large"
                return [*self._flush(st, end_of_stream=False), _chunk(body.body, body.end_of_stream)]
            st.body += body.body
            return self._flush(st, end_of_stream=True) if body.end_of_stream else []
        if st.phase is Phase.HEADERS:
            raise ProtocolError("order", "a body before the headers")
        if st.mode is BodyMode.BUFFERED:
            raise ProtocolError("order", "a second body message in BUFFERED mode")
        if st.mode is BodyMode.DUPLEX:  # decided already (cap passed, or a busy stream): pass it through
            return [_chunk(body.body, body.end_of_stream)]
        return [pb.ProcessingResponse(request_body=pb.BodyResponse())]

    def _flush(self, st: _Stream, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        """Decide on the body read so far. Full duplex: answer the held headers, then send
        that body back; BUFFERED (trailers without a body): no pick, the headers are gone."""
        if st.mode is not BodyMode.DUPLEX:
            st.skip = st.skip or "no_body"
            self.choose(st)
            return []
        held = bytes(st.body)
        answer = self._picked(st, "headers")
        if answer.HasField("immediate_response"):
            return [answer]
        return [answer, _chunk(held, end_of_stream)]

    def _response(self, st: _Stream, msg: pb.ProcessingRequest, kind: str) -> list[pb.ProcessingResponse]:
        if not st.decided:
            raise ProtocolError("order", "a response before the request was decided")
        if st.response_ended or (kind == "response_headers" and st.phase is Phase.RESPONSE):
            raise ProtocolError("order", f"{kind} after the response's end or headers twice")
        st.phase = Phase.RESPONSE
        if kind == "response_headers":
            if msg.response_headers.end_of_stream:
                self._response_end(st)
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if kind == "response_body":
            body = msg.response_body
            if body.end_of_stream:
                self._response_end(st)
            if st.streamed_response:
                return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=body.body, end_of_stream=body.end_of_stream)))))]
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        self._response_end(st)
        return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]

    def _response_end(self, st: _Stream) -> None:
        st.response_ended = True
        self.release(st, finished=True)
