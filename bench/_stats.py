"""Summaries of load-generator records: percentiles, throughput, errors, spread.

Latency and TTFT are measured from each request's scheduled send time (`sched`), so a
request the client could not send on time is charged for the wait (no coordinated omission).
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
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


def ntpot_ms(rec: dict[str, Any]) -> float | None:
    """Normalized time per output token (the inference gateway benchmarks' NTPOT): end-to-end
    latency / output tokens, in ms; None without a positive token count."""
    out = rec.get("out")
    if not isinstance(out, int) or out < 1 or rec["end"] is None:
        return None
    return (rec["end"] - rec["sched"]) * 1000 / out


def samples(records: list[dict[str, Any]], warmup_s: float = 0.0) -> dict[str, list[float]]:
    """Per served request (200) scheduled at or after `warmup_s`: end-to-end ms, TTFT ms, NTPOT ms."""
    good = [r for r in records if r["sched"] >= warmup_s and ok(r)]
    nt = [ntpot_ms(r) for r in good]
    return {"e2e": [(r["end"] - r["sched"]) * 1000 for r in good],
            "ttft": [r["ttft"] * 1000 for r in good if r["ttft"] is not None],
            "ntpot": [v for v in nt if v is not None],
            # time per output token after the first: (end - first token) / (streamed chunks - 1)
            "tpot": [(r["end"] - r["sched"] - r["ttft"]) * 1000 / (r["chunks"] - 1) for r in good
                     if r["ttft"] is not None and (r.get("chunks") or 0) > 1]}


def percentiles(s: dict[str, list[float]]) -> dict[str, float | None]:
    e2e, ttft, nt, tpot = s["e2e"], s["ttft"], s["ntpot"], s.get("tpot", [])
    return {"p50_ms": pct(e2e, 50), "p90_ms": pct(e2e, 90), "p99_ms": pct(e2e, 99),
            "mean_ms": statistics.fmean(e2e) if e2e else None,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
            "ntpot_p50_ms": pct(nt, 50), "ntpot_p99_ms": pct(nt, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99)}


def spread3(values: list[float | None]) -> tuple[float, float, float] | None:
    """(min, median, max) of the values that exist (e.g. one figure per seed); None if none do."""
    have = sorted(v for v in values if v is not None)
    if not have:
        return None
    return have[0], statistics.median(have), have[-1]


def seed_ratios(per_seed: dict[str, list[dict[str, Any]]], ours: str, ref: str | None, key: str = "p99_ms"
                ) -> tuple[float, float, float] | None:
    """(min, median, max) over the seeds both setups ran of ours[key] / ref[key], seed by seed
    (rows matched on their "seed"); None when there is no pair with both figures."""
    if ref is None or ours not in per_seed or ref not in per_seed:
        return None
    theirs = {r.get("seed"): r for r in per_seed[ref]}
    values: list[float | None] = []
    for a in per_seed[ours]:
        b = theirs.get(a.get("seed"))
        if b is not None and a.get(key) is not None and b.get(key):
            values.append(a[key] / b[key])
    return spread3(values)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setup over several seeds: percentiles over every seed's measured requests together
    (runs must carry "samples", see `summarize`), counts summed, and per figure the
    (min, median, max) across the seeds in "spread"."""
    have = [r for r in runs if r.get("samples")]
    joined: dict[str, list[float]] = {"e2e": [], "ttft": [], "ntpot": [], "tpot": []}
    for r in have:
        for k in joined:
            joined[k] += r["samples"].get(k, [])
    out: dict[str, Any] = percentiles(joined)
    for key in ("requests", "ok", "shed", "errors", "other_errors"):
        out[key] = sum(int(r.get(key) or 0) for r in runs)
    out["seeds"] = len(runs)
    out["seeds_ok"] = len(have)
    hits = [r.get("prefix_hit_rate") for r in runs]
    out["prefix_hit_rate"] = statistics.fmean([h for h in hits if h is not None]) if any(
        h is not None for h in hits) else None
    out["spread"] = {key: spread3([r.get(key) for r in runs])
                     for key in ("p50_ms", "p90_ms", "p99_ms", "ttft_p99_ms", "ntpot_p99_ms", "prefix_hit_rate")}
    return out


def _work_share(part: list[dict[str, Any]], whole: list[dict[str, Any]]) -> float | None:
    """The share of `whole`'s work (each record's "work") that `part` holds; None where any has none."""
    if not whole or any(r.get("work") is None for r in whole):
        return None
    total = sum(r["work"] for r in whole)
    return sum(r["work"] for r in part) / total if total > 0 else None


def summarize(records: list[dict[str, Any]], warmup_s: float = 0.0) -> dict[str, Any]:
    """Figures over the requests scheduled at or after `warmup_s` (the ones before only warm
    the routers up; every router gets the same ones); "samples" keeps the measured requests'
    end-to-end, TTFT and NTPOT values (ms) for pooling across seeds."""
    measured = [r for r in records if r["sched"] >= warmup_s]
    good = [r for r in measured if ok(r)]
    measured_samples = samples(records, warmup_s)
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
        # weighted by what each request costs the fleet (`work`, where the workload gives it): a rule that
        # refuses the longer requests first sheds less than the excess by count and about it by work
        "shed_work_share": _work_share([r for r in measured if shed(r)], measured),
        "error_kinds": dict(errors.most_common(5)),
        **percentiles(measured_samples),
        "send_lag_p99_ms": pct(lag, 99),
        "throughput_rps": len(good) / span if span > 0 else 0.0,
        "by_worker": dict(sorted(by_worker.items())),
        "samples": measured_samples,
    }


