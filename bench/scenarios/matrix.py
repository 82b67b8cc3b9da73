"""Routing matrix: each fleet shape at 75-80 % of its estimated capacity, the same seeded
arrivals through the product as shipped and every comparator."""

from __future__ import annotations

import time
from typing import Any

from confgen.simulate import FleetHandle

from .._harness import Context, Result, Target, fmt_ms, fmt_x, judged, ratio
from . import _fleets
from ._fleets import FleetPlan
from ._runner import BARE, PEER_POLICIES, PRODUCT, RENDER, Front, Setup, best, measure_or_fail, vllm

NAME = "matrix"
TITLE = "Routing matrix: the product as shipped against vLLM Router and a bare Envoy, fleet by fleet"


def setups(ctx: Context, plan: FleetPlan) -> list[Setup]:
    if ctx.quick:
        return [PRODUCT, RENDER, BARE, vllm("power_of_two")]
    return [PRODUCT, RENDER, BARE,
            *(vllm(p) for p in PEER_POLICIES if p != "round_robin" or plan.round_robin_overload() <= 1.0)]


def _slowdown(plan: FleetPlan, at_s: float) -> Any:
    """`during` hook: slow the plan's worker `at_s` after the load starts."""
    def run(fleet: FleetHandle, _front: Front, t0: float) -> dict[str, Any]:
        assert plan.slowdown is not None
        time.sleep(max(0.0, t0 + at_s - time.monotonic()))
        fleet.workers[plan.slowdown.worker].set_fault("slow", factor=plan.slowdown.factor)
        return {"slowed_at_s": round(time.monotonic() - t0, 2)}
    return run


def run_fleet(ctx: Context, plan: FleetPlan, warmup_s: float, window_s: float) -> dict[str, Any]:
    cap = plan.capacity_rps()
    rate = cap * plan.load
    count = int(rate * (warmup_s + window_s)) + 1
    requests = _build(plan, rate, count, ctx.seed)
    deadline = requests[-1]["t"] + 1.0
    during = _slowdown(plan, warmup_s + plan.slowdown.at * window_s) if plan.slowdown else None
    rows: dict[str, dict[str, Any]] = {}
    for s in setups(ctx, plan):
        tag = f"mx-{plan.key}-{s.key}"
        rows[s.key] = measure_or_fail(ctx, plan.spec(ctx.seed), list(plan.max_num_seqs), requests, s, tag,
                              warmup_s=warmup_s, deadline_s=deadline, ingresses=plan.ingresses, during=during)
        r = rows[s.key]
        print(f"  [{plan.key}] {s.label}: p50 {fmt_ms(r['p50_ms'])} p99 {fmt_ms(r['p99_ms'])} ms, "
              f"ok {r['ok']}/{r['requests']}, 429 {r['shed']} ({r['wall_s']:.0f}s: start {r.get('startup_s')}, "
              f"load {r.get('load_s')}, stop {r.get('teardown_s')})", flush=True)
    return {"plan": plan.key, "label": plan.label, "describe": plan.describe(), "even": plan.even,
            "capacity_rps": cap, "rate_rps": rate, "load": plan.load, "requests": count, "warmup_s": warmup_s,
            "window_s": window_s, "results": rows}


def _build(plan: FleetPlan, rate: float, count: int, seed: int) -> list[dict[str, Any]]:
    from .._workload import build

    return build(plan.workload(rate, count, seed))


