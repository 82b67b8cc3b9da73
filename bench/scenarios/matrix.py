"""Routing matrix: each fleet shape at 75-80 % of its estimated capacity, the same seeded
arrivals through the product as shipped and every comparator."""

from __future__ import annotations

import time
from typing import Any

from confgen.simulate import FleetHandle

from .. import _stats
from .._harness import Context, Result, Target, fmt_ms, fmt_ms3, fmt_x, fmt_x3, judged, ratio
from . import _fleets
from ._fleets import FleetPlan
from ._runner import BARE, PEER_POLICIES, PRODUCT, RENDER, Front, Setup, best, measure_or_fail, policy_setups, vllm

NAME = "matrix"
# Full run: every fleet on SEEDS_FULL seeds (fresh fleet, own arrivals), WINDOW_FULL s measured each.
# `--set matrix_seeds=N --set matrix_window_s=S` changes both. One seed is what fits `make bench`'s
# 25 minutes beside `prefix`; 3 seeds cost ~33 min for the matrix alone (README: the budget).
SEEDS_FULL = 1
WINDOW_FULL = 6.0
TITLE = "Routing matrix: the product as shipped against vLLM Router and a bare Envoy, fleet by fleet"


def setups(ctx: Context, plan: FleetPlan) -> list[Setup]:
    """The setups of a fleet; `--set matrix_policy_rows=1` adds the PRODUCT_POLICIES rows (the endpoint
    picker on the matrix: ~2 min more per seed, outside the 25-minute budget, so off by default)."""
    own = policy_setups()[0] if ctx.option("matrix_policy_rows", 0) else []
    if ctx.quick:
        return [PRODUCT, *own, RENDER, BARE, vllm("power_of_two")]
    return [PRODUCT, *own, RENDER, BARE,
            *(vllm(p) for p in PEER_POLICIES if p != "round_robin" or plan.round_robin_overload() <= 1.0)]


def _slowdown(plan: FleetPlan, at_s: float) -> Any:
    """`during` hook: slow the plan's worker `at_s` after the load starts."""
    def run(fleet: FleetHandle, _front: Front, t0: float) -> dict[str, Any]:
        assert plan.slowdown is not None
        time.sleep(max(0.0, t0 + at_s - time.monotonic()))
        fleet.workers[plan.slowdown.worker].set_fault("slow", factor=plan.slowdown.factor)
        return {"slowed_at_s": round(time.monotonic() - t0, 2)}
    return run


def seeds_for(ctx: Context) -> list[int]:
    """The seeds every fleet runs (each a fresh fleet and its own arrivals, the same for every setup)."""
    n = int(ctx.option("matrix_seeds", ctx.scale(SEEDS_FULL, 1)))
    return [ctx.seed + 1000 * k for k in range(max(1, n))]


