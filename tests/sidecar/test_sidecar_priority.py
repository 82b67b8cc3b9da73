"""Sheddable first (sidecar.decide.priority), with a fake clock: the share of sheddable requests
refused at once rises while the pool's limit refuses requests, falls while it has room, is 0
when the pool is not shedding, and is never raised without this Envoy's in-flight count."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from sidecar.decide.priority import ShedShare, ShedSharePolicy, ShedShares, next_share

POLICY = ShedSharePolicy()  # first 100, x2, -10, room 0.9, min interval 1 s


def run(steps: list[tuple[bool, bool, int | None]], limit: int = 100, dt: float = 2.0,
        shares: ShedShares | None = None) -> list[int]:
    """The share after each cycle of (shedding, refused, in_flight), `dt` seconds apart."""
    shares = shares or ShedShares(POLICY)
    return [shares.step("chat", shedding=s, refused=r, in_flight=f, limit=limit, now=i * dt)
            for i, (s, r, f) in enumerate(steps)]


def test_a_shedding_pool_refuses_all_sheddable_traffic_at_once_a_smaller_first_step_doubles() -> None:
    """From the first cycle of shedding, refused or not yet: the sheddable requests go before
    the limit meets a standard one."""
    assert run([(True, True, 100)] * 5) == [100] * 5
    assert run([(True, False, 10)]) == [100]
    slow = ShedShares(ShedSharePolicy(first=25))
    assert run([(True, True, 100)] * 4, shares=slow) == [25, 50, 100, 100]


def test_not_shedding_is_zero_at_once_whatever_came_before() -> None:
    assert run([(True, True, 100), (True, True, 100), (False, True, 100), (False, False, 10)]) == [100, 100, 0, 0]


def test_with_room_and_nothing_refused_for_the_quiet_time_the_share_falls_slowly() -> None:
    """Cycles 2 s apart: the last refusal at 4 s, quiet from 8 s on, then -10 per cycle."""
    steps = [(True, True, 100)] * 3 + [(True, False, 50)] * 5
    assert run(steps) == [100, 100, 100, 100, 90, 80, 70, 60]


def test_refusals_every_other_cycle_keep_the_share_up() -> None:
    """At a small limit (5 of 6 in flight is 'room'), refusals on every other cycle: the share
    stays at 100 instead of a 100/90 sawtooth that lets sheddable requests in."""
    steps = [(True, True, 6)] * 2 + [(True, False, 5), (True, True, 6)] * 4
    assert run(steps, limit=6) == [100] * 10


def test_a_binding_limit_that_refuses_nothing_holds_the_share() -> None:
    """In flight at the limit (no room) but nothing refused: the share is about the excess."""
    assert run([(True, True, 100), (True, True, 100), (True, False, 95), (True, False, 100)]) == [100, 100, 100, 100]


def test_stale_or_missing_in_flight_never_raises_it() -> None:
    assert run([(True, True, None)] * 3) == [0, 0, 0]
    assert run([(True, True, 100), (True, True, None), (True, True, None)]) == [100, 100, 100]
    lowering = [(True, True, 100)] + [(True, False, 10)] * 4 + [(True, True, None)] * 2
    assert run(lowering) == [100, 100, 90, 80, 70, 70, 70]  # neither raised nor lowered without the count


def test_the_share_moves_at_most_once_per_min_interval() -> None:
    """Extra cycles (a reload, a fast publish) inside min_interval_s do not compound the raise."""
    slow = ShedShares(ShedSharePolicy(first=25))
    assert run([(True, True, 100)] * 4, dt=0.4, shares=slow) == [25, 25, 25, 50]


def test_a_raise_after_lowering_starts_from_where_it_is() -> None:
    steps = [(True, True, 100)] * 3 + [(True, False, 10)] * 5 + [(True, True, 100)]
    assert run(steps)[-2:] == [60, 100]


def test_shares_are_per_pool_and_forgotten() -> None:
    shares = ShedShares(POLICY)
    shares.step("chat", shedding=True, refused=True, in_flight=9, limit=10, now=0.0)
    shares.step("code", shedding=True, refused=False, in_flight=1, limit=10, now=0.0)
    assert (shares.percent("chat"), shares.percent("code")) == (100, 100)
    shares.forget("chat")
    assert shares.percent("chat") == 0


def test_next_share_is_pure() -> None:
    before = ShedShare(50, 0.0)
    after = next_share(before, shedding=True, refused=True, in_flight=10, limit=10, now=5.0, policy=POLICY)
    assert (before.percent, after.percent, after.changed_at) == (50, 100, 5.0)


@pytest.mark.parametrize("bad", [dict(first=0), dict(factor=0.5), dict(step_down=0), dict(room=0.0),
                                 dict(min_interval_s=-1.0), dict(first=101), dict(quiet_s=-1.0)])
def test_policy_refuses_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ShedSharePolicy(**bad)  # type: ignore[arg-type]


def test_the_file_limiter_tallies_the_shed_share_refusals_envoy_counts_per_pool() -> None:
    """Envoy counts a pool's shed share refusals in `confgen_shed_<pool>.http_local_rate_limit.
    rate_limited`: the first read sets the baseline, later increases are tallied as reason share;
    an unreadable counter changes nothing."""
    from confgen.envoy import shed_stat_prefix
    from sidecar.outputs.envoy_admin import EnvoyAdmin
    from sidecar.outputs.files.limiter import InflightLimiter

    limiter = InflightLimiter(EnvoyAdmin("http://127.0.0.1:1"), 1)
    name = f"{shed_stat_prefix('chat')}.http_local_rate_limit.rate_limited"
    limiter._read_share("chat", {name: 7})
    assert "chat" not in limiter.shed
    limiter._read_share("chat", {name: 12})
    limiter._read_share("chat", None)
    limiter._read_share("chat", {name: 15})
    assert limiter.shed["chat"] == {"share": 8}


class _Layer:
    """The RTDS side of the ADS publisher, as RtdsLimiter sees it (sidecar.outputs.xds.limits.RuntimeLayer)."""

    class _Nodes:
        def counted(self) -> int:
            return 1

    def __init__(self) -> None:
        self.nodes = self._Nodes()
        self.values: dict[str, int] = {}

    def set_runtime(self, values: Mapping[str, int]) -> bool:
        changed = dict(values) != self.values
        self.values = dict(values)
        return changed


def test_the_rtds_limiter_serves_the_shed_share_of_sheddable_pools_only() -> None:
    """ADS: the share rides the same RTDS layer as the breaker limits, for the pools the render
    gives sheddable traffic; it rises while the pool is saturated and its in-flight share is at
    the limit, and is 0 again once the pool is no longer saturated."""
    from confgen.envoy import shed_runtime_key
    from sidecar.decide.saturation import PoolLoad, PoolSaturation
    from sidecar.outputs.xds.limits import RtdsLimiter

    layer = _Layer()
    limiter = RtdsLimiter(layer, sheddable=lambda: ("chat",))

    def load(saturated: bool, in_flight: float) -> PoolLoad:
        return PoolLoad(cap=48, saturation=PoolSaturation(saturated=saturated, full_share=1.0 if saturated else 0.0,
                                                          capacity=12, fresh_capacity=12, waiting=in_flight - 12,
                                                          in_flight=in_flight, batch=12.0))

    shares = []
    for i in range(6):
        asyncio.run(limiter.set_limits({"chat": load(True, 40.0), "code": load(True, 40.0)}, now=2.0 * i))
        shares.append(layer.values[shed_runtime_key("chat")])
    assert shed_runtime_key("code") not in layer.values
    assert shares == [100] * 6, shares
    assert limiter.sheddable_share == {"chat": 100}
    for i in range(6, 12):
        asyncio.run(limiter.set_limits({"chat": load(False, 2.0), "code": load(False, 2.0)}, now=2.0 * i))
    assert not limiter.shedding("chat") and layer.values[shed_runtime_key("chat")] == 0, layer.values