def table(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = data["results"]
    peer = best(rows, [k for k in rows if k.startswith("vr_")])
    peer_p99 = rows[peer]["p99_ms"] if peer else None
    bare_p99 = rows["bare"]["p99_ms"] if "bare" in rows else None
    head = ["setup", "P50 ms", "P99 ms", "P99 / vLLM Router best", "P99 / bare Envoy", "TTFT P99 ms", "429",
            "other errors", "requests per worker (measured window)", "client send lag P99 ms"]
    out = []
    for key, r in rows.items():
        label = r["label"] + (" **(vLLM Router best)**" if key == peer else "")
        per_worker = "/".join(str(v) for v in r["fleet_by_worker"].values())
        out.append([label, fmt_ms(r["p50_ms"]), fmt_ms(r["p99_ms"]), fmt_x(ratio(r["p99_ms"], peer_p99)),
                    fmt_x(ratio(r["p99_ms"], bare_p99)), fmt_ms(r["ttft_p99_ms"]), str(r["shed"]),
                    str(r["other_errors"]), per_worker, fmt_ms(r["send_lag_p99_ms"])])
    return head, out


def summary(raw: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["fleet", "workers alike?", "product P99 ms", "vLLM Router best (policy)", "product / best",
            "product / bare Envoy", "render alone / bare Envoy", "product 429", "target (product / best)"]
    out = []
    for key, data in raw.items():
        r = data["results"]
        peer = best(r, [k for k in r if k.startswith("vr_")])
        ref = r[peer]["p99_ms"] if peer else None
        out.append([key, "yes" if data["even"] else "no", fmt_ms(r["product"]["p99_ms"]),
                    f"{fmt_ms(ref)} ({r[peer]['label'].removeprefix('vLLM Router ')})" if peer else "-",
                    fmt_x(ratio(r["product"]["p99_ms"], ref)),
                    fmt_x(ratio(r["product"]["p99_ms"], r["bare"]["p99_ms"])),
                    fmt_x(ratio(r["render"]["p99_ms"], r["bare"]["p99_ms"])), str(r["product"]["shed"]),
                    "<= 1.0x" if data["even"] else "<= 0.8x"])
    return head, out


def targets(data: dict[str, Any]) -> list[Target]:
    rows = data["results"]
    key = data["plan"]
    peer = best(rows, [k for k in rows if k.startswith("vr_")])
    out = []
    prod = rows["product"]
    limit = 1.0 if data["even"] else 0.8
    if peer is not None:
        pr = ratio(prod["p99_ms"], rows[peer]["p99_ms"])
        out.append(Target(f"[{key}] product P99 vs vLLM Router's best ({rows[peer]['label']})", f"<= {limit:g}x",
                          f"{fmt_ms(prod['p99_ms'])} vs {fmt_ms(rows[peer]['p99_ms'])} ms", pr,
                          judged(pr, prod['p99_ms'], limit), limit))
    out.append(Target(f"[{key}] product: requests shed (429) at {data['load']:.0%} load", "0",
                      f"{prod['shed']} of {prod['requests']}", float(prod["shed"]),
                      prod["shed"] == 0 and not prod.get("failed"), 0.0))
    rr = ratio(rows["render"]["p99_ms"], rows["bare"]["p99_ms"])
    out.append(Target(f"[{key}] render alone P99 vs bare Envoy least_request", "<= 1.05x",
                      f"{fmt_ms(rows['render']['p99_ms'])} vs {fmt_ms(rows['bare']['p99_ms'])} ms", rr,
                      judged(rr, rows['render']['p99_ms'], 1.05), 1.05))
    return out


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    plans = [p for p in _fleets.MATRIX if not ctx.quick or p.key in _fleets.QUICK]
    warmup_s, window_s = ctx.scale(4, 3), ctx.scale(6, 3)
    groups: list[str] = []
    series: dict[str, list[float | None]] = {"product": [], "render alone": [], "bare Envoy": [],
                                             "vLLM Router best": []}
    for plan in plans:
        data = run_fleet(ctx, plan, warmup_s, window_s)
        res.raw[plan.key] = data
        head, rows = table(data)
        res.tables.append((f"**{plan.label}** ({plan.key}) - {plan.describe()}. {data['rate_rps']:.1f} req/s = "
                           f"{plan.load:.0%} of an estimated {data['capacity_rps']:.1f} req/s; {window_s:g} s measured "
                           f"after {warmup_s:g} s of warm-up ({data['requests']} requests in all); an even split "
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
    res.chart = {"groups": {"title": "Matrix: P99 relative to vLLM Router's best policy (lower is better)",
                            "groups": groups, "series": series}}
    res.summary = (
        "Every fleet gets the same seeded arrivals for every setup, a fresh simulated fleet each time, latency "
        "from each request's scheduled send time. The target for the product is <= 0.8x vLLM Router's best policy "
        "where workers differ (speed, batch size or a slowdown) and <= 1.0x where they are alike, with nothing shed; "
        "the render alone must stay within 1.05x of a bare Envoy least_request.")
    res.notes += [
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
    if ctx.quick:
        res.notes.append(f"Quick mode runs the fleet(s) {', '.join(_fleets.QUICK)} only, {window_s:g} s measured, "
                         "and vLLM Router's power_of_two only.")
    return res
