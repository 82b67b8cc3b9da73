"""The picker's ext_proc stream as a state machine, attacked: random message sequences
(fuzzed, fake loop clock for the timeouts), the 2,000-body stream (issue 26, attack 1),
1.9 MiB body messages (attack 2), 100,000 `messages` entries (attack 7) and held-open
streams (attack 8)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from sidecar.outputs.picker.datastore import Datastore, EndpointFacts, PoolFacts
from sidecar.outputs.picker.extproc import DESTINATION, ExtProcLimits, PickerServicer
from sidecar.outputs.picker.metrics import PickerMetrics
from sidecar.outputs.picker.prompt import parse_body
from sidecar.outputs.picker.scheduling import Picker

ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
LIMITS = ExtProcLimits(body_cap=4096, body_timeout_s=30.0, max_stream_s=1800.0)


def _store() -> Datastore:
    store = Datastore()
    store.update([PoolFacts("chat", ("m",), tuple(EndpointFacts(a, serving=True, capacity=4) for a in ADDRESSES))])
    return store


def _in_flight(store: Datastore) -> int:
    counts = [e.in_flight for e in store.endpoints("chat")]
    assert min(counts) >= 0, counts
    return sum(counts)


def _chat(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


_MODES = {"buffered": processing_mode_pb2.ProcessingMode.BUFFERED,
          "duplex": processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
          "streamed": processing_mode_pb2.ProcessingMode.STREAMED}


def _message(kind: str, eos: bool, arg: str) -> pb.ProcessingRequest:
    if kind == "headers":
        msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=DESTINATION, raw_value=b"6.6.6.6:1")]),
            end_of_stream=eos))
        if arg in _MODES:
            msg.protocol_config.request_body_mode = _MODES[arg]
            msg.protocol_config.response_body_mode = _MODES[arg]
        if arg in ("hint", "bad_hint"):  # one endpoint of the pool, or none (a 503)
            hint = struct_pb2.Struct()
            hint.update({"x-gateway-destination-endpoint-subset": [ADDRESSES[1] if arg == "hint" else "10.9.9.9:1"]})
            msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        return msg
    if kind == "body":
        data = b"x" * 5000 if arg == "big" else _chat(f"hello {arg}")
        return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))
    if kind == "request_trailers":
        return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    if kind == "response_headers":
        return pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=eos))
    if kind == "response_body":
        return pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x", end_of_stream=eos))
    return pb.ProcessingRequest(response_trailers=pb.HttpTrailers())


_RESPONSE_ENDS = {("response_headers", True), ("response_body", True), ("response_trailers", True),
                  ("response_trailers", False)}


class _FakeTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test says (the streams' timers use it)."""

    now = 1000.0

    def time(self) -> float:
        return self.now


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self, pool: str | None = None) -> None:
        self.code: grpc.StatusCode | None = None
        self.pool = pool

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-confgen-pool", self.pool),) if self.pool else ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)


@dataclass
class _Client:
    """One ext_proc stream as Envoy would drive it, message by message."""

    svc: PickerServicer
    queue: asyncio.Queue[pb.ProcessingRequest | None] = field(default_factory=asyncio.Queue)
    answers: list[pb.ProcessingResponse] = field(default_factory=list)
    context: _Context = field(default_factory=_Context)
    response_end_sent: bool = False
    task: asyncio.Task[None] | None = None

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def _run(self) -> None:
        try:
            async for out in self.svc.Process(self._requests(), self.context):
                self.answers.append(out)
        except _Aborted:
            pass

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    def picks(self) -> int:
        n = 0
        for out in self.answers:
            kind = out.WhichOneof("response")
            if kind in ("request_headers", "request_body"):
                common = getattr(out, kind).response
                n += any(h.header.key == DESTINATION for h in common.header_mutation.set_headers)
        return n


async def _settle(clients: list[_Client]) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
        if all(not c.alive or c.queue.empty() for c in clients):
            for _ in range(3):
                await asyncio.sleep(0)
            return
    raise AssertionError("streams did not settle")


def _check(store: Datastore, clients: list[_Client]) -> None:
    for c in clients:
        assert c.picks() <= 1, "more than one pick on one stream"
    holding = sum(1 for c in clients if c.alive and c.picks() == 1 and not c.response_end_sent)
    assert _in_flight(store) == holding


_MESSAGE = hs.tuples(
    hs.sampled_from(["headers", "headers", "body", "body", "body", "request_trailers",
                     "response_headers", "response_body", "response_trailers"]),
    hs.booleans(),
    hs.sampled_from(["", "buffered", "duplex", "streamed", "big", "a", "b", "hint", "bad_hint"]),
)
_ACTION = hs.one_of(
    hs.tuples(hs.just("msg"), hs.integers(0, 3), _MESSAGE),
    hs.tuples(hs.sampled_from(["close", "cancel"]), hs.integers(0, 3), hs.none()),
    hs.tuples(hs.just("advance"), hs.just(0), hs.sampled_from([1.0, 31.0, 1801.0])),
)


