"""Two Envoys share one fleet, each with only its own in-flight counts, with and without sidecar weights."""

from __future__ import annotations

from .. import _workload as wl
from .._harness import Context, Result, Target, fmt_ms, ratio
from ._fleets import THREE
from ._routing_core import WEIGHTS_INTERVAL_S, Variant, measure, slow_share

NAME = "two_ingress"
TITLE = "Two ingresses sharing one fleet (each Envoy sees only its own in-flight requests)"

VARIANTS = (
    Variant("two_p2c", "2x Envoy least_request P2C", "envoy", "least_request", ingresses=2),
    Variant("two_p2c_w", "2x Envoy least_request P2C + sidecar weights (same EDS to both)", "envoy",
            "least_request", weights="core", ingresses=2),
    Variant("two_p2c_d", "2x Envoy least_request P2C + a sidecar daemon each (weights + 80 % backpressure, "
            "--ingresses 2)", "envoy", "least_request", weights="daemon", ingresses=2),
)


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    plan = THREE
    duration = ctx.scale(24, 6)
    outputs = (8, 32) if ctx.quick else (16, 64)
    cap = plan.capacity_rps(wl.WorkloadSpec(rate=1, count=1, output_range=outputs))
    rate = cap * plan.load
    requests = wl.build(wl.WorkloadSpec(rate=rate, count=int(rate * duration) + 1, seed=ctx.seed + 1,
                                        output_range=outputs))
    rows, data = [], {}
    for v in VARIANTS if not ctx.quick else VARIANTS[:2]:
        s = measure(ctx, plan, requests, v, f"2i-{v.key}", duration)
        data[v.key] = s
        share, _capshare = slow_share(s["fleet_by_worker"], plan)
        print(f"  [two-ingress] {v.label}: p50 {fmt_ms(s['p50_ms'])} p99 {fmt_ms(s['p99_ms'])}", flush=True)
        rows.append([v.label, fmt_ms(s["p50_ms"]), fmt_ms(s["p99_ms"]), fmt_ms(s["ttft_p99_ms"]),
                     f"{s['throughput_rps']:.1f}", str(s["errors"]), "-" if share is None else f"{share:.0%}"])
    res.tables.append((f"{plan.label}, {rate:.1f} req/s for {duration:.0f} s ({len(requests)} requests), requests "
                       "alternate between the two Envoys",
                       ["setup", "P50 ms", "P99 ms", "TTFT P99 ms", "done/s (to last end)", "errors",
                        "slowest-worker share (capacity 20%)"], rows))
    a, b = data["two_p2c_w"]["p99_ms"], data["two_p2c"]["p99_ms"]
    r = ratio(a, b)
    res.targets.append(Target("Two-ingress P99 with sidecar weights vs without", "<= 0.75x",
                              f"{fmt_ms(a)} vs {fmt_ms(b)} ms", r, None if r is None else r <= 0.75, 0.75))
    res.raw = {"rate_rps": rate, "duration_s": duration, "results": data}
    res.chart = {"bars": [(s["label"], s["p50_ms"], s["p99_ms"]) for s in data.values()]}
    res.notes.append(f"'+ sidecar weights': weights via the sidecar's pure core, driven by the bench harness, every "
                     f"{WEIGHTS_INTERVAL_S} s, written to both Envoys' EDS files; circuit breakers lifted as in "
                     "'routing'. This row is the target's.")
    res.notes.append("'+ a sidecar daemon each': the sidecar as shipped next to each Envoy (--ingresses 2), with its "
                     "in-flight limit (429 instead of queueing) in force; full mode only.")
    return res
