"""A request that reaches the picker late is answered at once without a pick (lateness.py): its
age from the proxy's `request.time` past the floor of recent ages, so the clocks' offset does not
count. On its headers the answer also ends the stream (the one mode override the render allows).
With a real Envoy (the override honoured, every request served): tests/sidecar_live/test_picker_live.py."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format, struct_pb2

from confgen.envoy import PICKER_LATE_MODE, REQUEST_TIME_ATTRIBUTE, ROUTE_NAME_ATTRIBUTE
from sidecar.outputs.picker.datastore import Classes, Datastore, EndpointFacts, PoolFacts
from sidecar.outputs.picker.extproc import DESTINATION, PICKER_FILTER_NAME, ExtProcLimits, PickerServicer
from sidecar.outputs.picker.lateness import SANE_S, Lateness, parse_request_time
from sidecar.outputs.picker.metrics import PickerMetrics
from sidecar.outputs.picker.scheduling import Picker, PickerPolicy

T0 = 1_796_474_520.0  # 2026-12-05 12:42:00 UTC


def _stamp(t: float) -> str:
    """`t` as Envoy writes request.time."""
    return datetime.fromtimestamp(t, UTC).isoformat()


def test_request_time_is_read_as_envoy_writes_it() -> None:
    assert parse_request_time("2026-12-05T12:42:00.471307+00:00") == pytest.approx(T0 + 0.471307)
    assert parse_request_time(_stamp(T0 + 1.5)) == pytest.approx(T0 + 1.5)
    for bad in ("", "yesterday", "2026-12-05T12:42:00", "2026-12-05T12:42:00+00:00" + " " * 64):
        assert parse_request_time(bad) is None, bad  # no zone: whose clock?


@pytest.mark.parametrize("offset", [0.0, 3.0, -3.0])
def test_lateness_is_the_age_past_the_floor_whatever_the_clocks_offset(offset: float) -> None:
    """`offset`: how far the picker's clock is ahead of the proxy's (the age read includes it)."""
    late = Lateness(window_s=30.0)
    transport = 0.001
    assert late.observe(T0, T0 + offset + transport) == 0.0  # the first sets the floor
    assert late.observe(T0 + 1, T0 + 1 + offset + transport + 0.004) == pytest.approx(0.004, abs=1e-6)
    assert late.observe(T0 + 2, T0 + 2 + offset + transport + 0.050) == pytest.approx(0.050, abs=1e-6)
    assert late.observe(T0 + 3, T0 + 3 + offset + transport / 2) == 0.0  # a new floor
    assert late.since(T0 + 4, T0 + 4 + offset + transport / 2 + 0.030) == pytest.approx(0.030, abs=1e-6)


def test_the_floor_forgets_after_two_windows_and_a_clock_step_is_not_a_queue() -> None:
    late = Lateness(window_s=10.0)
    late.observe(T0, T0 + 0.001)
    # the proxy's clock stepped back 2 s: every age reads 2 s longer; within SANE_S that could be a
    # backlog, so it counts until the floor has moved (after one to two windows)
    assert late.observe(T0 + 5, T0 + 7.001) == pytest.approx(2.0, abs=1e-6)
    late.observe(T0 + 12, T0 + 14.001)  # a new window: the previous one still holds the old floor
    assert late.observe(T0 + 13, T0 + 15.001) == pytest.approx(2.0, abs=1e-6)
    late.observe(T0 + 22, T0 + 24.001)  # another: the old floor is gone
    assert late.observe(T0 + 23, T0 + 25.001) == 0.0
    # a step past SANE_S is a clock, not a queue (Envoy gives up on a message after 0.2 s)
    assert late.observe(T0 + 24, T0 + 26.001 + SANE_S + 1) == 0.0
    assert late.since(T0 + 25, T0 + 27.001 + SANE_S + 1) == 0.0
    assert Lateness().since(T0, T0 + 5) == 0.0  # nothing observed yet: no floor, never late


ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000")


class _Wall:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _servicer(wall: _Wall) -> PickerServicer:
    store = Datastore()
    store.update([PoolFacts("chat", ("m",), tuple(EndpointFacts(a, serving=True, capacity=4) for a in ADDRESSES))])
    return PickerServicer(store, Picker(), PickerMetrics(None), limits=ExtProcLimits(late_s=0.02), wall=wall)


def _headers(sent_at: float | None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=DESTINATION, raw_value=b"6.6.6.6:1")])))
    attrs = struct_pb2.Struct()
    attrs.update({ROUTE_NAME_ATTRIBUTE: "chat-route"})
    if sent_at is not None:
        attrs.update({REQUEST_TIME_ATTRIBUTE: _stamp(sent_at)})
    msg.attributes[PICKER_FILTER_NAME].CopyFrom(attrs)
    return msg


_BODY = pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model": "m", "prompt": "hello"}', end_of_stream=True))


async def _stream(svc: PickerServicer, wall: _Wall, steps: list[tuple[float, pb.ProcessingRequest]],
                  peer: str = "ipv4:127.0.0.1:40000") -> list[pb.ProcessingResponse]:
    """Each message sent at its wall time (the answers are read in between, as Envoy would), by the
    proxy at `peer`."""
    async def requests() -> Any:
        for at, msg in steps:
            wall.now = at
            yield msg

    class _Context:
        def invocation_metadata(self) -> tuple[()]:
            return ()

        def peer(self) -> str:
            return peer

    return [out async for out in svc.Process(requests(), _Context())]  # type: ignore[arg-type]


def _picked(answer: pb.ProcessingResponse) -> str | None:
    common = answer.request_body.response if answer.HasField("request_body") else answer.request_headers.response
    values = [h.header.raw_value.decode() for h in common.header_mutation.set_headers if h.header.key == DESTINATION]
    return values[0] if values else None


def test_late_headers_end_the_stream_without_a_pick_and_late_bodies_get_none() -> None:
    wall = _Wall()
    svc = _servicer(wall)
    behind = svc.metrics.unpicked.labels(reason="behind")
    # on time (the floor: 1 ms of transport): picked on its body
    answers = asyncio.run(_stream(svc, wall, [(T0 + 0.001, _headers(T0)), (T0 + 0.002, _BODY)]))
    assert not answers[0].HasField("mode_override") and _picked(answers[-1]) in ADDRESSES
    # 4 ms late: still picked (and not counted as queued for the bypass share: under 5 ms)
    answers = asyncio.run(_stream(svc, wall, [(T0 + 1.005, _headers(T0 + 1)), (T0 + 1.006, _BODY)]))
    assert _picked(answers[-1]) in ADDRESSES and behind._value.get() == 0
    # headers 50 ms late: one answer, no pick (the client's header removed), and the override that ends the stream
    answers = asyncio.run(_stream(svc, wall, [(T0 + 2.051, _headers(T0 + 2))]))
    assert len(answers) == 1 and _picked(answers[0]) is None
    assert DESTINATION in answers[0].request_headers.response.header_mutation.remove_headers
    assert answers[0].mode_override == json_format.ParseDict(PICKER_LATE_MODE, processing_mode_pb2.ProcessingMode())
    assert answers[0].mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.NONE
    assert behind._value.get() == 1
    # what the bypass share is computed from (bypass.py): every stream, those read over 5 ms late, and
    # those answered late; and the picker's queue as an operator sees it (confgen_picker_queue_seconds)
    assert (svc.seen, svc.waited, svc.late) == (3, 1, 1), (svc.seen, svc.waited, svc.late)
    samples = {(s.name, s.labels.get("le")): s.value for family in svc.metrics.queued.collect()
               for s in family.samples}
    assert samples[("confgen_picker_queue_seconds_count", None)] == 3
    assert samples[("confgen_picker_queue_seconds_bucket", "0.005")] == 2  # 0 and 4 ms
    assert samples[("confgen_picker_queue_seconds_bucket", "0.02")] == 2  # the third: 50 ms
    assert samples[("confgen_picker_queue_seconds_bucket", "0.1")] == 3
    # headers on time, the body 40 ms late: no pick on the body
    answers = asyncio.run(_stream(svc, wall, [(T0 + 3.002, _headers(T0 + 3)), (T0 + 3.041, _BODY)]))
    assert not answers[0].HasField("mode_override") and _picked(answers[-1]) is None
    assert behind._value.get() == 2
    # nothing held in flight by any of them but the two picked streams, which ended
    assert sum(e.in_flight for e in svc.store.endpoints("chat")) == 0 and svc.open_streams() == 0


def test_without_request_time_nothing_is_late() -> None:
    """A proxy that does not send request.time (an Envoy configured as the extension documents): only the
    loop's own lateness counts."""
    wall = _Wall()
    svc = _servicer(wall)
    answers = asyncio.run(_stream(svc, wall, [(T0 + 5.0, _headers(None)), (T0 + 9.0, _BODY)]))
    assert not answers[0].HasField("mode_override") and _picked(answers[-1]) in ADDRESSES