def _run_sequence(actions: list[tuple[str, int, Any]]) -> None:
    store = _store()
    svc = PickerServicer(store, Picker(rng=random.Random(0)), PickerMetrics(None, store.pools), limits=LIMITS,
                         honour_subset_hint=True)
    loop = _FakeTimeLoop()

    async def main() -> None:
        slots: dict[int, _Client] = {}
        every: list[_Client] = []

        def client(i: int) -> _Client:
            c = slots.get(i)
            if c is None or not c.alive:  # odd slots name their pool in the gRPC metadata
                c = slots[i] = _Client(svc, context=_Context("chat" if i % 2 else None))
                c.start()
                every.append(c)
            return c

        for what, i, arg in actions:
            if what == "msg":
                kind, eos, extra = arg
                c = client(i)
                c.queue.put_nowait(_message(kind, eos, extra))
                if (kind, eos) in _RESPONSE_ENDS:
                    c.response_end_sent = True
            elif what == "close" and i in slots:
                slots[i].queue.put_nowait(None)
            elif what == "cancel" and i in slots and slots[i].task is not None:
                slots[i].task.cancel()  # Envoy resets the stream
            elif what == "advance":
                loop.now += arg
            await _settle(every)
            _check(store, every)
            for c in every:
                if c.context.code is not None:
                    assert c.context.code == grpc.StatusCode.INVALID_ARGUMENT
        for c in slots.values():
            c.queue.put_nowait(None)
        await _settle(every)
        assert _in_flight(store) == 0
        assert all(not c.alive for c in every)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert svc.open_streams() == 0


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(hs.lists(_ACTION, max_size=30))
def test_in_flight_equals_the_open_picks_for_any_stream_sequence(actions: list[tuple[str, int, Any]]) -> None:
    _run_sequence(actions)


def test_the_known_sequences() -> None:
    """The sequences a real Envoy sends, and the ones the fuzzing found worth keeping."""
    h, b = ("headers", False, ""), ("body", True, "a")
    _run_sequence([("msg", 0, h), ("msg", 0, b), ("msg", 0, ("response_trailers", False, ""))])
    _run_sequence([("msg", 1, h), ("msg", 1, b), ("msg", 1, b), ("msg", 1, b)])  # attack 1, in short
    _run_sequence([("msg", 0, h), ("msg", 0, b), ("advance", 0, 1801.0)])  # past max_stream_s
    _run_sequence([("msg", 0, h), ("advance", 0, 31.0), ("msg", 0, b)])  # no body in time
    _run_sequence([("msg", 0, h), ("msg", 0, b), ("cancel", 0, None)])
    _run_sequence([("msg", 0, ("headers", False, "duplex")), ("msg", 0, ("body", False, "big")),
                   ("msg", 0, ("body", False, "a")), ("msg", 0, ("body", True, "a")), ("close", 0, None)])
    _run_sequence([("msg", 0, ("headers", False, "bad_hint")), ("msg", 0, b), ("msg", 0, b)])  # 503, then closed
    _run_sequence([("msg", 0, ("headers", False, "hint")), ("msg", 0, b), ("advance", 0, 1.0)])


# -- attack 1 over real gRPC: headers, 2,000 body messages, close -------------------------------


def _grpc_servicer(limits: ExtProcLimits | None = None) -> tuple[Any, Datastore, PickerMetrics]:
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from sidecar.outputs.grpc import GrpcServer, GrpcSettings

    store = _store()
    metrics = PickerMetrics(None, store.pools)
    svc = PickerServicer(store, Picker(), metrics, limits=limits)
    server = GrpcServer(GrpcSettings("127.0.0.1", 0))
    server.add(lambda s: pb_grpc.add_ExternalProcessorServicer_to_server(svc, s), "picker")
    return server, store, metrics


