"""Per-endpoint health state machine and the pool-level ejection cap. Pure: time is passed in.

Policy, and why:
- Published statuses are Envoy's EDS health statuses. "Ejected" means published
  UNHEALTHY; an endpoint is never dropped from the list, so the list is never empty and
  Envoy's panic threshold and active health checks keep working as the safety net.
- A streak of consecutive failures ejects once it reaches the threshold of the latest
  failure's kind: `refused_fall` (1) for connection refused, because nothing listens on
  the port (a killed worker) and that is out of rotation within one probe interval;
  `reset_fall` (2) for resets, which overloaded but live servers also produce; `fall` (3)
  for timeouts and HTTP errors. A killed *machine* shows as timeouts: `fall` probes.
- Error burst: `error_burst` failures within `error_burst_window_s`, consecutive or not,
  eject too; this catches a worker that fails every other probe and so never reaches a
  consecutive `fall`.
- Flap damping: each ejection within `flap_window_s` doubles the consecutive successes
  needed to return (`rise`, 2*rise, 4*rise... capped at `max_rise`), so a worker that
  alternates ok/fail stays out instead of oscillating every probe.
- Alive but slow (health latency above `degraded_latency_s` for `degraded_probes`
  probes, or HTTP 429) -> DEGRADED, never ejected for slowness: Envoy still uses it when
  healthy hosts are short. It returns to HEALTHY after `rise` fast answers.
- Stall (a wedged GPU answers /health 200): running > 0 while the progress counter stays
  flat for `stall_probes` probes AND `stall_min_s` seconds (the time floor keeps a long
  prefill from looking like a stall) -> UNHEALTHY. It returns only once the counter
  moves or running drops to 0: an ok /health alone is no evidence.
- Progress is proof of life: while the progress counter rose between the last two
  samples, the engine is demonstrably serving, so `needs_health` lets the prober skip
  /health (metrics only) - but only for a HEALTHY endpoint with no failure, slowness or
  stall on record, and never for longer than `health_every_s` since the last health
  answer (0 turns skipping off). An idle engine (counter flat) is always asked. A
  skipped probe carries no health latency, so a worker turning slow is seen DEGRADED at
  most `health_every_s` later than with a health probe every cycle.
- Quiet is nothing to weigh: while the last sample showed an idle engine (nothing
  running, nothing waiting, the counter flat) on a HEALTHY endpoint with nothing on
  record, `needs_metrics` lets the prober skip /metrics (health only) until
  `quiet_metrics_probes` probe intervals have passed since the last sample (1 turns
  skipping off; the default 3 reads an idle engine's metrics every third probe). The
  weights and the saturation trend keep the last sample; an idle engine that starts
  taking traffic is weighed at most `quiet_metrics_probes - 1` intervals later. A busy engine is scraped every
  probe (its speed is what the weights follow), and the two skips never combine: a
  probe always asks at least one of /health and /metrics.
- A probe that timed out while the sidecar's own event loop ran late (Outcome.LOOP_LATE,
  see sidecar.observe.probe) says nothing of the worker: it changes no state.
- A new endpoint starts UNHEALTHY until its first ok probe (one is enough: it has no
  failure history). Returning to service (new, recovered, undrained) starts a linear
  slow-start ramp over `slow_start_s`.
- DRAINING is a sticky flag set by `drain` (an admin call or a topology flag, combined
  by the caller) and cleared only by `undrain`. Health is still tracked underneath.
- Restarting the sidecar must not change anything: `EndpointState.adopt` seeds a state
  from the published status with no ramp and no pending streaks.
- `decide_pool` ejects at most `max_ejected_fraction` of a pool's non-drained endpoints
  (floor; a one-endpoint pool is never ejected). Beyond the cap the longest-failing are
  ejected first (stable across rounds); the rest stay published with the status they
  had before failing, at minimum weight. When every non-drained endpoint fails, the
  sidecar ejects none: more likely its own view is wrong (a partition between sidecar
  and workers, a bad health path) than that the whole pool died, and ejecting half of a
  pool would then halve capacity, worse than having no sidecar. All of them are kept at
  minimum (hence equal) weight, and Envoy's own health checks decide.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TypeVar

from sidecar.observe.engines import LoadSample
from sidecar.observe.result import Outcome, ProbeResult

__all__ = [
    "Decision",
    "EndpointState",
    "HealthPolicy",
    "Outcome",
    "ProbeResult",
    "Status",
    "decide_pool",
]


class Status(StrEnum):
    """Envoy EDS health statuses the sidecar publishes."""

    HEALTHY = "HEALTHY"
    DEGRADED = "DEGRADED"
    UNHEALTHY = "UNHEALTHY"
    DRAINING = "DRAINING"


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """Thresholds of the state machine (see the module docstring for the rules)."""

    probe_interval_s: float = 1.0
    rise: int = 2
    fall: int = 3
    refused_fall: int = 1
    reset_fall: int = 2
    max_rise: int = 16
    flap_window_s: float = 300.0
    degraded_latency_s: float = 1.0
    degraded_probes: int = 2
    stall_probes: int = 5
    stall_min_s: float = 30.0
    slow_start_s: float = 60.0
    error_burst: int = 5
    error_burst_window_s: float = 30.0
    max_ejected_fraction: float = 0.5
    health_every_s: float = 5.0  # longest /health gap while progress proves life; 0: never skip
    quiet_metrics_probes: int = 3  # read an idle engine's metrics every this many probes; 1: every probe

    def __post_init__(self) -> None:
        counts = (self.rise, self.fall, self.refused_fall, self.reset_fall,
                  self.degraded_probes, self.stall_probes, self.error_burst, self.quiet_metrics_probes)
        if min(counts) < 1 or self.max_rise < self.rise:
            raise ValueError("probe counts must be >= 1 and max_rise >= rise")
        if not 0.0 <= self.max_ejected_fraction <= 1.0:
            raise ValueError("max_ejected_fraction must be within 0..1")
        if min(self.probe_interval_s, self.slow_start_s, self.flap_window_s,
               self.error_burst_window_s, self.stall_min_s, self.degraded_latency_s,
               self.health_every_s) < 0:
            raise ValueError("durations must be >= 0")


@dataclass(frozen=True, slots=True)
class EndpointState:
    """What the sidecar believes about one endpoint. Immutable: `observe` returns a new one."""

    status: Status  # HEALTHY, DEGRADED or UNHEALTHY; DRAINING is the `drained` flag
    since: float  # when `status` last changed
    reason: str
    drained: bool = False
    last_serving: Status = Status.HEALTHY  # status before the last ejection
    last_at: float | None = None  # time of the newest probe taken into account
    ok_streak: int = 0  # consecutive alive probes that count toward rise
    fast_streak: int = 0
    slow_streak: int = 0
    fail_streak: int = 0
    failures: tuple[float, ...] = ()  # failure times, within error_burst_window_s
    ejections: tuple[float, ...] = ()  # ejection times, within flap_window_s
    stall_streak: int = 0
    progress_at: float | None = None  # when the progress counter last moved (or idle)
    last_tokens: float | None = None
    warm_since: float | None = None  # start of the slow-start ramp; None: fully warm
    stalled: bool = False  # ejected for a stall: needs progress evidence to return
    fresh: bool = False  # never served: one ok probe is enough
    advanced: bool = False  # the progress counter rose between the last two samples
    health_at: float | None = None  # time of the newest probe that asked /health
    metrics_at: float | None = None  # time of the newest probe that read a load sample
    quiet: bool = False  # the newest sample showed an idle engine (nothing running or waiting)

    @classmethod
    def new(cls, now: float) -> EndpointState:
        """A never-probed endpoint: out of rotation until its first ok probe."""
        return cls(Status.UNHEALTHY, since=now, reason="new: waiting for a first ok probe",
                   fresh=True)

    @classmethod
    def adopt(cls, published: Status | str, now: float) -> EndpointState:
        """Seed from the status already published (sidecar restart): no transition, no ramp.

        Accepts Envoy's names; UNKNOWN counts as HEALTHY (as Envoy treats it), TIMEOUT as
        UNHEALTHY. An adopted UNHEALTHY endpoint needs `rise` successes, as after one
        ejection; an adopted DRAINING one stays drained until `undrain`.
        """
        name = str(published).upper()
        if name in ("UNKNOWN", Status.HEALTHY):
            return cls(Status.HEALTHY, since=now, reason="adopted HEALTHY")
        if name == Status.DEGRADED:
            return cls(Status.DEGRADED, since=now, reason="adopted DEGRADED")
        if name in ("TIMEOUT", Status.UNHEALTHY):
            return cls(Status.UNHEALTHY, since=now, reason="adopted UNHEALTHY",
                       ejections=(now,))
        if name == Status.DRAINING:
            return cls(Status.HEALTHY, since=now, reason="adopted DRAINING", drained=True)
        raise ValueError(f"unknown published status {published!r}")

    @property
    def published(self) -> Status:
        """The status to publish when no pool-level rule intervenes."""
        return Status.DRAINING if self.drained else self.status

    def drain(self) -> EndpointState:
        """Planned drain: published DRAINING until `undrain`, whatever the probes say."""
        return self if self.drained else replace(self, drained=True)

    def undrain(self, now: float) -> EndpointState:
        """End a drain; a serving endpoint starts a slow-start ramp."""
        if not self.drained:
            return self
        serving = self.status is not Status.UNHEALTHY
        return replace(self, drained=False, warm_since=now if serving else self.warm_since)

    def ramp(self, now: float, policy: HealthPolicy) -> float:
        """Slow-start factor in [0, 1]: linear from returning to service, 1 when warm."""
        if self.warm_since is None or policy.slow_start_s <= 0:
            return 1.0
        return min(max((now - self.warm_since) / policy.slow_start_s, 0.0), 1.0)

    def rise_needed(self, policy: HealthPolicy) -> int:
        """Consecutive successes needed to return: doubles with each recent ejection."""
        if self.fresh:
            return 1
        flaps = max(len(self.ejections) - 1, 0)
        return min(policy.rise << min(flaps, 30), policy.max_rise)

    def needs_health(self, now: float, policy: HealthPolicy) -> bool:
        """Whether the next probe must ask /health; False only while progress proves life."""
        proven = (
            self.advanced
            and self.status is Status.HEALTHY
            and not (self.fresh or self.stalled or self.failures)
            and self.fail_streak == self.slow_streak == self.stall_streak == 0
            and self.health_at is not None
            and now - self.health_at < policy.health_every_s
        )
        return not proven

    def needs_metrics(self, now: float, policy: HealthPolicy) -> bool:
        """Whether the next probe must read /metrics; False only while the engine is quiet."""
        quiet = (
            self.quiet
            and not self.advanced
            and self.status is Status.HEALTHY
            and not (self.fresh or self.stalled or self.failures)
            and self.fail_streak == self.slow_streak == self.stall_streak == 0
            and self.metrics_at is not None
            and now - self.metrics_at < (policy.quiet_metrics_probes - 0.5) * policy.probe_interval_s
        )
        return not quiet

    def observe(self, result: ProbeResult, policy: HealthPolicy) -> EndpointState:
        """Take one probe result into account; results older than the last one are ignored."""
        at = result.at
        if (self.last_at is not None and at < self.last_at) or result.outcome is Outcome.LOOP_LATE:
            return self
        failed, slow, threshold, what = _classify(result, policy)
        stall_streak, progress_at, last_tokens = self._track_progress(result.sample, at)
        stalled_now = (
            stall_streak >= policy.stall_probes
            and progress_at is not None
            and at - progress_at >= policy.stall_min_s
        )
        still_stalled = self.stalled and self.status is Status.UNHEALTHY and (
            stall_streak > 0 or result.sample is None
        )
        burst_from = at - policy.error_burst_window_s
        failures = tuple(t for t in self.failures if t > burst_from) + ((at,) if failed else ())
        flaps_from = at - policy.flap_window_s
        nxt = replace(
            self,
            last_at=at,
            fail_streak=self.fail_streak + 1 if failed else 0,
            ok_streak=0 if failed or stalled_now or still_stalled else self.ok_streak + 1,
            fast_streak=0 if failed or slow else self.fast_streak + 1,
            slow_streak=self.slow_streak + 1 if slow else 0,
            failures=failures,
            ejections=tuple(t for t in self.ejections if t > flaps_from),
            stall_streak=stall_streak,
            progress_at=progress_at,
            last_tokens=last_tokens,
            advanced=_advanced(self.last_tokens, result.sample) if result.metrics_checked else self.advanced,
            health_at=at if result.health_checked else self.health_at,
            metrics_at=at if result.sample is not None else self.metrics_at,
            quiet=_quiet(result.sample) if result.metrics_checked else self.quiet,
        )
        if self.status is Status.UNHEALTHY:
            if nxt.ok_streak >= nxt.rise_needed(policy):
                back = Status.DEGRADED if slow else Status.HEALTHY
                return replace(nxt, status=back, since=at, warm_since=at,
                               reason=f"recovered after {nxt.ok_streak} ok probes",
                               failures=(), stalled=False, fresh=False)
            return nxt
        eject = None
        by_stall = False
        if failed and nxt.fail_streak >= threshold:
            eject = f"{nxt.fail_streak} consecutive failures, last: {what}"
        elif failed and len(failures) >= policy.error_burst:
            eject = (f"error burst: {len(failures)} failures in "
                     f"{policy.error_burst_window_s:g} s, last: {what}")
        elif stalled_now:
            by_stall = True
            eject = (f"stalled: running > 0 and progress counter flat for {stall_streak} "
                     f"probes / {at - (progress_at or at):.0f} s")
        if eject is not None:
            return replace(nxt, status=Status.UNHEALTHY, since=at, reason=eject,
                           last_serving=self.status, ejections=(*nxt.ejections, at),
                           failures=(), ok_streak=0, warm_since=None,
                           stalled=by_stall)
        if self.status is Status.HEALTHY and nxt.slow_streak >= policy.degraded_probes:
            return replace(nxt, status=Status.DEGRADED, since=at,
                           reason=f"slow: {nxt.slow_streak} slow answers ({what})")
        if self.status is Status.DEGRADED and nxt.fast_streak >= policy.rise:
            return replace(nxt, status=Status.HEALTHY, since=at, reason="fast again")
        return nxt

    def _track_progress(
        self, sample: LoadSample | None, at: float
    ) -> tuple[int, float | None, float | None]:
        """Return (stall streak, last progress time, counter) after `sample`."""
        if sample is None or sample.generated_tokens is None:
            return self.stall_streak, self.progress_at, self.last_tokens
        tokens = sample.generated_tokens
        flat = self.last_tokens is not None and tokens == self.last_tokens
        if sample.running > 0 and flat:
            return self.stall_streak + 1, self.progress_at, tokens
        # Moved, went down (engine restarted: a fresh counter) or idle: progress.
        return 0, at, tokens


def _quiet(sample: LoadSample | None) -> bool:
    """Whether `sample` shows an idle engine: nothing running, nothing waiting."""
    return sample is not None and sample.running == 0 and sample.waiting == 0


def _advanced(before: float | None, sample: LoadSample | None) -> bool:
    """Whether `sample`'s progress counter is above the previous one (the engine stepped)."""
    tokens = None if sample is None else sample.generated_tokens
    return before is not None and tokens is not None and tokens > before


