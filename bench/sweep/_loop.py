"""The event loop the virtual-time models share (`_model`, `overload`, `picker`).

- `Events`: a time-ordered queue of (time, kind, payload). At equal times the lower kind
  goes first, then the event pushed first, so a run is a function of its inputs. Each model
  numbers its own kinds; `STEP` (0) is the engines' step end.
- `Steps`: the engines' step ends on that queue (kind `STEP`, payload the engine's index).
  `schedule(i)` after a submit; `finished(i, t)` when a `STEP` event is popped: the requests
  engine i finished at t, its next step end scheduled (none for a stale event, an engine
  whose step end moved since the event was pushed).
- `sidecar_weights`: one cycle of the sidecar's weight loop over one pool, the shipped pure
  code (`sidecar.decide.weights.relative_speeds`, `target`, then the publish gate
  `sidecar.decide.hysteresis.gate`), from the samples and trends the model took.

No wall clock, no randomness here: the models own their seeded `random.Random`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from confgen.simulate import BatchEngine, EngineRequest
from sidecar.decide.hysteresis import HysteresisPolicy, gate
from sidecar.decide.weights import Trend, WeightPolicy, relative_speeds, target
from sidecar.observe.engines import LoadSample

P = TypeVar("P")

STEP = 0


class Events(Generic[P]):
    """Pending events, popped in (time, kind, order pushed) order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, P]] = []
        self._seq = 0

    def push(self, t: float, kind: int, payload: P) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def __iter__(self) -> Iterator[tuple[float, int, P]]:
        """Pop events until none is left, those pushed meanwhile included."""
        while self._heap:
            t, kind, _, payload = heapq.heappop(self._heap)
            yield t, kind, payload

    def any_but(self, kind: int) -> bool:
        """Whether an event of another kind than `kind` is pending."""
        return any(e[1] != kind for e in self._heap)


class Steps:
    """The step ends of `engines` as `STEP` events on `events` (payload: the engine's index)."""

    def __init__(self, events: Events[Any], engines: Sequence[BatchEngine]) -> None:
        self._events, self._engines = events, engines
        self._scheduled = [-1.0] * len(engines)  # the step end each engine has an event for

    def schedule(self, i: int) -> None:
        """An event for engine i's current step end, unless it has one already (or is idle)."""
        t = self._engines[i].next_event_time()
        if t is not None and t != self._scheduled[i]:
            self._scheduled[i] = t
            self._events.push(t, STEP, i)

    def finished(self, i: int, t: float) -> list[EngineRequest]:
        """At engine i's `STEP` event for t: the requests it finished, its next step scheduled;
        [] for a stale event (the engine's step end is no longer t)."""
        eng = self._engines[i]
        if eng.next_event_time() != t:
            return []
        done = [r for r in eng.advance(t) if r.finished_at is not None]
        self.schedule(i)
        return done


def sidecar_weights(samples: Sequence[LoadSample], trends: Sequence[Trend], caps: Sequence[int],
                    published: Sequence[int | None], streaks: Sequence[int], policy: WeightPolicy,
                    hysteresis: HysteresisPolicy, *, max_weight: int) -> tuple[list[int], list[int]]:
    """One weight cycle over a pool's workers: (the weights to publish, the gate's streaks)."""
    n = len(samples)
    speeds = relative_speeds({i: trends[i].token_latency_s for i in range(n)})
    weights, new_streaks = [], []
    for i in range(n):
        goal = target(samples[i], caps[i], policy, speed=speeds[i], queue=trends[i].queue)
        g = gate(goal, published[i], streaks[i], hysteresis, max_weight=max_weight)
        weights.append(g.weight)
        new_streaks.append(g.streak)
    return weights, new_streaks


__all__ = ["STEP", "Events", "Steps", "sidecar_weights"]