def timeline(records: list[dict[str, Any]], start_s: float, end_s: float) -> list[dict[str, Any]]:
    """Second by second from `start_s` to `end_s` (load-relative times): the requests scheduled in it
    (offered) and those of them answered 429 (shed), the requests that completed in it (by their end),
    and the requests in flight at its end (started, not yet ended); the TTFT and end-to-end P90 of the
    requests scheduled in it that were served. Where a surge's shedding and its backlog show: a second
    that admits everything, then seconds that drain what it let in, and who waits for it."""
    out = []
    second = start_s
    while second < end_s:
        nxt = second + 1.0
        scheduled = [r for r in records if second <= r["sched"] < nxt]
        served = [r for r in scheduled if ok(r)]
        out.append({
            "t": round(second, 3),
            "offered": len(scheduled),
            "shed": sum(1 for r in scheduled if shed(r)),
            "completed": sum(1 for r in records if ok(r) and r["end"] is not None and second <= r["end"] < nxt),
            "in_flight": sum(1 for r in records if r["start"] is not None and r["start"] < nxt
                             and (r["end"] is None or r["end"] >= nxt) and not shed(r)),
            # how the requests scheduled in it that were served fared: which seconds make the P99
            "ttft_p90_ms": pct([r["ttft"] * 1000 for r in served if r["ttft"] is not None], 90),
            "e2e_p90_ms": pct([(r["end"] - r["sched"]) * 1000 for r in served], 90),
        })
        second = nxt
    return out


def spread(counts: dict[str, int]) -> float | None:
    """max/mean of per-worker request counts (1.0 = perfectly even by count)."""
    values = [v for k, v in counts.items() if k != "-"]
    if not values or not sum(values):
        return None
    return max(values) / (sum(values) / len(values))


def prediction_error(buckets: dict[str, float]) -> dict[str, float] | None:
    """The picker's predicted finish time against the observed one, from its histogram
    `confgen_picker_prediction_ratio` (observed / predicted per request, cumulative buckets by
    `le`, summed over sidecars and seeds): the requests counted, the median ratio (linear within
    its bucket), the shares within +-10 % (0.9-1.1) and about +-25 % (0.8-1.25), and the factor half the
    requests are within (`half_within`: the median absolute error as a ratio). None when no request was
    predicted."""
    edges = sorted((float(le), n) for le, n in buckets.items() if le and le != "+Inf")
    total = buckets.get("+Inf", 0.0)
    if total <= 0 or not edges:
        return None
    cum = dict(edges)

    def share(lo: float, hi: float) -> float:
        return (cum.get(hi, 0.0) - cum.get(lo, 0.0)) / total

    # the first bucket holding the middle request (the +Inf one always does: past the last
    # finite bucket the median is that bucket's edge, a lower bound)
    below, prev = 0.0, 0.0
    for le, n in edges:
        if n >= total / 2:
            median = prev + (le - prev) * ((total / 2 - below) / (n - below) if n > below else 0.0)
            break
        below, prev = n, le
    else:
        median = prev
    # the factor half the requests are within (observed between predicted / f and predicted * f): the
    # buckets pair off as such bands (0.9-1.1 taken as 1.1, 0.8-1.25, 0.67-1.5, 0.5-2, 0.25-4), the factor
    # interpolated linearly between two bands; None past the widest (more than half off by 4x)
    bands = [(1.0, 0.0), *((hi, share(lo, hi)) for lo, hi in ((0.9, 1.1), (0.8, 1.25), (0.67, 1.5), (0.5, 2.0),
                                                           (0.25, 4.0)))]
    half: float | None = None
    for (f0, s0), (f1, s1) in itertools.pairwise(bands):
        if s1 >= 0.5:
            half = f0 + (f1 - f0) * (0.5 - s0) / (s1 - s0)
            break
    return {"requests": total, "median_ratio": median, "within_10": share(0.9, 1.1), "within_25": share(0.8, 1.25),
            "half_within": half}


def summed(maps: Iterable[Mapping[str, float] | None]) -> dict[str, float]:
    """The maps added key by key (None counts as empty)."""
    out: dict[str, float] = {}
    for m in maps:
        for key, value in (m or {}).items():
            out[key] = out.get(key, 0.0) + value
    return out
