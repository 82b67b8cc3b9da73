"""Summaries of load-generator records: percentiles, throughput, errors, spread.

Latency and TTFT are measured from each request's scheduled send time (`sched`), so a
request the client could not send on time is charged for the wait (no coordinated omission).
"""

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


def shed(rec: dict[str, Any]) -> bool:
    """Answered 429 (load shedding), by the proxy or the sidecar's limit."""
    return rec["status"] == 429


def summarize(records: list[dict[str, Any]], warmup_s: float = 0.0) -> dict[str, Any]:
    """Figures over the requests scheduled at or after `warmup_s` (the ones before only warm
    the routers up; every router gets the same ones)."""
    measured = [r for r in records if r["sched"] >= warmup_s]
    good = [r for r in measured if ok(r)]
    e2e = [(r["end"] - r["sched"]) * 1000 for r in good]
    ttft = [r["ttft"] * 1000 for r in good if r["ttft"] is not None]
    # time per output token after the first: (end - first token) / (chunks - 1), streamed requests only
    tpot = [(r["end"] - r["sched"] - r["ttft"]) * 1000 / (r["chunks"] - 1) for r in good
            if r["ttft"] is not None and r.get("chunks", 0) > 1]
    lag = [(r["start"] - r["sched"]) * 1000 for r in measured if r["start"] is not None]
    span = (max(r["end"] for r in good) - min(r["sched"] for r in measured)) if good else 0.0
    by_worker = Counter(r["worker"] or "-" for r in good)
    errors = Counter(f"{r['status']} {r['error'] or ''}".strip() for r in measured if not ok(r))
    n_shed = sum(1 for r in measured if shed(r))
    return {
        "requests": len(measured),
        "warmup_requests": len(records) - len(measured),
        "ok": len(good),
        "shed": n_shed,
        "errors": len(measured) - len(good),  # every failed request, 429s included
        "other_errors": len(measured) - len(good) - n_shed,  # failures that are not 429
        "shed_share": n_shed / len(measured) if measured else None,
        "error_kinds": dict(errors.most_common(5)),
        "p50_ms": pct(e2e, 50), "p90_ms": pct(e2e, 90), "p99_ms": pct(e2e, 99),
        "mean_ms": statistics.fmean(e2e) if e2e else None,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
        "send_lag_p99_ms": pct(lag, 99),
        "throughput_rps": len(good) / span if span > 0 else 0.0,
        "by_worker": dict(sorted(by_worker.items())),
    }


def spread(counts: dict[str, int]) -> float | None:
    """max/mean of per-worker request counts (1.0 = perfectly even by count)."""
    values = [v for k, v in counts.items() if k != "-"]
    if not values or not sum(values):
        return None
    return max(values) / (sum(values) / len(values))
