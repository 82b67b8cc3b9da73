"""Shared plumbing for scenarios: the run context, fleets, the sidecar-core child process."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confgen.simulate import FleetHandle


@dataclass
class Context:
    quick: bool
    seed: int
    out: Path
    work: Path  # scratch (configs, raw records)
    notes: list[str] = field(default_factory=list)
    options: dict[str, float] = field(default_factory=dict)  # --set KEY=NUMBER

    def scale(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def option(self, key: str, default: float) -> float:
        return self.options.get(key, default)


@dataclass
class Target:
    name: str
    goal: str  # human form, e.g. "<= 0.45x"
    measured: str
    ratio: float | None  # measured / reference, or the measured value for absolute targets
    met: bool | None  # None = not measured
    limit: float | None = None  # what `ratio` is held against (met when ratio <= limit)

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "goal": self.goal, "measured": self.measured,
                "ratio": self.ratio, "met": self.met, "limit": self.limit}


@dataclass
class Result:
    name: str
    title: str
    summary: str = ""
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    chart: dict[str, Any] = field(default_factory=dict)


def fleet_stats(fleet: FleetHandle) -> dict[str, dict[str, Any]]:
    return {w.name: w.stats() for w in fleet.workers}


def stats_delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per-worker inference requests and prefix-cache figures between two snapshots."""
    out: dict[str, Any] = {"by_worker": {}, "hit_tokens": 0, "query_tokens": 0}
    for name, a in after.items():
        b = before.get(name, {})
        bp, ap = b.get("prefix_cache", {}), a["prefix_cache"]
        # A restarted worker's counters start from 0 again.
        restarted = a.get("restarts", 0) != b.get("restarts", 0)
        base = _base(bp, restarted)
        out["by_worker"][name] = a["inference_received"] - (0 if restarted else b.get("inference_received", 0))
        out["hit_tokens"] += ap["hit_tokens"] - base("hit_tokens")
        out["query_tokens"] += ap["query_tokens"] - base("query_tokens")
    q = out["query_tokens"]
    out["prefix_hit_rate"] = out["hit_tokens"] / q if q else None
    return out


def _base(prev: dict[str, int], restarted: bool) -> Any:
    return lambda k: 0 if restarted else prev.get(k, 0)


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def judged(value: float | None, ours: float | None, limit: float) -> bool | None:
    """A ratio target: missed when our own figure is missing (our run failed), not measured when
    only the reference is missing, else value <= limit."""
    if ours is None:
        return False
    return None if value is None else value <= limit


def fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def fmt_x3(s: tuple[float, float, float] | None) -> str:
    """A ratio's (min, median, max) over seeds: "0.82x [0.75-0.90]", or "0.82x" for one value."""
    if s is None:
        return "-"
    return f"{s[1]:.2f}x" if s[0] == s[2] else f"{s[1]:.2f}x [{s[0]:.2f}-{s[2]:.2f}]"


def fmt_ms3(s: tuple[float, float, float] | None) -> str:
    if s is None:
        return "-"
    return fmt_ms(s[1]) if s[0] == s[2] else f"{fmt_ms(s[1])} [{fmt_ms(s[0])}-{fmt_ms(s[2])}]"


def fmt_pct3(s: tuple[float, float, float] | None) -> str:
    if s is None:
        return "-"
    return f"{s[1]:.0%}" if s[0] == s[2] else f"{s[1]:.0%} [{s[0]:.0%}-{s[2]:.0%}]"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def wait_until(cond: Any, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


def names(seq: Sequence[Any]) -> list[str]:
    return [str(s) for s in seq]
