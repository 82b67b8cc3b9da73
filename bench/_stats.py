"""Summaries of load-generator records: percentiles, throughput, errors, spread."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def ok(rec: dict[str, Any]) -> bool:
    return rec["status"] == 200 and rec["error"] is None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in records if ok(r)]
    e2e = [(r["end"] - r["start"]) * 1000 for r in good]
    ttft = [r["ttft"] * 1000 for r in good if r["ttft"] is not None]
    span = (max(r["end"] for r in good) - min(r["start"] for r in records)) if good else 0.0
    by_worker = Counter(r["worker"] or "-" for r in good)
    errors = Counter(f"{r['status']} {r['error'] or ''}".strip() for r in records if not ok(r))
    return {
        "requests": len(records),
        "ok": len(good),
        "errors": len(records) - len(good),
        "error_kinds": dict(errors.most_common(5)),
        "p50_ms": pct(e2e, 50), "p90_ms": pct(e2e, 90), "p99_ms": pct(e2e, 99),
        "mean_ms": statistics.fmean(e2e) if e2e else None,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "throughput_rps": len(good) / span if span > 0 else 0.0,
        "by_worker": dict(sorted(by_worker.items())),
    }


def spread(counts: dict[str, int]) -> float | None:
    """max/mean of per-worker request counts (1.0 = perfectly even by count)."""
    values = [v for k, v in counts.items() if k != "-"]
    if not values or not sum(values):
        return None
    return max(values) / (sum(values) / len(values))
