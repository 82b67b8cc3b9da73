"""The publish gate (sidecar.decide.hysteresis): a weight is republished only when its target moved
far enough for long enough; rounding noise never reaches Envoy; slow start is immediate.
The fleet-level behaviour (a steady fleet stops writing, a 2x slowdown is seen within 3
cycles) is pinned in tests/bench/test_sweep.py on the fleet model, which drives this code."""

from __future__ import annotations

import random

import pytest

from sidecar.decide.hysteresis import Gated, HysteresisPolicy, gate

POLICY = HysteresisPolicy()


def run(goals: list[float], published: int | None, policy: HysteresisPolicy = POLICY) -> list[int]:
    """The published weight after each cycle, feeding the gate its own state back."""
    out = []
    streak = 0
    for goal in goals:
        g = gate(goal, published, streak, policy)
        published, streak = g.weight, g.streak
        out.append(published)
    return out


def test_first_publish_takes_the_target_as_it_is() -> None:
    """Before anything was published there is nothing to hold: the rounded target goes out."""
    assert gate(37.4, None, 0, POLICY) == Gated(37, 0)
    assert gate(0.2, None, 0, POLICY) == Gated(1, 0)  # Envoy rejects 0
    assert gate(1e9, None, 0, POLICY, max_weight=500) == Gated(500, 0)


def test_a_target_near_half_an_integer_never_flips_the_published_weight() -> None:
    """A target wandering around 2.5 (the old flip between 2 and 3 every cycle) and one
    wandering within 20 % of the published weight never cause a publish."""
    rng = random.Random(3)
    assert set(run([2.5 + rng.uniform(-0.3, 0.3) for _ in range(500)], 2)) == {2}
    assert set(run([2.5 + rng.uniform(-0.3, 0.3) for _ in range(500)], 3)) == {3}
    assert set(run([40 * (1 + rng.uniform(-0.19, 0.19)) for _ in range(500)], 40)) == {40}


def test_a_lasting_change_is_published_after_sustain_cycles() -> None:
    """A change past the threshold is published on the `sustain`-th cycle in a row, not before."""
    assert run([30.0] * 4, 40) == [40, 30, 30, 30]
    assert run([30.0] * 4, 40, HysteresisPolicy(sustain=3)) == [40, 40, 30, 30]
    assert run([30.0] * 4, 40, HysteresisPolicy(sustain=1)) == [30, 30, 30, 30]
    assert run([34.0] * 4, 40) == [40, 40, 40, 40]  # 15 %: inside the default band


def test_one_noisy_cycle_resets_the_streak() -> None:
    """A cycle back inside the band restarts the count: spikes that alternate never publish."""
    assert set(run([30.0, 40.0] * 50, 40)) == {40}
    assert run([30.0, 40.0, 30.0, 30.0], 40) == [40, 40, 40, 30]


def test_threshold_and_min_step_both_bound_the_band() -> None:
    """The band is max(threshold x published, min_step): 19 % of 100 is held, 21 % published;
    at small weights one unit of dead band holds a target 0.9 away."""
    assert run([81.0] * 3, 100) == [100, 100, 100]
    assert run([79.0] * 3, 100) == [100, 79, 79]
    assert run([2.9] * 3, 2) == [2, 2, 2]
    assert run([3.1] * 3, 2) == [2, 3, 3]
    assert run([2.9] * 3, 2, HysteresisPolicy(min_step=0.0)) == [2, 3, 3]


def test_immediate_publishes_on_the_first_cycle_past_the_band() -> None:
    """Slow start (`immediate`) skips the sustain count but still respects the band."""
    assert gate(20.0, 10, 0, POLICY, immediate=True) == Gated(20, 0)
    assert gate(10.5, 10, 0, POLICY, immediate=True) == Gated(10, 0)


def test_policy_rejects_nonsense() -> None:
    """Negative bands and a zero sustain are refused."""
    for kwargs in ({"threshold": -0.1}, {"min_step": -1.0}, {"sustain": 0}):
        with pytest.raises(ValueError, match="sustain"):
            HysteresisPolicy(**kwargs)  # type: ignore[arg-type]