def test_one_stream_with_two_thousand_bodies_ends_with_nothing_in_flight() -> None:
    """Attack 1: before, every body ran a pick (1,999 left in flight after the close)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    server, store, metrics = _grpc_servicer()
    body = _chat("the same prompt " * 20)

    async def main(bodies: int) -> tuple[grpc.StatusCode, int]:
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=30)

                async def read() -> grpc.StatusCode:  # Envoy reads the answers as they come
                    try:
                        async for _ in call:
                            pass
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                    return grpc.StatusCode.OK

                reader = asyncio.create_task(read())
                await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders()))
                written = 0
                for _ in range(bodies):
                    try:
                        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
                    except grpc.aio.AioRpcError:
                        break  # the picker ended the stream
                    written += 1
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call.done_writing()
                return await asyncio.wait_for(reader, 20), written
        finally:
            await server.stop(0)

    code, written = asyncio.run(main(2000))
    # The picker ends the stream at the second body. A client still writing when the status
    # arrives may see its own core's INTERNAL instead of the status (the writes race it).
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL) and written < 2000
    assert _in_flight(store) == 0
    assert sum(v.get() for v in (metrics.picks.labels(pool="chat", reason=r)._value
                                 for r in ("prefix", "spill", "load", "only"))) == 1
    assert metrics.stream_errors.labels(reason="order")._value.get() == 1
    server, store, metrics = _grpc_servicer()
    code, written = asyncio.run(main(2))  # a client that stops at the offending message sees the status
    assert (code, written) == (grpc.StatusCode.INVALID_ARGUMENT, 2) and _in_flight(store) == 0


# -- attack 2: 1.9 MiB body messages in one stream ------------------------------------------------


def test_body_messages_of_almost_two_mib_hold_at_most_the_cap() -> None:
    """Attack 2: before, the body grew without bound and was parsed again on every message
    (sidecar RSS 64 -> 1,484 MiB). Now the held body never passes the cap and a BUFFERED
    stream ends at its second body."""
    store = _store()
    svc = PickerServicer(store, Picker(rng=random.Random(0)), PickerMetrics(None, store.pools))
    chunk = b"{" + b" " * (19 * 1024 * 1024 // 10 - 1)  # 1.9 MiB, under the 2 MiB cap
    # full duplex: the body is held up to the cap, then passes through unread
    st = svc.open(None)
    duplex = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    duplex.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    svc._step(st, duplex)
    tracemalloc.start()
    try:
        for _ in range(40):  # 76 MiB through one stream
            answers = svc._step(st, pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk)))
            assert len(st.body) <= svc.limits.body_cap
            del answers
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * svc.limits.body_cap + 4 * len(chunk), peak  # what one message's answers hold at most
    svc.finish(st)
    # BUFFERED: one pick on the first body, the second one ends the stream
    from sidecar.outputs.picker.extproc import ProtocolError

    st = svc.open(None)
    svc._step(st, pb.ProcessingRequest(request_headers=pb.HttpHeaders()))
    svc._step(st, pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=False)))
    try:
        svc._step(st, pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk)))
    except ProtocolError:
        pass
    else:
        raise AssertionError("a second BUFFERED body was accepted")
    svc.finish(st)
    assert _in_flight(store) == 0


# -- attack 7: 100,000 `messages` entries ------------------------------------------------------------


def test_a_body_of_a_hundred_thousand_messages_is_read_only_as_far_as_the_hashes_reach() -> None:
    """Attack 7: before, every message was canonicalised (81 ms a pick on the probing loop)."""
    visited = 0

    class Counting(dict[str, Any]):
        def get(self, key: str, default: Any = None) -> Any:
            nonlocal visited
            visited += key == "role"
            return super().get(key, default)

    messages = [{"role": "user", "content": f"turn {i} " * 3} for i in range(100_000)]
    raw = json.dumps({"model": "m", "messages": messages}).encode()
    prompt = parse_body(raw)
    assert prompt is not None and len(prompt.text) == 64 * 256
    assert prompt.chars >= len(raw) and prompt.prompt_tokens > 100_000  # its size is still known
    # the same bound on items: tiny messages, far more of them than the text needs
    import sidecar.outputs.picker.prompt as prompt_module

    body = {"model": "m", "messages": [Counting(role="u") for _ in range(100_000)]}
    original = prompt_module.json.loads
    try:
        prompt_module.json.loads = lambda raw: body  # type: ignore[assignment]  # count the visits
        cut = parse_body(b"{}", max_items=1000)
    finally:
        prompt_module.json.loads = original  # type: ignore[assignment]
    assert cut is not None and visited == 1000 and cut.chars > 0
    ids = parse_body(json.dumps({"model": "m", "prompt": [list(range(900_000))]}).encode())
    assert ids is not None and len(ids.text) <= 64 * 256 and ids.prompt_tokens >= 900_000


# -- attack 8: streams held open -------------------------------------------------------------------------


def test_streams_over_the_open_cap_are_answered_without_a_pick_and_hold_nothing() -> None:
    store = _store()
    metrics = PickerMetrics(None, store.pools)
    svc = PickerServicer(store, Picker(rng=random.Random(0)), metrics, limits=ExtProcLimits(max_open_streams=50))
    held = []
    for i in range(60):
        st = svc.open(None)
        svc._step(st, pb.ProcessingRequest(request_headers=pb.HttpHeaders()))
        (out,) = svc._step(st, pb.ProcessingRequest(request_body=pb.HttpBody(body=_chat(f"q{i}"), end_of_stream=True)))
        picked = any(h.header.key == DESTINATION for h in out.request_body.response.header_mutation.set_headers)
        assert picked == (i < 50)
        held.append(st)
    assert _in_flight(store) == 50 and svc.open_streams() == 50
    assert metrics.unpicked.labels(reason="busy")._value.get() == 10
    for st in held:
        svc.finish(st)
    assert _in_flight(store) == 0 and svc.open_streams() == 0