def _classify(result: ProbeResult, policy: HealthPolicy) -> tuple[bool, bool, int, str]:
    """Return (failed, alive but slow, failure threshold, description)."""
    outcome = result.outcome
    if outcome is Outcome.REFUSED:
        return True, False, policy.refused_fall, "connection refused"
    if outcome is Outcome.RESET:
        return True, False, policy.reset_fall, "connection reset"
    if outcome is Outcome.TIMEOUT:
        return True, False, policy.fall, "timeout"
    code = result.http_status
    if code == 429:  # alive, over its concurrency limit: slow, not dead
        return False, True, policy.fall, "HTTP 429"
    if code is not None and not 200 <= code < 300:
        return True, False, policy.fall, f"HTTP {code}"
    latency = result.health_latency_s
    slow = latency is not None and latency > policy.degraded_latency_s
    return False, slow, policy.fall, "ok" if latency is None else f"health in {latency:.3f} s"


@dataclass(frozen=True, slots=True)
class Decision:
    """What to publish for one endpoint.

    `ramp` is the slow-start factor for `weights.weight(..., ramp=)`; `min_weight` means
    publish weight 1 (failing, but kept in rotation by the ejection cap).
    """

    status: Status
    ramp: float
    min_weight: bool
    reason: str


K = TypeVar("K", bound=Hashable)


