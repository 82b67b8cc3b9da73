"""Envoy's in-flight limit per pool: the render's safety cap, lowered only while the pool is saturated.

confgen renders each pool's circuit breakers (`max_requests`, `max_pending_requests`) at
the safety cap, `backpressure.safety_cap` x the pool's declared capacity
(`confgen.model.in_flight_cap`): room for every slot and the engines' own queues, so
neither Envoy nor nginx queues or sheds at normal load. The sidecar decides saturation
from what the engines report (`sidecar.decide.saturation`: waiting queue per slot and its trend,
KV-cache use, fresh metrics only) and, while a pool is saturated, lowers this Envoy's
limit to what the shedding controller admits: new requests past it get 429 `overloaded`
with retry-after at once (Envoy overflows instead of queueing), the ones in flight are
never cancelled. Below saturation the limit is the safety cap.

The limit is set through Envoy's admin runtime layer,
`circuit_breakers.<cluster>.default.max_requests` and `...max_pending_requests` (checked
against Envoy 1.40: POST /runtime_modify takes effect on the next request), posted only
when it differs from what Envoy's /runtime shows (read every cycle, so an Envoy restart
that lost the admin layer is repaired), and read back; `in_force` is what Envoy confirmed.

Between probe cycles, `watch` reads this Envoy's in-flight count every
`SaturationPolicy.inflight_interval_s` (one admin stats call for every pool) and runs the
`InflightWatch`: a surge past the fleet's batch sets the limit at once instead of at the
next probe. The limiter runs that loop itself from `start` to `close` (`watch_loop`). A cycle's
limits (`set_limits`) and `watch` take turns (one lock), and a refusal seen by either counts
for the next cycle (the release rule needs every refusal).

Sheddable first: for the pools the render gives sheddable traffic (`sheddable`), `set_limits` (and
`watch`, when it starts the shedding) also sets `confgen.envoy.shed_runtime_key(pool)`, the
percentage of the pool's sheddable requests Envoy refuses at once (`sidecar.decide.priority`:
100 from the start of shedding, lowered while this limit has room, raised again while it
refuses, 0 once the pool stops shedding), in the same runtime call;
`sheddable_share` is what Envoy confirmed. Envoy counts those refusals per pool
(`<confgen.envoy.shed_stat_prefix(pool)>.http_local_rate_limit.rate_limited`, read in the same
stats call as the breakers' counters): tallied in `shed` as reason "share".
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from confgen.envoy import breaker_runtime_keys, shed_runtime_key, shed_stat_prefix
from sidecar.decide.admission import Admissions
from sidecar.decide.priority import ShedSharePolicy, ShedShares
from sidecar.decide.saturation import Admission, InflightWatch, PoolLoad, SaturationPolicy
from sidecar.logs import log_event
from sidecar.outputs.contract import OutputStatus, PoolStatus
from sidecar.outputs.envoy_admin import EnvoyAdmin

if TYPE_CHECKING:
    from sidecar.fleet import Cycle, Snapshot

__all__ = ["InflightLimiter", "watch_loop"]

_log = logging.getLogger("sidecar.outputs.files.limiter")


class Watched(Protocol):
    """What `watch_loop` drives."""

    @property
    def watch_interval_s(self) -> float | None: ...

    async def watch(self, now: float) -> None: ...


async def watch_loop(limiter: Watched, clock: Callable[[], float]) -> None:
    """`limiter.watch` every `watch_interval_s` until cancelled (at once when the interval is None).
    A watch that raises ends the loop (`report_end` logs it)."""
    interval = limiter.watch_interval_s
    if interval is None:
        return
    while True:
        started = clock()
        await limiter.watch(started)
        await asyncio.sleep(max(started + interval - clock(), 0.0))


def report_end(task: asyncio.Task[None]) -> None:
    """The watch ended other than by cancellation: logged once, when it ends."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log_event(_log, logging.ERROR, "task.failed", task=task.get_name(), error=repr(error),
                  note="the in-flight watch stopped; limits follow the probe cycle only")


