"""The lobby: requests held in the picker while every slot of their pool is taken (`PickerPolicy.hold`).

Without it, a request that finds every slot taken is placed at once and waits in an engine's queue.
While admission is off (the gate closed: a 78 % load's burst, or the first seconds of a surge before
the pressure opens) nothing limits that queue, and once admission opens, what the engines already
queued can only drain: seconds in which the requests admitted wait behind it (measured on 12 mixed
workers at 150 %: TTFT P90 2.2-2.6 s in the three seconds after the gate opened, 0.75-0.97 s after).
Held here instead, the backlog stays the picker's: each request is placed when a slot frees (the
endpoint chosen then, on the load of that moment), and when admission opens every request held is
decided at once with the time it waited counted in its delay (placed, or refused with a 429).

Per pool, one queue per class (standard ahead of sheddable; critical never waits here), first come
first served within it. A waiter is woken when a slot frees (the servicer calls `wake` on every
release and on a short tick while anyone waits), when admission opens (`open`), or at `hold_max_s`
(then placed as if it had not waited: an engine queue), or when its pool leaves the fleet view (a
topology reload removed it: answered without a pick at once, not at `hold_max_s`). Woken waiters count
against the free slots until they are placed, so one free slot wakes one waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Lobby", "Outcome", "Waiter"]

CLASS_ORDER = ("standard", "sheddable")  # who is woken first; critical never waits


class Outcome(StrEnum):
    SLOT = "slot"  # a slot freed
    OPEN = "open"  # admission opened: decided with its wait counted
    DEADLINE = "deadline"  # hold_max_s passed: placed as it comes
    GONE = "gone"  # the pool left the picker's fleet view (a topology reload removed it): left to the proxy


@dataclass(eq=False, slots=True)
class Waiter:
    pool: str
    traffic_class: str
    joined_at: float
    future: asyncio.Future[Outcome]
    timer: asyncio.TimerHandle | None = None
    woken: bool = False
    queue: deque[Waiter] = field(default_factory=deque)  # the one it waits in


class Lobby:
    """The requests held, per pool and class. Single-threaded: used from the picker's event loop."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._queues: dict[str, dict[str, deque[Waiter]]] = {}
        self._woken: dict[str, int] = {}  # per pool: woken, not yet placed

    def depth(self, pool: str) -> int:
        """Requests waiting (not yet woken) in the pool."""
        queues = self._queues.get(pool)
        return sum(len(q) for q in queues.values()) if queues else 0

    def claimed(self, pool: str) -> int:
        """Free slots the pool's woken waiters are about to take (woken, not yet placed)."""
        return self._woken.get(pool, 0)

    def pools(self) -> list[str]:
        """Pools with someone waiting."""
        return [pool for pool in self._queues if self.depth(pool)]

    def join(self, pool: str, traffic_class: str, hold_max_s: float) -> Waiter:
        loop = asyncio.get_running_loop()
        queue = self._queues.setdefault(pool, {}).setdefault(traffic_class, deque())
        waiter = Waiter(pool, traffic_class, self._clock(), loop.create_future(), queue=queue)
        queue.append(waiter)
        waiter.timer = loop.call_later(hold_max_s, self._wake, waiter, Outcome.DEADLINE)
        return waiter

    def leave(self, waiter: Waiter) -> float:
        """The waiter is done waiting (woken and resumed, or its stream ended): out of the lobby. Returns
        how long it waited."""
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        if waiter.woken:
            waiter.woken = False
            self._woken[waiter.pool] -= 1
        else:
            with contextlib.suppress(ValueError):  # already out (woken and left)
                waiter.queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()
        return self._clock() - waiter.joined_at

    def _wake(self, waiter: Waiter, outcome: Outcome) -> None:
        if waiter.woken or waiter.future.done():
            return
        try:
            waiter.queue.remove(waiter)
        except ValueError:
            return
        waiter.woken = True
        self._woken[waiter.pool] = self._woken.get(waiter.pool, 0) + 1
        waiter.future.set_result(outcome)

    def wake(self, pool: str, free: int) -> int:
        """Wake the first waiters of the pool, one per slot of `free` that no woken waiter has claimed
        yet; how many were woken."""
        queues = self._queues.get(pool)
        if not queues:
            return 0
        free -= self._woken.get(pool, 0)
        woken = 0
        for cls in CLASS_ORDER:
            queue = queues.get(cls)
            while queue and free > 0:
                self._wake(queue[0], Outcome.SLOT)
                free -= 1
                woken += 1
        return woken

    def open(self, pool: str, outcome: Outcome = Outcome.OPEN) -> int:
        """Admission opened in the pool (or the pool is gone: `outcome`): wake every waiter to be decided
        now; how many."""
        queues = self._queues.get(pool)
        if not queues:
            return 0
        woken = 0
        for queue in queues.values():
            while queue:
                self._wake(queue[0], outcome)
                woken += 1
        return woken