def decide_pool(
    states: Mapping[K, EndpointState], policy: HealthPolicy, now: float
) -> dict[K, Decision]:
    """Decide every endpoint of one pool, applying the ejection cap and the all-down rule."""
    active = [k for k, s in states.items() if not s.drained]
    failing = [k for k in active if states[k].status is Status.UNHEALTHY]
    if failing and len(failing) == len(active):
        allowed = 0
        why = "all endpoints failing: sidecar stands back, Envoy health checks decide"
    else:
        allowed = math.floor(policy.max_ejected_fraction * len(active) + 1e-9)
        why = f"failing, kept at minimum weight: ejection cap {allowed}/{len(active)}"
    failing.sort(key=lambda k: (states[k].since, str(k)))
    ejected = set(failing[:allowed])
    decisions: dict[K, Decision] = {}
    for key, state in states.items():
        if state.drained:
            decisions[key] = Decision(Status.DRAINING, 1.0, False, "drained")
        elif key in ejected:
            decisions[key] = Decision(Status.UNHEALTHY, 0.0, False, state.reason)
        elif state.status is Status.UNHEALTHY:
            decisions[key] = Decision(state.last_serving, 1.0, True, f"{why} ({state.reason})")
        else:
            decisions[key] = Decision(state.status, state.ramp(now, policy), False, state.reason)
    return decisions