class InflightLimiter:
    """Applies the shedding controller (`sidecar.decide.saturation.admit`) to Envoy's runtime layer
    (a `sidecar.outputs.contract.Output`)."""

    name = "inflight"

    def __init__(self, admin: EnvoyAdmin, ingresses: int, policy: SaturationPolicy | None = None,
                 sheddable: Callable[[], Collection[str]] = tuple,
                 share_policy: ShedSharePolicy | None = None) -> None:
        if ingresses < 1:
            raise ValueError(f"ingresses must be >= 1, got {ingresses}")
        self._admin = admin
        self._ingresses = ingresses
        self._policy = policy or SaturationPolicy()
        self._admissions = Admissions(self._policy, _log)
        self._overflows: dict[str, int] = {}  # pool -> Envoy's overflow counter at the last read
        self._refused: set[str] = set()  # pools whose limit refused requests since the last cycle's limits
        self._loads: dict[str, PoolLoad] = {}  # the last cycle's, what watch reads the batch from
        self._watches: dict[str, InflightWatch] = {}
        self._lock = asyncio.Lock()
        self._sheddable = sheddable  # the pools the current render gives sheddable traffic
        self._shares = ShedShares(share_policy)
        self._share_refusals: dict[str, int] = {}  # pool -> Envoy's shed share counter at the last read
        self.sheddable_share: dict[str, int] = {}  # pool -> percent of sheddable requests refused (confirmed)
        self.in_force: dict[str, int] = {}  # pool -> limit Envoy confirmed
        self.shed: dict[str, dict[str, int]] = {}  # pool -> reason -> refusals seen in Envoy's overflow counter
        self._watching: asyncio.Task[None] | None = None
        self._posted: set[str] = set()  # pools whose runtime keys this limiter has posted to Envoy

    async def start(self) -> None:
        """Start the in-flight watch between cycles (`watch_loop`; none when the interval is 0)."""
        task = asyncio.create_task(watch_loop(self, asyncio.get_running_loop().time), name="limits-watch")
        task.add_done_callback(report_end)
        self._watching = task

    async def close(self) -> None:
        """Stop the watch (a failure it ended with was logged when it ended)."""
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
            self._watching = None

    async def apply(self, cycle: Cycle) -> None:
        await self.set_limits(cycle.loads, cycle.now)

    def update(self, fleet: Snapshot) -> None:
        """Nothing: the limits follow the cycle's loads and Envoy's own counts."""

    def status(self) -> OutputStatus:
        known = {*self._admissions.pools(), *self.in_force, *self.shed, *self.sheddable_share, *self._watches}
        return OutputStatus(pools={pool: PoolStatus(
            inflight_limit=self.in_force.get(pool), inflight_past_batch=self.inflight_signal(pool),
            saturated="inflight" if self.inflight_saturated(pool) else "", shed=dict(self.shed.get(pool, {})),
            shedding=self.shedding(pool), sheddable_share=self.sheddable_share.get(pool)) for pool in known})

    @property
    def watch_interval_s(self) -> float | None:
        """How often `watch` wants to run (None: never)."""
        return self._policy.inflight_interval_s or None

    def forget(self, pool: str) -> None:
        self.in_force.pop(pool, None)
        self._admissions.forget(pool)
        self._overflows.pop(pool, None)
        self.shed.pop(pool, None)
        self._refused.discard(pool)
        self._loads.pop(pool, None)
        self._watches.pop(pool, None)
        self._shares.forget(pool)
        self._share_refusals.pop(pool, None)
        self.sheddable_share.pop(pool, None)

    def shedding(self, pool: str) -> bool:
        """True while the pool's limit follows the controller rather than the safety cap."""
        return self._admissions.shedding(pool)

    def inflight_signal(self, pool: str) -> float | None:
        watch = self._watches.get(pool)
        return watch.signal if watch is not None else None

    def inflight_saturated(self, pool: str) -> bool:
        watch = self._watches.get(pool)
        return watch is not None and watch.on

    async def set_limits(self, loads: Mapping[str, PoolLoad], now: float) -> None:
        """Compute every pool's limit and set those Envoy does not hold yet; a pool limited before and no
        longer in `loads` (a reload made it strict_dns, or removed it) gets its rendered breakers back."""
        async with self._lock:
            await self._retire([pool for pool in self._posted if pool not in loads])
            if not loads:
                return
            counters = await self._counters(list(loads))
            wanted: dict[str, int] = {}
            shares: dict[str, int] = {}
            sheddable = set(self._sheddable())
            for pool, load in loads.items():
                active = self._read(pool, counters, self._admissions.previous(pool), load.cap)
                refused = pool in self._refused
                self._refused.discard(pool)
                self._loads[pool] = load
                watch = self._watches.get(pool, InflightWatch()).observe(active, load.saturation, self._ingresses,
                                                                         now, self._policy)
                self._watches[pool] = watch
                saturation = watch.apply(load.saturation)
                wanted[pool] = self._admissions.step(
                    pool, replace(load, saturation=saturation), active, refused, self._ingresses, now, active=active,
                    full_share=round(saturation.full_share, 3), waiting=round(saturation.waiting, 1),
                    capacity=saturation.capacity, reason=saturation.reason)
                if pool in sheddable:
                    shares[pool] = self._share(pool, active, refused, wanted[pool], now)
                    self._read_share(pool, counters)
            await self._set(wanted, loads, shares)

    async def watch(self, now: float) -> None:
        """Between probes: this Envoy's in-flight count against the fleet's batch
        (`InflightWatch`); a pool it finds saturated gets its limit at once."""
        async with self._lock:
            if not self._loads:
                return
            counters = await self._counters(list(self._loads))
            if counters is None:
                return
            wanted: dict[str, int] = {}
            shares: dict[str, int] = {}
            sheddable = set(self._sheddable())
            for pool, load in self._loads.items():
                active = self._read(pool, counters, self._admissions.previous(pool), load.cap)
                watch = self._watches.get(pool, InflightWatch()).observe(active, load.saturation, self._ingresses,
                                                                         now, self._policy)
                self._watches[pool] = watch
                if not watch.on or self._admissions.shedding(pool):
                    continue  # nothing new: a pool already shedding follows the probes' cycle
                saturation = watch.apply(load.saturation)
                wanted[pool] = self._admissions.step(
                    pool, replace(load, saturation=saturation), active, False, self._ingresses, now, active=active,
                    signal=round(watch.signal or 0.0, 2), capacity=saturation.capacity, reason=saturation.reason)
                if pool in sheddable:  # the sheddable requests go first from now on
                    shares[pool] = self._share(pool, active, False, wanted[pool], now)
            if wanted:
                await self._set(wanted, {p: self._loads[p] for p in wanted}, shares)

    async def _retire(self, pools: Collection[str]) -> None:
        """Remove the runtime overrides this limiter set for `pools` from Envoy's admin layer (an empty
        value removes a key): their clusters' breakers are the rendered ones again, and a pool of the same
        name added later starts from them, not from a limit set for another fleet. Kept for the next cycle
        when Envoy does not take it."""
        if not pools:
            return
        keys = {key: "" for pool in pools for key in (*breaker_runtime_keys(pool), shed_runtime_key(pool))}
        if not await self._admin.set_runtime(keys):
            log_event(_log, logging.WARNING, "limit.unretired", admin=self._admin.base_url, pools=sorted(pools),
                      note="Envoy did not take the removal; tried again next cycle")
            return
        for pool in pools:
            self._posted.discard(pool)
            self.forget(pool)
            log_event(_log, logging.INFO, "limit.retired", pool=pool,
                      note="no longer limited by the sidecar: the cluster's rendered circuit breakers apply")

    async def _set(self, wanted: Mapping[str, int], loads: Mapping[str, PoolLoad],
                   shares: Mapping[str, int] | None = None) -> None:
        """Post the limits (and shed shares) Envoy does not hold yet, read them back into
        `in_force` (and `sheddable_share`)."""
        shares = shares or {}
        runtime = await self._admin.runtime()
        if runtime is None:
            log_event(_log, logging.WARNING, "limit.unreachable", admin=self._admin.base_url,
                      note="Envoy's runtime could not be read; limits unchanged")
            return
        changes = {key: str(limit) for pool, limit in wanted.items() for key in breaker_runtime_keys(pool)
                   if runtime.get(key) != str(limit)}
        changes.update({shed_runtime_key(pool): str(percent) for pool, percent in shares.items()
                        if runtime.get(shed_runtime_key(pool), "0") != str(percent)})
        self._posted.update(wanted)
        self._posted.update(shares)
        if changes and not await self._admin.set_runtime(changes):
            log_event(_log, logging.ERROR, "limit.refused", admin=self._admin.base_url, keys=sorted(changes))
        after = await self._admin.runtime() if changes else runtime
        for pool, limit in wanted.items():
            held = tuple(after.get(key) for key in breaker_runtime_keys(pool)) if after is not None else ()
            if held == (str(limit), str(limit)):
                if self.in_force.get(pool) != limit:
                    log_event(_log, logging.DEBUG, "limit.set", pool=pool, limit=limit,
                              before=self.in_force.get(pool), cap=loads[pool].cap,
                              saturated=loads[pool].saturation.saturated, ingresses=self._ingresses)
                self.in_force[pool] = limit
            else:
                log_event(_log, logging.WARNING, "limit.unconfirmed", pool=pool, limit=limit, envoy=list(held))
                self.in_force.pop(pool, None)
        for pool, percent in shares.items():
            held_share = after.get(shed_runtime_key(pool), "0") if after is not None else None
            if held_share == str(percent):
                self.sheddable_share[pool] = percent
            else:
                log_event(_log, logging.WARNING, "shed_share.unconfirmed", pool=pool, percent=percent,
                          envoy=held_share)
                self.sheddable_share.pop(pool, None)

    def _share(self, pool: str, active: int | None, refused: bool, limit: int, now: float) -> int:
        """The pool's sheddable share for this cycle (logs when it moves)."""
        before = self._shares.percent(pool)
        percent = self._shares.step(pool, shedding=self._admissions.shedding(pool), refused=refused,
                                    in_flight=active, limit=limit, now=now)
        if percent != before:
            log_event(_log, logging.INFO, "shed_share.set", pool=pool, percent=percent, before=before,
                      limit=limit, active=active, refused=refused)
        return percent

    def _read_share(self, pool: str, counters: dict[str, int | str] | None) -> None:
        """Tally the sheddable requests the pool's shed share refused since the last read."""
        count = counters.get(f"{shed_stat_prefix(pool)}.http_local_rate_limit.rate_limited") if counters else None
        if not isinstance(count, int):
            return
        before = self._share_refusals.get(pool)
        self._share_refusals[pool] = count
        if before is not None and count > before:
            tally = self.shed.setdefault(pool, {})
            tally["share"] = tally.get("share", 0) + count - before

    async def _counters(self, pools: list[str]) -> dict[str, int | str] | None:
        """Envoy's in-flight, overflow and shed share counters of every pool, in one admin call."""
        names = "|".join(re.escape(p) for p in pools)
        return await self._admin.stats(rf"^(cluster\.({names})\.(upstream_rq_(active|active_overflow|pending_overflow)"
                                       r"|circuit_breakers\.high\.remaining_rq)"
                                       rf"|{re.escape(shed_stat_prefix(''))}({names})\.http_local_rate_limit\.rate_limited)$")

    def _read(self, pool: str, counters: dict[str, int | str] | None, previous: Admission | None,
              cap: int) -> int | None:
        """This Envoy's requests in flight to the pool; a refusal by its breakers since the
        previous read marks the pool in `_refused` (Envoy 1.40 counts a max_requests overflow in
        `upstream_rq_active_overflow`, a max_pending_requests one in `upstream_rq_pending_overflow`:
        both are refusals, summed; reading the pending one alone saw none of the 429s);
        the refusals are tallied by reason: "saturated" while the controller's limit was in
        force, "cap" when it was the render's safety cap. With critical traffic the render gives
        the pool a HIGH-priority breaker at the safety cap that tracks what remains; those
        requests are not this limit's (it is DEFAULT's), so they are taken out of `active`."""
        active = counters.get(f"cluster.{pool}.upstream_rq_active") if counters is not None else None
        high_left = counters.get(f"cluster.{pool}.circuit_breakers.high.remaining_rq") if counters is not None else None
        if isinstance(active, int) and isinstance(high_left, int):
            active = max(0, active - max(0, cap - high_left))
        counts = [counters.get(f"cluster.{pool}.upstream_rq_{name}") if counters is not None else None
                  for name in ("active_overflow", "pending_overflow")]
        active = active if isinstance(active, int) else None
        if not any(isinstance(c, int) for c in counts):
            return active
        overflow = sum(c for c in counts if isinstance(c, int))
        before = self._overflows.get(pool)
        self._overflows[pool] = overflow
        if before is None or overflow <= before:
            return active
        reason = "saturated" if previous is not None and previous.shedding else "cap"
        tally = self.shed.setdefault(pool, {})
        tally[reason] = tally.get(reason, 0) + overflow - before
        self._refused.add(pool)
        return active