def test_each_connection_is_timed_on_its_own_clock_and_cannot_move_another() -> None:
    """Two Envoys on one picker (ADS), one clock 50 ms behind the other: its requests read 50 ms older.
    Each connection has its own floor, so neither is late for its clock (a late one of either still
    is), and a connection sending a request.time in the future moves no other connection's floor."""
    wall = _Wall()
    svc = _servicer(wall)
    fast, slow, forger = "ipv4:10.0.0.7:41234", "ipv4:10.0.0.8:50000", "ipv4:10.0.0.7:41999"
    for i in range(3):
        t = T0 + i
        for peer, behind_s in ((fast, 0.0), (slow, 0.05)):
            answers = asyncio.run(_stream(svc, wall, [(t + 0.001, _headers(t - behind_s)), (t + 0.002, _BODY)], peer))
            assert _picked(answers[-1]) in ADDRESSES, (peer, i)
    asyncio.run(_stream(svc, wall, [(T0 + 5, _headers(T0 + 5 + 9.0))], forger))  # 9 s ahead: a floor of -9 s
    answers = asyncio.run(_stream(svc, wall, [(T0 + 6.001, _headers(T0 + 6)), (T0 + 6.002, _BODY)], fast))
    assert not answers[0].HasField("mode_override") and _picked(answers[-1]) in ADDRESSES
    answers = asyncio.run(_stream(svc, wall, [(T0 + 9.031, _headers(T0 + 9 - 0.05))], slow))
    assert answers[0].HasField("mode_override")  # 30 ms late on its own clock
    assert set(svc.lateness) == {fast, slow, forger}


