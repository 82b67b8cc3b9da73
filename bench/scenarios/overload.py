"""Overload: offered load past the fleet's capacity. The product should shed about the
excess (429 at once) and keep the admitted requests' latency bounded; routers that do not
shed queue the excess and their latency grows for as long as the overload lasts."""

from __future__ import annotations

from typing import Any

from .. import _workload as wl
from .._harness import Context, Result, Target, fmt_ms, fmt_x, judged, ratio
from ._fleets import FleetPlan
from ._runner import BARE, PRODUCT, Setup, best, measure_or_fail, vllm

NAME = "overload"
TITLE = "Overload (118 % of capacity): shed share, admitted P99, the peers' P99"

FLEET = FleetPlan("overload", "3 workers (1x, 1x, 0.5x) at 118 %", (1.0, 1.0, 0.5), (8, 8, 8), decode_ms=20,
                  load=1.18)


def setups(ctx: Context) -> list[Setup]:
    if ctx.quick:
        return [PRODUCT, vllm("power_of_two")]
    return [PRODUCT, BARE, vllm("power_of_two"), vllm("cache_aware")]


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    warmup_s, window_s = ctx.scale(4, 2), ctx.scale(14, 4)
    cap = FLEET.capacity_rps()
    rate = cap * FLEET.load
    count = int(rate * (warmup_s + window_s)) + 1
    requests = wl.build(FLEET.workload(rate, count, ctx.seed + 11))
    deadline = requests[-1]["t"] + 1.0
    excess = 1.0 - 1.0 / FLEET.load
    rows: dict[str, dict[str, Any]] = {}
    for s in setups(ctx):
        rows[s.key] = measure_or_fail(ctx, FLEET.spec(ctx.seed), list(FLEET.max_num_seqs), requests, s, f"ov-{s.key}",
                              warmup_s=warmup_s, deadline_s=deadline, timeout_s=90.0)
        r = rows[s.key]
        print(f"  [overload] {s.label}: admitted p99 {fmt_ms(r['p99_ms'])} ms, shed {r['shed']}/{r['requests']} "
              f"({r['wall_s']:.0f}s)", flush=True)
    peer = best(rows, [k for k in rows if k.startswith("vr_")])
    ref = rows[peer]["p99_ms"] if peer else None
    head = ["setup", "admitted P50 ms", "admitted P99 ms", "P99 / vLLM Router best", "shed (429)", "shed share",
            "other errors", "done/s"]
    table = []
    for key, r in rows.items():
        share = r["shed_share"]
        table.append([r["label"] + (" **(vLLM Router best)**" if key == peer else ""), fmt_ms(r["p50_ms"]),
                      fmt_ms(r["p99_ms"]), fmt_x(ratio(r["p99_ms"], ref)),
                      str(r["shed"]), "-" if share is None else f"{share:.1%}", str(r["other_errors"]),
                      f"{r['throughput_rps']:.1f}"])
    res.tables.append((f"{FLEET.describe()}; {rate:.1f} req/s = {FLEET.load:.0%} of an estimated {cap:.1f} req/s "
                       f"(the excess is {excess:.1%} of the offered requests); {window_s:g} s measured after "
                       f"{warmup_s:g} s", head, table))
    prod = rows["product"]
    share = prod["shed_share"] or 0.0
    limit = excess + 0.05
    res.targets.append(Target(f"[overload] product shed share vs the excess ({excess:.1%})", f"<= {limit:.1%}",
                              f"{prod['shed']} of {prod['requests']} = {share:.1%}", share,
                              share <= limit and not prod.get("failed"), limit))
    if peer is not None:
        pr = ratio(prod["p99_ms"], ref)
        res.targets.append(Target(f"[overload] product admitted P99 vs vLLM Router's best ({rows[peer]['label']})",
                                  "<= 0.6x", f"{fmt_ms(prod['p99_ms'])} vs {fmt_ms(ref)} ms", pr,
                                  judged(pr, prod['p99_ms'], 0.6), 0.6))
    res.raw = {"capacity_rps": cap, "rate_rps": rate, "excess": excess, "results": rows}
    res.chart = {"bars": [(r["label"], r["p50_ms"], r["p99_ms"]) for r in rows.values()]}
    res.summary = ("Admitted P99 is over the requests that were served (200); shed requests got a 429 and are "
                   "counted apart. The peers shed nothing here: their P99 grows with the length of the overload.")
    res.notes.append("vLLM Router round_robin is not run: an even split loads the 0.5x worker to "
                     f"{FLEET.round_robin_overload():.0%} of its capacity, far worse than the overload itself.")
    res.notes.append("The excess is 1 - 1/load: the share of offered requests the fleet cannot serve in the long run. "
                     "Capacity as in the matrix (bench/scenarios/_fleets.py). Setups as in the matrix.")
    return res
