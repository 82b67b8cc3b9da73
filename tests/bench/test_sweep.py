"""The fleet model that chooses the weight defaults (bench/sweep): deterministic, its Envoy
least_request behaves as Envoy documents it, and with the shipped defaults (sidecar.decide.weights
+ sidecar.decide.hysteresis, driven in virtual time) a steady fleet stops writing EDS after the
first minute while a worker that slows 2x is republished within 3 probe cycles."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from bench.sweep._fleets import MATRIX, Shape
from bench.sweep._loop import Events
from bench.sweep._model import Knobs, _Envoy, run

SMALL = Shape("3w (1, 1, 0.5), seqs 8", (1.0, 1.0, 0.5), 8, requests=300)


def test_a_run_is_a_function_of_its_inputs() -> None:
    """Same shape, router, knobs and seed: the same figures; another seed: other arrivals."""
    a, b = run(SMALL, "envoy", 3), run(SMALL, "envoy", 3)
    assert a == b
    assert run(SMALL, "envoy", 4).p99 != a.p99


def test_envoy_equal_weights_is_p2c_and_unequal_weights_follow_the_edf_schedule() -> None:
    """Equal weights: the lower in-flight of `choice_count` random hosts. Unequal weights
    and idle hosts: picks in proportion to the weights; bias 1 with 3 in flight on the
    heavy host: 3 / (3 + 1) of its weight, so the two hosts are picked about equally."""
    rng = random.Random(1)
    lb = _Envoy(rng, 2, choice_count=2, bias=1.0)
    lb.set_weights([5, 5], [0, 0])
    assert Counter(lb.pick([9, 0]) for _ in range(400))[1] > 280  # host 1 wins every mixed draw
    lb.set_weights([3, 1], [0, 0])
    idle = Counter(lb.pick([0, 0]) for _ in range(400))
    assert idle[0] == pytest.approx(300, abs=2)
    lb.set_weights([4, 1], [3, 0])
    loaded = Counter(lb.pick([3, 0]) for _ in range(400))
    assert loaded[0] == pytest.approx(200, abs=4)


def test_a_steady_fleet_makes_no_eds_write_after_the_first_minute() -> None:
    """Five minutes of steady traffic on an even and an uneven fleet: weights settle and no
    write is made after 60 s (the old rule rewrote the file on most cycles)."""
    for shape in (MATRIX[0], MATRIX[5]):
        steady = replace(shape, requests=int(shape.rate() * 300))
        result = run(steady, "envoy", 1)
        assert steady.duration_s() > 290
        assert result.writes_after_warmup == 0, (shape.name, result)


def test_a_worker_slowing_2x_is_republished_within_three_cycles() -> None:
    """The fleet model's mid-run 2x slowdown of worker 0: its published weight falls by 10 %
    or more within 3 probe cycles, for several seeds."""
    shape = next(s for s in MATRIX if s.slowdown)
    shape = replace(shape, requests=1200)
    for seed in (1, 2, 3):
        react = run(shape, "envoy", seed, Knobs()).react_cycles
        assert react is not None and react <= 3, (seed, react)


def test_the_shared_event_loop_pops_by_time_then_kind_then_push_order() -> None:
    """bench/sweep/_loop.Events, the queue the three models share: at equal times the lower
    kind first, then the event pushed first; events pushed while iterating are popped too."""
    events: Events[str] = Events()
    for t, kind, name in ((2.0, 1, "late"), (1.0, 2, "probe"), (1.0, 1, "a"), (1.0, 1, "b"), (1.0, 0, "step")):
        events.push(t, kind, name)
    seen = []
    for t, _kind, name in events:
        seen.append(name)
        if name == "a":
            events.push(t, 1, "pushed meanwhile")
            assert events.any_but(1)
    assert seen == ["step", "a", "b", "pushed meanwhile", "probe", "late"]
    assert not events.any_but(1)
