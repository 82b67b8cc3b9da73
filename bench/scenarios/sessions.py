"""Multi-turn chat sessions on a fleet with prefix caches: session affinity + the sidecar
against vLLM Router's cache_aware (and its other policies), prefix-cache hit rate beside P99."""

from __future__ import annotations

from typing import Any

from .. import _workload as wl
from .._harness import Context, Result, Target, fmt_ms, fmt_x, judged, ratio
from ._fleets import FleetPlan
from ._runner import BARE, SESSION_BALANCING, Setup, best, measure_or_fail, vllm

NAME = "sessions"
TITLE = "Multi-turn chat sessions with prefix caching"

# 4 equal workers; each one's prefix cache holds 16 conversations (LRU), about a third of
# the conversations open at once, so where a turn lands decides whether its history is cached.
FLEET = FleetPlan("sessions", "4 equal workers with prefix caches", (1.0, 1.0, 1.0, 1.0), (8, 8, 8, 8),
                  decode_ms=20, prefix_cache_size=16)

RECOMMENDED = Setup("rec", "confgen render (ring_hash on x-session-id, load bound) + confgen-sidecar (recommended)",
                    "product", SESSION_BALANCING)
REC_RENDER = Setup("rec_render", "confgen render (ring_hash on x-session-id) alone", "render", SESSION_BALANCING)
PEERS = ("cache_aware", "consistent_hash", "power_of_two", "round_robin")


def setups(ctx: Context) -> list[Setup]:
    if ctx.quick:
        return [RECOMMENDED, vllm("cache_aware"), vllm("consistent_hash")]
    return [RECOMMENDED, REC_RENDER, BARE, *(vllm(p) for p in PEERS)]


def nominal_capacity(spec: wl.SessionSpec) -> float:
    """Requests/s with full batches and NO prefix-cache hit (every prompt prefilled whole)."""
    mean_out = sum(spec.output_range) / 2
    return sum(FLEET.worker_rps(mean_out, spec.mean_prompt_tokens()))


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    warmup_s, window_s = ctx.scale(4, 3), ctx.scale(11, 4)
    probe = wl.SessionSpec(rate=1.0, duration_s=1.0, seed=ctx.seed)
    cap = nominal_capacity(probe)
    load = 0.78
    spec = wl.SessionSpec(rate=cap * load, duration_s=warmup_s + window_s, seed=ctx.seed)
    requests = wl.build_sessions(spec)
    deadline = requests[-1]["t"] + 1.0
    rows: dict[str, dict[str, Any]] = {}
    for s in setups(ctx):
        rows[s.key] = measure_or_fail(ctx, FLEET.spec(ctx.seed), list(FLEET.max_num_seqs), requests, s, f"ss-{s.key}",
                              warmup_s=warmup_s, deadline_s=deadline)
        r = rows[s.key]
        print(f"  [sessions] {s.label}: p99 {fmt_ms(r['p99_ms'])} ms, hit {_pct(r['prefix_hit_rate'])}, "
              f"429 {r['shed']} ({r['wall_s']:.0f}s)", flush=True)
    peer = best(rows, [k for k in rows if k.startswith("vr_")])
    ref = rows[peer]["p99_ms"] if peer else None
    head = ["setup", "P50 ms", "P99 ms", "P99 / vLLM Router best", "TTFT P99 ms", "prefix-cache hit", "429",
            "other errors", "requests per worker"]
    table = []
    for key, r in rows.items():
        table.append([r["label"] + (" **(vLLM Router best)**" if key == peer else ""), fmt_ms(r["p50_ms"]),
                      fmt_ms(r["p99_ms"]), fmt_x(ratio(r["p99_ms"], ref)), fmt_ms(r["ttft_p99_ms"]),
                      _pct(r["prefix_hit_rate"]), str(r["shed"]), str(r["other_errors"]),
                      "/".join(str(v) for v in r["fleet_by_worker"].values())])
    convs = len({r["session"] for r in requests})
    res.tables.append((f"{FLEET.describe_workers()}; prefix cache 16 conversations per worker. "
                       f"{len(requests)} turns of {convs} conversations, {spec.rate:.1f} turns/s = {load:.0%} of a "
                       f"nominal {cap:.1f} req/s (no cache hits); {window_s:g} s measured after {warmup_s:g} s",
                       head, table))
    rec = rows["rec"]
    if peer is not None:
        pr = ratio(rec["p99_ms"], ref)
        res.targets.append(Target(f"[sessions] recommended setup P99 vs vLLM Router's best ({rows[peer]['label']}); "
                                  f"prefix-cache hits {_pct(rec['prefix_hit_rate'])} vs "
                                  f"{_pct(rows[peer]['prefix_hit_rate'])}", "<= 0.8x",
                                  f"{fmt_ms(rec['p99_ms'])} vs {fmt_ms(ref)} ms", pr,
                                  judged(pr, rec['p99_ms'], 0.8), 0.8))
    res.targets.append(Target("[sessions] recommended setup: requests shed (429)", "0",
                              f"{rec['shed']} of {rec['requests']}", float(rec["shed"]),
                              rec["shed"] == 0 and not rec.get("failed"), 0.0))
    res.raw = {"capacity_nominal_rps": cap, "rate_rps": spec.rate, "workload": wl.describe(spec),
               "conversations": convs, "results": rows}
    res.chart = {"bars": [(r["label"], r["p50_ms"], r["p99_ms"]) for r in rows.values()]}
    res.summary = ("Conversations grow turn by turn (each turn's prompt is the whole conversation so far) and carry "
                   "an `x-session-id` header; the simulated engines keep a prefix cache per worker, so a turn that "
                   "lands where its conversation was served before skips most of its prefill.")
    res.notes += [
        f"Workload (bench/_workload.py SessionSpec): {spec.turns[0]}-{spec.turns[1]} turns per conversation, "
        f"think time exponential with mean {spec.think_s:g} s (at least {spec.min_gap_s:g} s), system prompt "
        f"{spec.system_tokens[0]}-{spec.system_tokens[1]} tokens, user turns {spec.user_tokens[0]}-"
        f"{spec.user_tokens[1]}, answers {spec.output_range[0]}-{spec.output_range[1]}; a turn is sent no earlier "
        "than the end of the previous one and measured from its scheduled time.",
        "Prefix cache (confgen/simulate, unchanged): per worker an LRU of 16 entries keyed on x-session-id, each "
        "holding the tokens of the conversation's longest prompt+answer served there; a turn's cached tokens are "
        "min(held, prompt - 1) and are not prefilled again. The hit rate is cached / prompt tokens over the "
        "measured window.",
        "Recommended setup = the topology of examples/03-session-affinity.yaml for this fleet: balancing "
        f"`{SESSION_BALANCING}` (hash_balance_factor left at its default, the load bound), rendered by the CLI, "
        "plus confgen-sidecar with default flags.",
        "vLLM Router's consistent_hash hashes the x-session-id header (checked: every turn of a conversation lands "
        "on one worker); cache_aware matches prompt prefixes.",
    ]
    return res


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"
