"""Fault modes: their parameters, their state over time, and the broken bodies they serve.

Pure (time passed in). The server asks this module what to do; it never decides here
how a socket behaves.

Parameters (all optional) by mode:
  every mode      duration_s       back to "none" after this long
  crash           revive_after_s   reopen the port after this long; loading_s: then slow start
  slow_health     delay_s          health answers after this delay (default 10)
  error_burst     count, status    the next `count` inference requests (default 10) get
                                   `status` (default 500)
  truncated_metrics how, fraction  "cut" (short body, valid HTTP) or "abort" (connection
                                   dropped mid-body); fraction of the body kept (0.5)
  slow_start      seconds, closed  503 "loading" for `seconds` (default 5); closed=true keeps
                                   the port closed instead (vLLM listens only once loaded)
  queue_full      max_queue, status  reject with `status` when `max_queue` requests wait
  slow            factor           every engine step takes `factor` times longer (default 2):
                                   a GPU that throttles or a noisy neighbour; the step in
                                   progress keeps its length
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._spec import FaultSpec, SpecError

__all__ = ["FaultState", "garbage_metrics", "html_metrics", "truncate_metrics", "validate"]

_NUMERIC = {
    "duration_s",
    "revive_after_s",
    "loading_s",
    "delay_s",
    "seconds",
    "fraction",
    "factor",
}
_INTEGER = {"count", "status", "max_queue"}


def validate(fault: FaultSpec) -> FaultSpec:
    """Check parameter types early so an admin call fails with 400, not later."""
    for key, value in fault.params.items():
        if key in _NUMERIC and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise SpecError(f"{fault.mode}: {key} must be a number")
        if key in _INTEGER and (not isinstance(value, int) or isinstance(value, bool)):
            raise SpecError(f"{fault.mode}: {key} must be an integer")
        if key in _NUMERIC | _INTEGER and value < 0:
            raise SpecError(f"{fault.mode}: {key} must be >= 0")
    if fault.params.get("factor", 1) == 0:
        raise SpecError(f"{fault.mode}: factor must be > 0")
    status = fault.params.get("status")
    if status is not None and not 100 <= status <= 599:
        raise SpecError(f"{fault.mode}: status must be an HTTP status")
    how = fault.params.get("how", "cut")
    if how not in ("cut", "abort"):
        raise SpecError('truncated_metrics: how must be "cut" or "abort"')
    return fault


@dataclass
class FaultState:
    """The current fault of one worker and when it began."""

    fault: FaultSpec
    since: float
    burst_left: int = 0

    @classmethod
    def start(cls, fault: FaultSpec, now: float) -> FaultState:
        burst = int(fault.params.get("count", 10)) if fault.mode == "error_burst" else 0
        return cls(fault=fault, since=now, burst_left=burst)

    @property
    def mode(self) -> str:
        return self.fault.mode

    def param(self, key: str, default: Any) -> Any:
        return self.fault.params.get(key, default)

    def expires_at(self) -> float | None:
        duration = self.fault.params.get("duration_s")
        if self.mode == "slow_start":
            duration = self.fault.params.get("seconds", 5.0)
        return None if duration is None else self.since + float(duration)

    def take_error(self) -> int | None:
        """Status for the next inference request under an error burst, or None."""
        if self.mode != "error_burst" or self.burst_left <= 0:
            return None
        self.burst_left -= 1
        return int(self.param("status", 500))

    def to_json(self) -> dict[str, Any]:
        out = self.fault.to_json()
        if self.mode == "error_burst":
            out["burst_left"] = self.burst_left
        return out


def garbage_metrics(seed: int) -> str:
    """Bytes that look nothing like an exposition (deterministic per seed)."""
    junk = "".join(chr(33 + (seed * 7919 + i * 104729) % 90) for i in range(400))
    return f"\x00\x01{junk}\nvllm:num_requests_running{{{{engine= 3 4 5\n}}}}\n"


def html_metrics() -> str:
    """An error page a misrouted proxy serves with status 200."""
    return (
        "<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n"
        "<body><center><h1>502 Bad Gateway</h1></center><hr><center>nginx</center>"
        "</body></html>\n"
    )


def truncate_metrics(text: str, fraction: float) -> str:
    """Cut about `fraction` in, inside a label set where there is one, so the last sample
    is broken for any parser (a cut inside a value could still parse: `12` -> `1`)."""
    cut = max(1, min(len(text) - 1, int(len(text) * fraction)))
    brace = text.find("{", cut)
    if brace != -1:
        return text[: brace + 3]
    while cut > 1 and text[cut - 1] == "\n":
        cut -= 1
    return text[:cut]