def run_fleet(ctx: Context, plan: FleetPlan, warmup_s: float, window_s: float,
              seeds: list[int] | None = None) -> dict[str, Any]:
    cap = plan.capacity_rps()
    rate = cap * plan.load
    count = int(rate * (warmup_s + window_s)) + 1
    during = _slowdown(plan, warmup_s + plan.slowdown.at * window_s) if plan.slowdown else None
    per_seed: dict[str, list[dict[str, Any]]] = {}
    for seed in seeds or [ctx.seed]:
        requests = _build(plan, rate, count, seed)
        # --set matrix_max_tokens=N: clients send max_tokens N, a bound their answers stop short of
        loose = int(ctx.option("matrix_max_tokens", 0))
        if loose:
            from .._workload import loosely_bounded

            requests = loosely_bounded(requests, loose)
        deadline = requests[-1]["t"] + 1.0
        for s in setups(ctx, plan):
            tag = f"mx-{plan.key}-{s.key}-{seed}"
            r = measure_or_fail(ctx, plan.spec(seed), list(plan.max_num_seqs), requests, s, tag,
                                warmup_s=warmup_s, deadline_s=deadline, ingresses=plan.ingresses, during=during)
            r["seed"] = seed
            per_seed.setdefault(s.key, []).append(r)
            print(f"  [{plan.key} seed {seed}] {s.label}: p50 {fmt_ms(r['p50_ms'])} p99 {fmt_ms(r['p99_ms'])} ms, "
                  f"ok {r['ok']}/{r['requests']}, 429 {r['shed']}, picker late {r.get('picker_late', '-')} "
                  f"({r['wall_s']:.0f}s: start {r.get('startup_s')}, "
                  f"load {r.get('load_s')}, stop {r.get('teardown_s')})", flush=True)
    rows = {k: {**_stats.pooled(v), "label": v[0]["label"].split(" (FAILED")[0], "fleet_by_worker": _sum_workers(v),
                "send_lag_p99_ms": max((r.get("send_lag_p99_ms") or 0.0 for r in v), default=None),
                "failed": "; ".join(r["failed"] for r in v if r.get("failed")) or None,
                "prediction": _stats.prediction_error(_stats.summed(r.get("prediction_buckets") for r in v)),
                "prediction_measured": _stats.prediction_error(
                    _stats.summed(r.get("prediction_buckets_measured") for r in v))}
            for k, v in per_seed.items()}
    return {"plan": plan.key, "label": plan.label, "describe": plan.describe(), "even": plan.even,
            "capacity_rps": cap, "rate_rps": rate, "load": plan.load, "requests": count, "warmup_s": warmup_s,
            "window_s": window_s, "seeds": seeds or [ctx.seed], "results": rows,
            "per_seed": {k: [_lean(r) for r in v] for k, v in per_seed.items()}}


