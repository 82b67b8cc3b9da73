"""The lobby (`--picker hold=1`): requests held in the picker while every slot of their pool is taken.

On the servicer with a fake loop clock (its timers: the lobby's deadline and tick): a request that
finds every slot taken waits (its answer is an extended message timeout, nothing picked), is placed
when a slot frees, first come first served, standard before sheddable; at `hold_max_s` it is placed
anyway; once admission opens (here the daemon's saturation verdict) every waiter is decided with its
wait counted: refused when that wait is past its budget. A stream reset while held leaves nothing
behind. A spike is not waited out. With `hold` 0 nothing waits."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from confgen.envoy import PICKER_MAX_HOLD_S
from sidecar.outputs.picker.datastore import Datastore, EndpointFacts, PoolFacts
from sidecar.outputs.picker.extproc import DESTINATION, HOLD_MARGIN_S, PickerServicer
from sidecar.outputs.picker.lobby import Lobby, Outcome
from sidecar.outputs.picker.metrics import PickerMetrics
from sidecar.outputs.picker.predict import CostPolicy
from sidecar.outputs.picker.prompt import parse_body
from sidecar.outputs.picker.scheduling import Picker, PickerPolicy, PickRequest

ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000")
SLOTS = 2  # per endpoint: 4 in the pool


class _Loop(asyncio.SelectorEventLoop):
    """Time moves only when the test says (the lobby's deadline and tick are loop timers)."""

    now = 1000.0

    def time(self) -> float:
        return self.now


def _facts(saturated: bool = False) -> list[PoolFacts]:
    endpoints = tuple(EndpointFacts(a, serving=True, capacity=SLOTS, token_latency_s=0.02) for a in ADDRESSES)
    return [PoolFacts("chat", ("m",), endpoints, saturated=saturated)]


class _Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(details)


@dataclass
class _Stream:
    """One request as Envoy drives a BUFFERED stream: headers, the body, later the response's end."""

    svc: PickerServicer
    name: str
    queue: asyncio.Queue[pb.ProcessingRequest | None] = field(default_factory=asyncio.Queue)
    answers: list[pb.ProcessingResponse] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def _run(self) -> None:
        async for out in self.svc.Process(self._requests(), _Context()):
            self.answers.append(out)

    def start(self) -> None:
        body = json.dumps({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": self.name}]})
        self.queue.put_nowait(pb.ProcessingRequest(request_headers=pb.HttpHeaders()))
        self.queue.put_nowait(pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)))
        self.task = asyncio.get_running_loop().create_task(self._run())

    def end_response(self) -> None:
        self.queue.put_nowait(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
        self.queue.put_nowait(None)

    @property
    def picked(self) -> bool:
        return any(h.header.key == DESTINATION for out in self.answers if out.WhichOneof("response") == "request_body"
                   for h in out.request_body.response.header_mutation.set_headers)

    @property
    def held(self) -> bool:
        return any(out.HasField("override_message_timeout") for out in self.answers)

    @property
    def refused(self) -> bool:
        return any(out.immediate_response.status.code == 429 for out in self.answers
                   if out.WhichOneof("response") == "immediate_response")


def _servicer(loop: _Loop, policy: PickerPolicy, saturated: bool = False) -> tuple[PickerServicer, Datastore]:
    store = Datastore()
    store.update(_facts(saturated))
    clock: Callable[[], float] = lambda: loop.now  # noqa: E731
    picker = Picker(policy, rng=random.Random(0), clock=clock)
    return PickerServicer(store, picker, PickerMetrics(None, store.pools), clock=clock), store


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def _run(loop: _Loop, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    try:
        loop.run_until_complete(main())
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()

        async def drain() -> None:
            await asyncio.gather(*pending, return_exceptions=True)
        loop.run_until_complete(drain())
        loop.close()


def _in_flight(store: Datastore) -> int:
    return sum(e.in_flight for e in store.endpoints("chat"))


HOLD = PickerPolicy(hold=1, hold_max_s=2.0, pressure_s=0.0, spike_ratio=0.0)  # the gate: the verdict alone


def test_the_lobby_is_on_by_default() -> None:
    assert PickerPolicy().hold == 1 and PickerPolicy().with_overrides(["hold=0"]).hold == 0


def test_a_request_that_finds_every_slot_taken_waits_and_is_placed_when_one_frees() -> None:
    loop = _Loop()
    svc, store = _servicer(loop, HOLD)

    async def main() -> None:
        streams = [_Stream(svc, f"r{i}") for i in range(6)]
        for s in streams[:4]:
            s.start()
        await _settle()
        assert all(s.picked and not s.held for s in streams[:4]) and _in_flight(store) == 4
        for s in streams[4:]:
            s.start()
            await _settle()
        # every slot taken: the two later ones wait, their message timeout extended past their hold
        assert [s.held for s in streams[4:]] == [True, True] and not any(s.picked for s in streams[4:])
        timeout = next(o.override_message_timeout for o in streams[4].answers if o.HasField("override_message_timeout"))
        assert timeout.ToTimedelta().total_seconds() == HOLD.hold_max_s + HOLD_MARGIN_S <= PICKER_MAX_HOLD_S
        assert svc.lobby.depth("chat") == 2 and _in_flight(store) == 4
        streams[0].end_response()  # a slot frees: the first waiter is placed, the second still waits
        await _settle()
        assert streams[4].picked and not streams[5].picked and _in_flight(store) == 4
        assert svc.lobby.depth("chat") == 1
        loop.now += HOLD.hold_max_s + 0.01  # the second's hold ends: placed anyway, into an engine's queue
        await _settle()
        assert streams[5].picked and _in_flight(store) == 5 and svc.lobby.depth("chat") == 0
        held = {s.labels["outcome"]: s.value for f in svc.metrics.held.collect() for s in f.samples
                if s.name.endswith("_total")}
        assert held == {"slot": 1.0, "deadline": 1.0}
        for s in streams[1:]:
            s.end_response()
        await _settle()
        assert _in_flight(store) == 0

    _run(loop, main)


def test_nothing_waits_with_hold_off() -> None:
    loop = _Loop()
    svc, store = _servicer(loop, PickerPolicy(hold=0, pressure_s=0.0, spike_ratio=0.0))

    async def main() -> None:
        streams = [_Stream(svc, f"r{i}") for i in range(7)]
        for s in streams:
            s.start()
        await _settle()
        assert all(s.picked and not s.held for s in streams) and _in_flight(store) == 7
        for s in streams:
            s.end_response()
        await _settle()

    _run(loop, main)


def test_when_admission_opens_the_waiters_are_decided_with_their_wait_counted() -> None:
    loop = _Loop()
    # a request holds a slot ~0.34 s (16 tokens at 20 ms): the standard budget is 2 x that, 0.68 s
    svc, store = _servicer(loop, replace(HOLD, budget_standard=2.0, cost=CostPolicy(default_output=16)))

    async def main() -> None:
        streams = [_Stream(svc, f"r{i}") for i in range(6)]
        for s in streams[:4]:
            s.start()
        await _settle()
        streams[4].start()
        await _settle()
        loop.now += 1.5  # it waited 1.5 s: past the budget; the next one will have waited 0.05 s
        streams[5].start()
        await _settle()
        assert streams[4].held and streams[5].held and svc.lobby.depth("chat") == 2
        store.update(_facts(saturated=True))  # the daemon's verdict: admission on
        loop.now += 0.05  # the lobby's next tick sees it
        await _settle()
        # the one that waited 1.5 s is refused (429); the one that just came is placed in an engine's queue
        assert streams[4].refused and not streams[4].picked
        assert streams[5].picked and not streams[5].refused
        assert svc.lobby.depth("chat") == 0 and _in_flight(store) == 5
        outcomes = {s.labels["outcome"] for f in svc.metrics.held.collect() for s in f.samples
                    if s.name.endswith("_total")}
        assert outcomes == {"open"}
        for s in streams[:4] + streams[5:]:
            s.end_response()
        await _settle()
        assert _in_flight(store) == 0

    _run(loop, main)


def test_a_stream_reset_while_it_waits_leaves_nothing_behind() -> None:
    loop = _Loop()
    svc, store = _servicer(loop, HOLD)

    async def main() -> None:
        streams = [_Stream(svc, f"r{i}") for i in range(5)]
        for s in streams:
            s.start()
            await _settle()
        assert streams[4].held and svc.lobby.depth("chat") == 1
        assert streams[4].task is not None
        streams[4].task.cancel()  # Envoy reset the stream (the client went away)
        await _settle()
        assert svc.lobby.depth("chat") == 0 and svc.open_streams() == 4 and svc.lobby.claimed("chat") == 0
        streams[0].end_response()
        await _settle()
        assert _in_flight(store) == 3
        for s in streams[1:4]:
            s.end_response()
        await _settle()
        assert _in_flight(store) == 0 and svc.open_streams() == 0

    _run(loop, main)


def test_critical_traffic_never_waits() -> None:
    loop = _Loop()
    svc, store = _servicer(loop, HOLD)
    for e in store.endpoints("chat"):
        e.in_flight = SLOTS  # every slot taken
    critical = PickRequest("chat", None, (), traffic_class="critical", saturated=False)
    standard = PickRequest("chat", None, (), traffic_class="standard", saturated=False)

    async def main() -> None:
        assert not svc._holds(critical, store.endpoints("chat"))
        assert svc._holds(standard, store.endpoints("chat"))

    _run(loop, main)


def test_the_lobby_wakes_standard_before_sheddable_first_come_first_served_one_per_free_slot() -> None:
    loop = _Loop()
    lobby = Lobby(lambda: loop.now)

    async def main() -> None:
        shed = lobby.join("p", "sheddable", 5.0)
        first = lobby.join("p", "standard", 5.0)
        second = lobby.join("p", "standard", 5.0)
        assert lobby.depth("p") == 3
        assert lobby.wake("p", 1) == 1 and first.future.result() is Outcome.SLOT and lobby.claimed("p") == 1
        assert lobby.wake("p", 1) == 0  # the one free slot is claimed by the woken waiter until it leaves
        lobby.leave(first)
        assert lobby.claimed("p") == 0
        assert lobby.wake("p", 5) == 2 and second.future.done() and shed.future.done()
        lobby.leave(second)
        loop.now += 3.0
        assert lobby.leave(shed) == 3.0 and lobby.depth("p") == 0 and lobby.claimed("p") == 0

    _run(loop, main)


def test_a_spike_is_not_waited_out() -> None:
    """Requests arriving at the spike rule's rate (here 4 within 0.5 s) are placed at once, as without
    the lobby; the same requests spread out wait for a slot."""
    loop = _Loop()
    # a standard budget the rush's short queue stays within (its requests are admitted, not refused)
    svc, store = _servicer(loop, replace(HOLD, spike_ratio=2.0, spike_s=0.5, spike_min=4, budget_standard=0.5))

    async def main() -> None:
        rush = [_Stream(svc, f"r{i}") for i in range(6)]
        for s in rush:  # at once: the 5th and 6th find every slot taken, but 5 and 6 arrived within 0.5 s
            s.start()
        await _settle()
        assert all(s.picked and not s.held for s in rush) and svc.lobby.depth("chat") == 0
        assert _in_flight(store) == 6
        for s in rush:
            s.end_response()
        await _settle()
        loop.now += 10.0
        spread = [_Stream(svc, f"s{i}") for i in range(5)]
        for s in spread:  # one a second: no spike, and the 5th finds every slot taken
            s.start()
            await _settle()
            loop.now += 1.0
        assert [s.picked for s in spread] == [True] * 4 + [False] and spread[4].held
        spread[0].end_response()
        await _settle()
        assert spread[4].picked
        for s in spread[1:]:
            s.end_response()
        await _settle()
        assert _in_flight(store) == 0

    _run(loop, main)


def test_a_held_requests_wait_counts_the_other_pickers_lobbies_as_deep_as_its_own() -> None:
    """Each picker sharing a pool (Envoys whose pickers are peers, or --ingresses) holds its share of the
    arrivals in a lobby the others do not see: the wait predicted for a held request (which feeds the
    pressure that opens admission) counts as many ahead in each, as the spike rule counts arrivals."""
    store = Datastore()
    store.update(_facts())
    prompt = parse_body(json.dumps({"model": "m", "max_tokens": 16,
                                    "messages": [{"role": "user", "content": "q"}]}).encode())
    waits = {}
    for pickers in (1, 2):
        picker = Picker(replace(HOLD, pressure_s=2.0, budget_standard=1000.0), rng=random.Random(0),
                        pickers=lambda n=pickers: n)  # type: ignore[misc]
        req = PickRequest("chat", prompt, (), saturated=False)
        assert picker.observe_held(req, store.endpoints("chat"), 3) is False  # held: nothing opened
        pressure = picker.admission.pressure("chat")
        assert pressure is not None
        waits[pickers] = pressure.last_s
    # (the engines' queues 0 + those ahead + itself) over what the pool serves: 4 ahead-and-itself alone, 7 with
    # the other lobby's 3
    assert waits[2] / waits[1] == pytest.approx(7 / 4)


def test_waiters_of_a_pool_a_reload_removed_are_left_to_the_proxy_at_once() -> None:
    """A topology reload removes the pool while requests wait for its slots: nothing will ever free one
    there, so they are answered without a pick at the lobby's next tick (outcome `gone`), not after
    `hold_max_s` (before: 2 s of waiting for each, then a pick in a pool that no longer exists)."""
    loop = _Loop()
    svc, store = _servicer(loop, HOLD)

    async def main() -> None:
        streams = [_Stream(svc, f"r{i}") for i in range(6)]
        for s in streams:
            s.start()
            await _settle()
        assert streams[4].held and streams[5].held and svc.lobby.depth("chat") == 2
        store.update([PoolFacts("other", ("m2",), ())])  # the reload: "chat" is gone
        loop.now += 0.05  # one tick, far short of hold_max_s
        await _settle()
        assert svc.lobby.depth("chat") == 0
        for s in streams[4:]:
            assert any(out.WhichOneof("response") == "request_body" for out in s.answers), s.answers
            assert not s.picked and not s.refused
        outcomes = {s.labels["outcome"]: s.value for f in svc.metrics.held.collect() for s in f.samples
                    if s.name.endswith("_total")}
        assert outcomes == {"gone": 2}

    _run(loop, main)
