"""The in-flight limit rule (sidecar.backpressure): capacity share, saturation, bounds."""

from __future__ import annotations

import pytest

from sidecar.backpressure import InflightLimiter, PoolLoad, base_limit, inflight_limit, runtime_keys
from sidecar.publish import EnvoyAdmin


def load(capacity: int, saturation: float | None, u: float = 0.8) -> PoolLoad:
    return PoolLoad(capacity=capacity, saturation=saturation, max_utilization=u)


def test_base_is_the_80_percent_rule_over_serving_capacity_and_ingresses() -> None:
    """floor(u x capacity / ingresses), never below 1 (also with nothing in rotation)."""
    assert base_limit(12, 0.8, 1) == 9
    assert base_limit(4, 0.8, 1) == 3
    assert base_limit(12, 0.8, 2) == 4
    assert base_limit(10, 0.8, 1) == 8  # 0.8 x 10 is 8.000000000000002 or 7.99..: exactly 8
    assert base_limit(0, 0.8, 1) == 1
    assert base_limit(1, 0.05, 3) == 1


def test_without_saturation_the_limit_is_the_base() -> None:
    """No sample (health-only engines) or an idle fleet: the capacity rule alone."""
    assert inflight_limit(load(12, None), 1, active=5, previous=2) == 9
    assert inflight_limit(load(12, 0.0), 1, active=None, previous=2) == 9


def test_saturated_fleet_scales_this_envoys_share_down() -> None:
    """Above u the limit is floor(active x u / s): this Envoy's proportional share, in [1, base]."""
    assert inflight_limit(load(12, 1.2), 1, active=6, previous=9) == 4
    assert inflight_limit(load(12, 0.9), 1, active=0, previous=9) == 1  # all load from elsewhere
    assert inflight_limit(load(12, 0.81), 1, active=9, previous=9) == 8
    assert inflight_limit(load(12, 0.85), 1, active=50, previous=9) == 9  # never above base
    # Envoy's own count unknown: hold (never raise), still within base.
    assert inflight_limit(load(12, 1.5), 1, active=None, previous=5) == 5
    assert inflight_limit(load(4, 1.5), 1, active=None, previous=5) == 3


def test_all_load_through_this_envoy_gives_back_the_base() -> None:
    """When every request in the engines came through here (active = s x capacity), the
    saturation rule agrees with the capacity rule: no double shedding."""
    capacity, u = 100, 0.8
    for active in range(81, 120):
        s = active / capacity
        assert inflight_limit(load(capacity, s, u), 1, active=active, previous=80) == 80


def test_repeated_cycles_converge_to_the_share_left_by_outside_load() -> None:
    """With outside load E the limit settles where ours + E = u x capacity, and climbs
    back to the base (by at least 1 a cycle) once E is gone. Bounded loop."""
    capacity, u, outside = 100, 0.8, 30
    limit = 80
    for _ in range(50):
        active = limit  # demand is unbounded: this Envoy fills its limit
        limit = inflight_limit(load(capacity, (active + outside) / capacity, u), 1, active, limit)
        assert 1 <= limit <= 80
    assert 49 <= limit <= 51
    for _ in range(50):
        limit = inflight_limit(load(capacity, limit / capacity, u), 1, limit, limit)
    assert limit == 80


def test_runtime_keys_name_the_default_priority_thresholds() -> None:
    """The keys Envoy 1.40 reads for a cluster's DEFAULT-priority circuit breakers."""
    assert runtime_keys("chat") == ("circuit_breakers.chat.default.max_requests",
                                    "circuit_breakers.chat.default.max_pending_requests")


def test_limiter_refuses_zero_ingresses() -> None:
    """--ingresses 0 would divide by zero: refused when the limiter is built."""
    with pytest.raises(ValueError, match="ingresses"):
        InflightLimiter(EnvoyAdmin("http://127.0.0.1:1"), 0)