def _lean(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("seed", "p50_ms", "p90_ms", "p99_ms", "ttft_p99_ms", "ntpot_p99_ms", "shed", "other_errors", "requests",
            "ok", "fleet_by_worker", "failed", "wall_s", "startup_s", "load_s", "teardown_s", "slowed_at_s", "learned",
            "prediction_sums", "engine_latency", "mean_ms", "ttft_p50_ms")
    return {k: r.get(k) for k in keep if k in r}


def _sum_workers(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Requests per worker position over the seeds (worker names are the same in every seed)."""
    return {name: int(n) for name, n in _stats.summed(r.get("fleet_by_worker") for r in rows).items()}


def _build(plan: FleetPlan, rate: float, count: int, seed: int) -> list[dict[str, Any]]:
    from .._workload import build

    return build(plan.workload(rate, count, seed))


def seed_ratio(data: dict[str, Any], ours: str, ref: str | None, key: str = "p99_ms"
               ) -> tuple[float, float, float] | None:
    """(min, median, max) over the seeds of ours[key] / ref[key], seed by seed."""
    return _stats.seed_ratios(data.get("per_seed", {}), ours, ref, key)



def table(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = data["results"]
    peer = best(rows, [k for k in rows if k.startswith("vr_")])
    n = len(data["seeds"])
    head = ["setup", "P50 ms", "P90 ms", f"P99 ms (pooled, {n} seeds)", "P99 per seed: median [min-max]",
            "P99 / vLLM Router best: median of seeds [min-max]", "P90 / vLLM Router best (pooled)",
            "P99 / bare Envoy: median of seeds", "TTFT P99 ms", "NTPOT P99 ms/token", "429", "other errors",
            "measured requests", "requests per worker", "client send lag P99 ms (worst seed)"]
    out = []
    for key, r in rows.items():
        label = r["label"] + (" **(vLLM Router best)**" if key == peer else "")
        per_worker = "/".join(str(v) for v in r["fleet_by_worker"].values())
        p90_ref = rows[peer]["p90_ms"] if peer else None
        out.append([label, fmt_ms(r["p50_ms"]), fmt_ms(r["p90_ms"]), fmt_ms(r["p99_ms"]),
                    fmt_ms3(r["spread"]["p99_ms"]),
                    fmt_x3(seed_ratio(data, key, peer)), fmt_x(ratio(r["p90_ms"], p90_ref)),
                    fmt_x3(seed_ratio(data, key, "bare")), fmt_ms(r["ttft_p99_ms"]), fmt_ms(r["ntpot_p99_ms"]),
                    str(r["shed"]), str(r["other_errors"]), str(r["requests"]), per_worker,
                    fmt_ms(r["send_lag_p99_ms"])])
    return head, out


def summary(raw: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["fleet", "workers alike?", "seeds", "measured requests per setup", "product P99 ms (pooled)",
            "vLLM Router best (policy)", "product / best P99: median of seeds [min-max]", "product / best P90",
            "product / bare Envoy", "render alone / bare Envoy", "product 429", "target (product / best)"]
    out = []
    for key, data in raw.items():
        r = data["results"]
        peer = best(r, [k for k in r if k.startswith("vr_")])
        ref = r[peer]["p99_ms"] if peer else None
        out.append([key, "yes" if data["even"] else "no", str(len(data["seeds"])), str(r["product"]["requests"]),
                    fmt_ms(r["product"]["p99_ms"]),
                    f"{fmt_ms(ref)} ({r[peer]['label'].removeprefix('vLLM Router ')})" if peer else "-",
                    fmt_x3(seed_ratio(data, "product", peer)),
                    fmt_x(ratio(r["product"]["p90_ms"], r[peer]["p90_ms"] if peer else None)),
                    fmt_x3(seed_ratio(data, "product", "bare")), fmt_x3(seed_ratio(data, "render", "bare")),
                    str(r["product"]["shed"]), "<= 1.0x" if data["even"] else "<= 0.8x"])
    return head, out


def targets(data: dict[str, Any]) -> list[Target]:
    """Judged on the median over the seeds of the per-seed ratio (issue 17), the figure shows its spread."""
    rows = data["results"]
    key = data["plan"]
    n = len(data["seeds"])
    peer = best(rows, [k for k in rows if k.startswith("vr_")])
    out = []
    prod = rows["product"]
    limit = 1.0 if data["even"] else 0.8
    if peer is not None:
        s = seed_ratio(data, "product", peer)
        pr = None if s is None else s[1]
        out.append(Target(f"[{key}] product P99 vs vLLM Router's best ({rows[peer]['label']}), median of {n} seeds",
                          f"<= {limit:g}x", f"{fmt_ms(prod['p99_ms'])} vs {fmt_ms(rows[peer]['p99_ms'])} ms pooled; "
                          f"per seed {fmt_x3(s)}", pr, judged(pr, prod['p99_ms'], limit), limit))
        p90 = ratio(prod["p90_ms"], rows[peer]["p90_ms"])
        out.append(Target(f"[{key}] product P90 vs vLLM Router's best, pooled over {n} seeds", "<= 1x",
                          f"{fmt_ms(prod['p90_ms'])} vs {fmt_ms(rows[peer]['p90_ms'])} ms", p90,
                          judged(p90, prod["p90_ms"], 1.0), 1.0))
    out.append(Target(f"[{key}] product: requests shed (429) at {data['load']:.0%} load", "0",
                      f"{prod['shed']} of {prod['requests']}", float(prod["shed"]),
                      prod["shed"] == 0 and not prod.get("failed"), 0.0))
    s = seed_ratio(data, "render", "bare")
    rr = None if s is None else s[1]
    out.append(Target(f"[{key}] render alone P99 vs bare Envoy least_request, median of {n} seeds", "<= 1.05x",
                      f"{fmt_ms(rows['render']['p99_ms'])} vs {fmt_ms(rows['bare']['p99_ms'])} ms pooled; "
                      f"per seed {fmt_x3(s)}", rr, judged(rr, rows['render']['p99_ms'], 1.05), 1.05))
    return out


def _half_within(got: dict[str, Any]) -> str:
    """The factor half the requests are within: "-" in results saved before it was reported, "> 4x" past
    the widest band."""
    if "half_within" not in got:
        return "-"
    half = got["half_within"]
    return "> 4x" if half is None else f"{half:.2f}x"


def predictor_table(raw: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Per fleet: how well the product's picker predicted each request's finish time, over the whole run
    (warm-up included: the picker learns its coefficients then) and over the measured window."""
    rows = []
    for key, data in raw.items():
        product = data.get("results", {}).get("product") or {}
        cells = [key]
        for got in (product.get("prediction"), product.get("prediction_measured")):
            if got is None:
                cells += ["-"] * 5
                continue
            cells += [f"{got['requests']:.0f}", f"{got['median_ratio']:.2f}", f"{got['within_10']:.0%}",
                      f"{got['within_25']:.0%}", _half_within(got)]
        rows.append(cells)
    return ("The picker's prediction per fleet (product as shipped, every request it placed): observed / predicted "
            "time from the pick to the response's end (confgen_picker_prediction_ratio), over the whole run "
            "(warm-up included) and over the requests that ended in the measured window",
            ["fleet", "requests", "median observed / predicted", "within 10 %", "within 20-25 %",
             "half within (median error)", "measured: requests", "median", "within 10 %", "within 20-25 %",
             "half within"], rows)


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    plans = [p for p in _fleets.MATRIX if not ctx.quick or p.key in _fleets.QUICK]
    pick = int(ctx.option("matrix_pick", 0))  # --set matrix_pick=N: the Nth fleet alone (longer windows, fewer fleets)
    if pick:
        if not 1 <= pick <= len(_fleets.MATRIX):
            raise ValueError(f"--set matrix_pick={pick}: one of 1..{len(_fleets.MATRIX)} "
                             f"({', '.join(p.key for p in _fleets.MATRIX)})")
        plans = [_fleets.MATRIX[pick - 1]]
    warmup_s = ctx.option("matrix_warmup_s", ctx.scale(4, 3))
    window_s = ctx.option("matrix_window_s", ctx.scale(WINDOW_FULL, 3))
    seeds = seeds_for(ctx)
    groups: list[str] = []
    series: dict[str, list[float | None]] = {"product": [], "render alone": [], "bare Envoy": [],
                                             "vLLM Router best": []}
    for plan in plans:
        data = run_fleet(ctx, plan, warmup_s, window_s, seeds)
        res.raw[plan.key] = data
        head, rows = table(data)
        res.tables.append((f"**{plan.label}** ({plan.key}) - {plan.describe()}. {data['rate_rps']:.1f} req/s = "
                           f"{plan.load:.0%} of an estimated {data['capacity_rps']:.1f} req/s; per seed "
                           f"{window_s:g} s measured after {warmup_s:g} s of warm-up ({data['requests']} requests "
                           f"in all), seeds {', '.join(map(str, data['seeds']))}; an even split "
                           f"would load the busiest worker to {plan.round_robin_overload():.0%}", head, rows))
        res.targets += targets(data)
        r = data["results"]
        peer = best(r, [k for k in r if k.startswith("vr_")])
        ref = r[peer]["p99_ms"] if peer else None
        groups.append(plan.key)
        for name, key in (("product", "product"), ("render alone", "render"), ("bare Envoy", "bare"),
                          ("vLLM Router best", peer)):
            series[name].append(ratio(r[key]["p99_ms"], ref) if key in r else None)
    head, rows = summary(res.raw)
    res.tables.insert(0, ("Summary: the product as shipped on every fleet (details per fleet below)", head, rows))
    res.tables.insert(1, predictor_table(res.raw))
    res.chart = {"groups": {"title": "Matrix: P99 relative to vLLM Router's best policy (lower is better)",
                            "groups": groups, "series": series}}
    res.summary = (
        "Every fleet gets the same seeded arrivals for every setup, a fresh simulated fleet each time, latency "
        "from each request's scheduled send time. The target for the product is <= 0.8x vLLM Router's best policy "
        "where workers differ (speed, batch size or a slowdown) and <= 1.0x where they are alike, with nothing shed; "
        "the render alone must stay within 1.05x of a bare Envoy least_request.")
    res.notes += [
        "Statistics: every fleet runs on each seed of the run (a fresh fleet and its own arrivals per seed, the "
        "same for every setup). P50/P90/P99 are pooled over every seed's measured requests; 'per seed' gives the "
        "median and min-max of the seeds' own P99; a ratio is the median over the seeds of the per-seed ratio, "
        "with its min-max, and the targets judge that median. One seed's P99 over ~70-190 requests is close to "
        "its maximum: read a single-seed ratio as indicative only.",
        "P99 is over the requests that were served (200). A setup that answers 429 drops those requests from its "
        "latency figures, which can only flatter its P99: read the P99 and 429 columns together (the target asks "
        "for both: the ratio and 0 shed).",
        "Product = `confgen render` (the CLI, its own process) of the topology a user writes for the fleet: each "
        "worker's address and its max_num_seqs as `capacity`, engine vllm, the model, nothing else (bench/_proxies.py "
        "user_topology). Output unmodified, real Envoy 1.40 (--concurrency 1), and `confgen-sidecar` as its own "
        "process with default flags: only --topology, --xds-dir, --listen (a free port), and --ingresses 2 for the "
        "two-ingress fleet (each Envoy has its own sidecar).",
        "Bare Envoy least_request: the hand-written minimal config in bench/_bare_envoy.py (one listener, route "
        "timeout off, STATIC cluster, LEAST_REQUEST with Envoy's default choice_count 2; no health checks, no "
        "retries, no circuit_breakers block, so Envoy's default thresholds of 1,024 apply and are never reached).",
        "vLLM Router: every policy of " + ", ".join(PEER_POLICIES) + " on the same arrivals; its best (lowest P99) "
        "is the reference. Flags: --max-concurrent-requests 4096 --queue-size 4096 (it never sheds here), "
        "--request-timeout-secs 120, --health-check-interval-secs 1. Two-ingress fleet: two routers, requests "
        "alternate, like the two Envoys.",
        "Capacity is estimated from the simulator's latency model (bench/scenarios/_fleets.py): a worker completes "
        "1 / (mean output x step(B) / B + prefill(mean prompt)) requests/s with full batches of B; a slowed worker "
        "counts at its slowed speed. tests/bench/test_capacity.py checks it against the simulator's engine in "
        "virtual time: with a near-ideal router every fleet keeps up at 90 % of the estimate and falls behind at "
        "110 %.",
        "The warm-up requests go through the same setup (they let the sidecar learn the workers, and vLLM Router its "
        "caches) but are left out of every figure; 'requests per worker' counts the measured window's requests "
        "as the simulated workers saw them.",
        "vLLM Router round_robin runs only where the capacity model says an even split keeps every worker below "
        "its capacity (full mode: the equal and narrow fleets). Elsewhere an even split offers the slowest worker "
        "more than it can serve (the table caption gives how much), its queue grows for the whole run, and "
        "round_robin cannot be the best policy; leaving it out saves about two minutes of the budget.",
    ]
    if len(seeds) == 1:
        res.notes.append("This run has one seed per fleet: the spread columns are empty and every ratio is one "
                         "run's, over the request counts in the captions; read them as indicative. "
                         "`--set matrix_seeds=3` gives the seeds' median and spread (README: its cost).")
    if ctx.quick:
        res.notes.append(f"Quick mode runs the fleet(s) {', '.join(_fleets.QUICK)} only, {window_s:g} s measured, "
                         "and vLLM Router's power_of_two only.")
    return res