def test_past_max_peers_connections_every_floor_starts_over(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.outputs.picker import extproc

    monkeypatch.setattr(extproc, "MAX_PEERS", 3)
    wall = _Wall()
    svc = _servicer(wall)
    for n in range(4):
        asyncio.run(_stream(svc, wall, [(T0 + n + 0.001, _headers(T0 + n)), (T0 + n + 0.002, _BODY)],
                            f"ipv4:10.0.0.9:{4000 + n}"))
    assert set(svc.lateness) == {"ipv4:10.0.0.9:4003"}


def test_requests_answered_late_still_count_toward_a_spike() -> None:
    """A rush makes the picker late, and a request answered late gets no pick; it still arrived, so it
    counts in its pool's spike window: the next request on time finds the rush seen and admission open
    (refused, its queue past the budget) where, without those late ones, it is placed."""
    facts = tuple(EndpointFacts(a, serving=True, capacity=2, running=2.0, waiting=6.0, token_latency_s=0.02)
                  for a in ADDRESSES)
    policy = PickerPolicy(spike_ratio=2.0, spike_s=0.5, spike_min=4, pressure_s=0.0, hold=0)
    for late_ones, refused in ((0, False), (3, True)):
        wall = _Wall()
        store = Datastore()
        # the route Envoy matched names the pool (as every rendered route does): a late request's body is unread
        store.update([PoolFacts("chat", ("m",), facts)], classes=Classes(named={"chat-route": ("standard", "chat")}))
        svc = PickerServicer(store, Picker(policy, clock=lambda: 0.0), PickerMetrics(None),
                             limits=ExtProcLimits(late_s=0.02), wall=wall)
        # the floor of ages first (on time, picked), then the late ones: one answer each, no pick
        asyncio.run(_stream(svc, wall, [(T0 + 0.001, _headers(T0)), (T0 + 0.002, _BODY)]))
        for i in range(late_ones):
            answers = asyncio.run(_stream(svc, wall, [(T0 + 1.051 + i, _headers(T0 + 1 + i))]))
            assert len(answers) == 1 and _picked(answers[0]) is None
        answers = asyncio.run(_stream(svc, wall, [(T0 + 9.001, _headers(T0 + 9)), (T0 + 9.002, _BODY)]))
        got = answers[-1]
        assert (got.WhichOneof("response") == "immediate_response" and got.immediate_response.status.code == 429) \
            is refused, (late_ones, got)


def _headers_on(route: str, sent_at: float) -> pb.ProcessingRequest:
    """Headers of a request Envoy matched to `route`, sent at `sent_at`."""
    msg = _headers(sent_at)
    msg.attributes[PICKER_FILTER_NAME].update({ROUTE_NAME_ATTRIBUTE: route})
    return msg


def _refused(answer: pb.ProcessingResponse) -> bool:
    return answer.WhichOneof("response") == "immediate_response" and answer.immediate_response.status.code == 429


def test_a_late_request_is_refused_while_admission_refuses_its_pool() -> None:
    """While admission is on and refuses, a request that reaches the picker late (answered without a
    pick, its body unread) is not let through to the proxy's fallback unadmitted: it shares the fate the
    pool's last prediction gives its class. Critical traffic still passes; so does a request whose model
    could make it critical (its body unread), and any once the predicted queue has drained."""
    facts = tuple(EndpointFacts(a, serving=True, capacity=2, running=2.0, waiting=6.0, token_latency_s=0.02)
                  for a in ADDRESSES)
    now = [0.0]
    wall = _Wall()
    store = Datastore()
    named = {"chat-route": ("standard", "chat"), "vip-route": ("critical", "chat")}
    store.update([PoolFacts("chat", ("m",), facts)], classes=Classes(named=named))
    svc = PickerServicer(store, Picker(PickerPolicy(admission_gate=0, hold=0), clock=lambda: now[0]),
                         PickerMetrics(None), limits=ExtProcLimits(late_s=0.02), wall=wall)
    # on time (the floor of ages): its predicted start is past the budget, refused
    answers = asyncio.run(_stream(svc, wall, [(T0 + 0.001, _headers_on("chat-route", T0)), (T0 + 0.002, _BODY)]))
    assert _refused(answers[-1])
    # headers 50 ms late: refused on them, one answer, nothing more sent here
    answers = asyncio.run(_stream(svc, wall, [(T0 + 1.051, _headers_on("chat-route", T0 + 1))]))
    assert len(answers) == 1 and _refused(answers[0]) and not answers[0].HasField("mode_override")
    # headers on time, the body 40 ms late: refused on the body
    answers = asyncio.run(_stream(svc, wall, [(T0 + 2.002, _headers_on("chat-route", T0 + 2)),
                                              (T0 + 2.041, _BODY)]))
    assert _refused(answers[-1])
    # a critical route's late request is never refused: no pick, the proxy places it
    answers = asyncio.run(_stream(svc, wall, [(T0 + 3.051, _headers_on("vip-route", T0 + 3))]))
    assert len(answers) == 1 and not _refused(answers[0]) and answers[0].HasField("mode_override")
    refused = svc.metrics.refusals()
    assert refused == {("chat", "standard"): 3}, refused
    # the queue predicted at the last look has drained by now (nothing predicted since): placed by the proxy
    now[0] = 100.0
    answers = asyncio.run(_stream(svc, wall, [(T0 + 4.051, _headers_on("chat-route", T0 + 4))]))
    assert not _refused(answers[0]) and _picked(answers[0]) is None
    # a route the picker does not know (a proxy not configured by the render), so the pool is the default
    # one and the class the model's (the body unread): refused as the most lenient class a model would
    # give it (standard, not sheddable) ...
    now[0] = 0.0
    store.update([PoolFacts("chat", ("m",), facts)], routes={None: "chat", "m": "chat", "other": "chat"},
                 classes=Classes(routes={"m": "standard", "other": "sheddable"}))
    asyncio.run(_stream(svc, wall, [(T0 + 5.001, _headers_on("chat-route", T0 + 5)), (T0 + 5.002, _BODY)]))
    answers = asyncio.run(_stream(svc, wall, [(T0 + 6.051, _headers_on("chat-route", T0 + 6))]))
    assert len(answers) == 1 and _refused(answers[0])
    assert svc.metrics.refusals()[("chat", "standard")] == 5, svc.metrics.refusals()
    # ... and placed by the proxy where a model would make it critical
    store.update([PoolFacts("chat", ("m",), facts)], routes={None: "chat", "m": "chat", "urgent": "chat"},
                 classes=Classes(routes={"m": "standard", "urgent": "critical"}))
    asyncio.run(_stream(svc, wall, [(T0 + 7.001, _headers_on("chat-route", T0 + 7)), (T0 + 7.002, _BODY)]))
    answers = asyncio.run(_stream(svc, wall, [(T0 + 8.051, _headers_on("chat-route", T0 + 8))]))
    assert not _refused(answers[0]) and _picked(answers[0]) is None
    assert svc.late == 6 and sum(e.in_flight for e in store.endpoints("chat")) == 0 and svc.open_streams() == 0


def test_a_stream_over_the_cap_is_refused_like_a_late_one_while_admission_refuses() -> None:
    """A stream past `max_open_streams` is answered without a pick (it is not tracked); while admission
    refuses in its pool it is refused instead of passed to the proxy unadmitted (a surge on a large fleet
    can hold that many streams open), critical traffic still passing."""
    facts = tuple(EndpointFacts(a, serving=True, capacity=2, running=2.0, waiting=6.0, token_latency_s=0.02)
                  for a in ADDRESSES)
    store = Datastore()
    named = {"chat-route": ("standard", "chat"), "vip-route": ("critical", "chat")}
    store.update([PoolFacts("chat", ("m",), facts)], classes=Classes(named=named))
    svc = PickerServicer(store, Picker(PickerPolicy(admission_gate=0, hold=0), clock=lambda: 0.0),
                         PickerMetrics(None), limits=ExtProcLimits(max_open_streams=1))

    class _Context:
        def invocation_metadata(self) -> tuple[()]:
            return ()

        def peer(self) -> str:
            return "ipv4:127.0.0.1:40000"

    async def run() -> tuple[list[pb.ProcessingResponse], list[pb.ProcessingResponse], list[pb.ProcessingResponse]]:
        answered, release = asyncio.Event(), asyncio.Event()
        first: list[pb.ProcessingResponse] = []

        async def held_open() -> Any:  # critical: placed despite the queue, its stream open until released
            yield _headers_on("vip-route", T0)
            yield _BODY
            await release.wait()

        async def consume() -> None:
            async for out in svc.Process(held_open(), _Context()):  # type: ignore[arg-type]
                first.append(out)
                if len(first) == 2:
                    answered.set()

        task = asyncio.create_task(consume())
        await answered.wait()

        async def over_cap(route: str) -> list[pb.ProcessingResponse]:
            async def msgs() -> Any:
                yield _headers_on(route, T0)
                yield _BODY
            return [out async for out in svc.Process(msgs(), _Context())]  # type: ignore[arg-type]

        standard, critical = await over_cap("chat-route"), await over_cap("vip-route")
        release.set()
        await task
        return first, standard, critical

    first, standard, critical = asyncio.run(run())
    assert _picked(first[-1]) in ADDRESSES  # the critical one, tracked and placed
    assert _refused(standard[-1])  # over the cap, standard, its pool refusing: 429
    assert not _refused(critical[-1]) and _picked(critical[-1]) is None  # over the cap, critical: the proxy's
    assert svc.metrics.unpicked.labels(reason="busy")._value.get() == 2 and svc.late == 0
    assert svc.open_streams() == 0
