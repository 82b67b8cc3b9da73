"""Admission: per pool, whether the picker refuses a request that would start past its class's budget.

The picker (scheduling.py) predicts each request's best start in its pool; this module keeps what
those predictions add up to, pool by pool, and answers what admission needs to know:

- the budgets (`WaitBudgets`): how long each class may wait to start, in multiples of the pool's
  service time (the policy's, or the pool's own from the topology);
- the gate (`admission_gate`): refuse only under a standing queue, not a burst a 78 % load brings. It
  opens by the pool's pressure (`Pressure`: the best predicted start averaged over `pressure_s`, past
  `open_share` of a service time; held while arrivals keep up with what the pool serves) or by a spike
  (`Spike`: arrivals at `spike_ratio` times what the pool serves while the best start is past the
  standard budget);
- for the requests the picker answers without a pick (late, or over its stream cap: their bodies
  unread), how far past its class's budget the pool's last predicted start puts one (`refusal_unread`);
- whether the pool surges (`surging`: the bypass share must not rise then).

The picker decides where a request goes and whether its delay there fits its budget; `Admission` holds
the state across requests. One `Admission` per picker; nothing here is shared between pickers (each
scales what it sees by the number of pickers that share the pools' arrivals).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Admission", "AdmissionSettings", "Pressure", "Spike", "WaitBudgets"]


class AdmissionSettings(Protocol):
    """The settings admission reads (PickerPolicy's fields of the same names: their meaning is there)."""

    @property
    def admission_gate(self) -> int: ...
    @property
    def pressure_s(self) -> float: ...
    @property
    def open_share(self) -> float: ...
    @property
    def hold_ratio(self) -> float: ...
    @property
    def spike_ratio(self) -> float: ...
    @property
    def spike_s(self) -> float: ...
    @property
    def spike_min(self) -> int: ...
    @property
    def budgets(self) -> WaitBudgets: ...


@dataclass(frozen=True, slots=True)
class WaitBudgets:
    """How long each class may be delayed in one pool: multiples of the pool's median service time, at
    least `floor_s` seconds (the policy's `budget_*`, or the pool's `admission` in the topology)."""

    standard: float
    sheddable: float
    floor_s: float = 0.0

    def of(self, traffic_class: str, service_s: float, step_s: float = 0.0) -> float | None:
        """Seconds a request of this class may wait to start; None: never refused (critical). `step_s`: the
        least wait the pool can predict once its slots are taken (a slot's share of a service time on its
        endpoint with the fewest): standard traffic may always wait that, else on endpoints of one or two
        slots every wait but none is past its budget and standard is refused exactly as sheddable is."""
        if traffic_class == "critical":
            return None
        if traffic_class == "sheddable":
            return max(self.floor_s, self.sheddable * service_s)
        return max(self.floor_s, self.standard * service_s, step_s)


@dataclass(slots=True)
class Pressure:
    """One pool's standing wait as this picker sees it: the earliest predicted start of each
    request it places (on the best candidate), averaged over time (an exponential moving average
    with time constant `tau_s`, each request weighted by the time since the one before).

    A burst lifts a few predictions for a moment; a surge lifts all of them for as long as it
    lasts. The pressure holds from the moment the average reaches `open_s` until it falls under
    `close_s`. It reacts within about `tau_s` of a surge, where the daemon's saturation verdict
    waits for probe cycles and a held queue (seconds of backlog that admission must then shed)."""

    level_s: float = 0.0
    at: float | None = None
    held: bool = False
    last_s: float = 0.0  # the latest prediction: the wait from then until the next request
    rate: float = 0.0  # arrivals per second through this picker (the same average)
    offered: float = 0.0  # that rate over this picker's share of what the pool serves (1.0: full)

    def observe(self, wait_s: float, now: float, tau_s: float, open_s: float, close_s: float,
                serves: float = 0.0, hold_ratio: float = 0.0) -> bool:
        """`serves`: requests per second this picker's share of the pool serves (0: unknown);
        while arrivals come at `hold_ratio` times that or faster a held pressure does not close
        (0: the queue alone decides)."""
        if self.at is not None and now > self.at:
            self.rate *= math.exp(-(now - self.at) / tau_s)
            # since the request before, the queue it saw drained one second per second (what
            # arrived since is this request's prediction, for the time after it): its mean wait
            # over the interval, so neither a request after a quiet spell nor one before it
            # counts for the spell
            dt, w = now - self.at, self.last_s
            mean = w - dt / 2.0 if dt <= w else w * w / (2.0 * dt)
            self.level_s += (1.0 - math.exp(-dt / tau_s)) * (mean - self.level_s)
        if self.at is None or now > self.at:
            self.at = now
        # the rate as this arrival finds it (counting it first would add 1 / tau_s to every reading)
        self.offered = self.rate / serves if serves > 0 else 0.0
        self.rate += 1.0 / tau_s
        # a prediction counts up to twice the opening level: however long one burst's queue, the
        # pressure opens only after it held for most of tau_s (0.69 tau_s at least)
        self.last_s = min(wait_s, 2.0 * open_s)
        if self.level_s >= open_s:
            self.held = True
        elif self.level_s < close_s and not (hold_ratio > 0 and serves > 0 and self.offered >= hold_ratio):
            self.held = False
        return self.held


class Spike:
    """One pool's arrival rate as this picker sees it: the requests of the last `window_s` (at most
    `MAX_SPIKE_ARRIVALS` kept), against what the pool serves per second."""

    def __init__(self) -> None:
        self._arrivals: deque[float] = deque(maxlen=MAX_SPIKE_ARRIVALS)

    def observe(self, now: float, window_s: float) -> int:
        """Count an arrival at `now`; the arrivals in the window ending there."""
        arrivals = self._arrivals
        arrivals.append(now)
        while arrivals and arrivals[0] <= now - window_s:
            arrivals.popleft()
        return len(arrivals)


MAX_SPIKE_ARRIVALS = 100_000  # 0.5 s at 200,000 req/s


@dataclass(slots=True)
class _Pool:
    """What admission knows of one pool, as of the picker's last predicted look at it."""

    pressure: Pressure | None = None
    spike: Spike | None = None
    gate: bool = False  # its pressure or a spike opened admission
    service_s: float | None = None  # the median time a request holds a slot
    step_s: float = 0.0  # the least wait it predicts once its slots are taken (WaitBudgets.of)
    rushing: bool = False  # arrivals at the spike rule's rate
    standing: tuple[float, float] | None = None  # (when, the best predicted start)


class Admission:
    """Each pool's gate and budgets, from the predictions the picker makes there (`observe`)."""

    def __init__(self, settings: AdmissionSettings, *, pickers: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`pickers`: how many pickers share the pools' arrivals now, this one included (the spike
        rule and the pressure's hold scale what this one sees by it)."""
        self.settings = settings
        self._pickers = pickers
        self._clock = clock
        self._pools: dict[str, _Pool] = {}
        self._budgets = settings.budgets
        # per pool: the topology's admission budgets where it sets any (the settings' for the others)
        self.pool_budgets: Mapping[str, WaitBudgets] = {}

    def _pool(self, pool: str) -> _Pool:
        state = self._pools.get(pool)
        if state is None:
            state = self._pools[pool] = _Pool()
        return state

    def budget_at(self, pool: str, traffic_class: str, service_s: float) -> float | None:
        """Seconds a request of this class may wait to start in the pool whose requests hold a slot
        `service_s`; None: never refused."""
        state = self._pools.get(pool)
        step = 0.0 if state is None else state.step_s
        return self.pool_budgets.get(pool, self._budgets).of(traffic_class, service_s, step)

    def slots(self, pool: str, service_s: float, fewest: int) -> None:
        """The pool's endpoints now: the one with the fewest slots has `fewest` (its least predicted wait
        once full is service_s / fewest: see WaitBudgets.of)."""
        self._pool(pool).step_s = service_s / max(1, fewest)

    def budget(self, pool: str, traffic_class: str) -> float | None:
        """Seconds a request of this class may be delayed in the pool, as of the picker's last look at
        it (None: never refused, or the pool not seen yet)."""
        state = self._pools.get(pool)
        service = None if state is None else state.service_s
        return None if service is None else self.budget_at(pool, traffic_class, service)

    def _opening(self, pool: str, service_s: float) -> float:
        """The average best predicted start (seconds) at which the pool's pressure opens: `open_share`
        of a service time, never under the pool's standard budget."""
        return max(self.settings.open_share * service_s, self.budget_at(pool, "standard", service_s) or 0.0)

    def observe(self, pool: str, wait_s: float, service_s: float, serves: float) -> bool:
        """One arrival whose best predicted start is `wait_s` away: into the pool's pressure and spike
        window. True when either opens admission (remembered for the requests the lobby places)."""
        state = self._pool(pool)
        state.standing = (self._clock(), wait_s)
        pressed = self._pressed(pool, state, wait_s, service_s, serves)
        spiking = self._spiking(pool, state, wait_s, service_s, serves)
        state.gate = opened = pressed or spiking
        state.service_s = service_s
        return opened

    def gate(self, pool: str) -> bool:
        """Admission was on in the pool by its pressure or a spike at the last look (before the settings'
        `admission_gate`: see `admitting`)."""
        state = self._pools.get(pool)
        return state is not None and state.gate

    def rushing(self, pool: str) -> bool:
        """Requests arrived at the spike rule's rate at the last look."""
        state = self._pools.get(pool)
        return state is not None and state.rushing

    def _pressed(self, pool: str, state: _Pool, wait_s: float, service_s: float, serves: float) -> bool:
        """The pool's pressure after this request's best predicted start (`Pressure`), held while
        the pickers sharing the pool see arrivals at `hold_ratio` times what it `serves` per second."""
        settings = self.settings
        if settings.pressure_s <= 0:
            return False
        if state.pressure is None:
            state.pressure = Pressure()
        open_s = self._opening(pool, service_s)
        close_s = 0.5 * (self.budget_at(pool, "sheddable", service_s) or 0.0)
        return state.pressure.observe(wait_s, self._clock(), settings.pressure_s, open_s, close_s,
                                      serves / max(1, self._pickers()), settings.hold_ratio)

    def _spiking(self, pool: str, state: _Pool, wait_s: float, service_s: float, serves: float) -> bool:
        """Requests arriving at `spike_ratio` times what the pool `serves` per second while the best
        predicted start is past the standard budget (`Spike`).
        Each of the pickers sharing the pool (`pickers`) sees its share of the arrivals."""
        settings = self.settings
        seen = self._arrival(state)
        if seen is None:
            return False
        arrivals = seen * max(1, self._pickers())
        state.rushing = rushing = arrivals >= max(settings.spike_min,
                                                  settings.spike_ratio * serves * settings.spike_s)
        return rushing and wait_s > (self.budget_at(pool, "standard", service_s) or 0.0)

    def _arrival(self, state: _Pool) -> int | None:
        """An arrival into the pool's spike window; the arrivals in it (None: no spike rule)."""
        settings = self.settings
        if settings.spike_ratio <= 0 or settings.spike_s <= 0:
            return None
        if state.spike is None:
            state.spike = Spike()
        return state.spike.observe(self._clock(), settings.spike_s)

    def arrived(self, pool: str) -> None:
        """A request of the pool answered without a pick (it reached the picker late, or over its stream
        cap): counted in the pool's spike window all the same, so that a rush which makes the picker late
        is still counted as one (12 workers at 3x on the bench's 2 cores: the picker 10-61 requests late)."""
        self._arrival(self._pool(pool))

    def refusal_unread(self, pool: str, traffic_class: str, saturated: bool) -> float | None:
        """A request of the pool answered without a pick (late, or over the stream cap: its body unread)
        while admission is on there (`saturated`: the daemon's verdict): how far past its class's budget
        the pool's last predicted start, drained one second per second since, puts it; None: within it
        (or admission off, or nothing predicted yet), the proxy places it."""
        state = self._pools.get(pool)
        standing = None if state is None else state.standing
        budget = self.budget(pool, traffic_class)
        if standing is None or budget is None or not (saturated or self.admitting(pool)):
            return None
        at, wait_s = standing
        wait_s -= max(0.0, self._clock() - at)
        return wait_s - budget if wait_s > budget else None

    def admitting(self, pool: str) -> bool:
        """Admission is on in the pool by the picker's own signals (its pressure or a spike), as of its
        last look; the daemon's saturation verdict is the caller's."""
        return self.gate(pool) or not self.settings.admission_gate

    def surging(self, pool: str) -> bool:
        """Admission is on in the pool (`admitting`), or requests arrive at least as fast as it serves them
        (over `pressure_s`, or at the spike rule's rate: a surge before admission opens), as of the last look,
        if that was within the last second or `pressure_s` (a pool no request reached since is not)."""
        state = self._pools.get(pool)
        if state is None or state.standing is None \
                or self._clock() - state.standing[0] > max(1.0, self.settings.pressure_s):
            return False
        pressure = state.pressure
        return (self.admitting(pool) or state.rushing
                or (pressure is not None and pressure.offered >= 1.0))

    def pressure(self, pool: str) -> Pressure | None:
        """The pool's pressure as of its last predicted pick (None before one)."""
        state = self._pools.get(pool)
        return None if state is None else state.pressure

    def pressures(self) -> dict[str, Pressure]:
        """Every pool's pressure (for the metrics)."""
        return {pool: state.pressure for pool, state in self._pools.items() if state.pressure is not None}
