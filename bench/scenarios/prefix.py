"""Prefix-cache affinity: conversations from plain OpenAI clients (no header), the same with
`x-session-id`, agent-style long shared contexts, conversations mixed with one-shot
requests, and the plain conversations from clients that send a generous max_tokens (`bound`:
4,096 for answers of 16-48 tokens, which stop on their own), on 4 equal workers whose engines
keep a vLLM-like block prefix cache.

Every workload runs on several seeds (a fresh fleet, fresh caches and fresh arrivals per
seed, identical across setups); every figure is given pooled over the seeds' measured
requests with its spread across the seeds (min / median / max), and every ratio as the
median over the seeds of the per-seed ratio, with its min and max.

The product rows are parameters: PRODUCT is the product as shipped (the topology's
defaults), and each policy of PRODUCT_POLICIES that confgen knows (confgen.balancing) adds a
row "confgen render (balancing: {policy: P}) + confgen-sidecar", e.g. the endpoint picker's
`prefix_affinity`. A policy confgen does not know yet is left out, and the report says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confgen.simulate import BLOCK_TOKENS, block_hashes

from .. import _stats
from .. import _workload as wl
from .._harness import Context, Result, Target, fmt_ms, fmt_ms3, fmt_pct3, fmt_x3, ratio
from ._fleets import FleetPlan
from ._runner import (
    BARE,
    PRODUCT,
    RENDER,
    SESSION_BALANCING,
    Setup,
    default_policy,
    measure_or_fail,
    policy_setups,
    vllm,
)

NAME = "prefix"
TITLE = "Prefix-cache affinity: conversations (plain clients and x-session-id), agents, a mix"

# 4 equal workers, batch 8, prefill 60 ms per 1k uncached tokens: a 2,700-token prompt costs
# 160 ms of prefill (every running request waits it out), about twice its share of decode,
# so a cached prefix matters. KV 40,960 tokens per worker = 2,560 blocks of prefix cache (what
# the engine reports in vllm:cache_config_info): one worker holds about a third of the distinct
# prompt blocks a run sends (3.1-3.6x its cache, measured per workload in the report's
# captions), the four together about all of them (0.8-0.9x).
KV_TOKENS = 40_960
FLEET = FleetPlan("prefix", "4 equal workers with block prefix caches", (1.0, 1.0, 1.0, 1.0), (8, 8, 8, 8),
                  decode_ms=20, prefix_cache_mode="blocks", kv_cache_tokens=KV_TOKENS)
LOAD = 0.8
HIT_REF = 0.5  # the load is LOAD x what the fleet serves when this share of prompt tokens is cached
LOOSE_MAX_TOKENS = 4096  # the bound the `bound` workload's clients send (answers of 16-48 tokens)

RECOMMENDED = Setup("rec", "confgen render (ring_hash on x-session-id, load bound) + confgen-sidecar (recommended)",
                    "product", SESSION_BALANCING)
LIMIT = 0.75  # issue 17: product <= 0.75x vLLM Router's best, P99 and TTFT P99
HIT_TARGET = 0.80


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    build: Callable[[float, float, int], list[dict[str, Any]]]  # (rate, duration_s, seed) -> requests
    peers: tuple[str, ...]  # vLLM Router policies (every seed)
    extra: tuple[Setup, ...] = ()  # beside the product rows and the peers, every seed
    context: tuple[Setup, ...] = ()  # shown for context, the first seed only (full mode)
    seeds: int = 1  # full mode; --set prefix_seeds=N sets every workload's
    headline: bool = False  # the targets are judged on it
    header: bool = False


def _conversations(header: bool) -> Callable[[float, float, int], list[dict[str, Any]]]:
    return lambda rate, duration, seed: wl.build_chat(wl.ChatSpec(rate=rate, duration_s=duration, seed=seed,
                                                                   session_header=header))


def _bounded(rate: float, duration: float, seed: int) -> list[dict[str, Any]]:
    return wl.loosely_bounded(_conversations(False)(rate, duration, seed), LOOSE_MAX_TOKENS)


def _agents(rate: float, duration: float, seed: int) -> list[dict[str, Any]]:
    return wl.build_agents(wl.AgentSpec(rate=rate, duration_s=duration, seed=seed))


def _mix(rate: float, duration: float, seed: int) -> list[dict[str, Any]]:
    return wl.build_chat(wl.ChatSpec(rate=rate, duration_s=duration, seed=seed, one_shot_share=0.5))


# The budget (README): 3 seeds where issue 17 sets targets, 1 where the figures are context.
WORKLOADS = (
    Workload("plain", "conversations from plain OpenAI clients (no session header)", _conversations(False),
             ("cache_aware", "power_of_two"), context=(RENDER, BARE), seeds=3, headline=True),
    Workload("header", "the same conversations with x-session-id", _conversations(True),
             ("cache_aware", "consistent_hash"), context=(RECOMMENDED,), seeds=3, headline=True, header=True),
    Workload("agents", "agents: long shared system + tool contexts, distinct tasks", _agents,
             ("cache_aware", "power_of_two")),
    Workload("mix", "conversations (plain clients) mixed 1:1 with one-shot requests", _mix, ("cache_aware",)),
    Workload("bound", "the plain conversations from clients that send max_tokens 4096 (answers stop short of it)",
             _bounded, ("cache_aware",)),
)
QUICK = ("plain",)
QUICK_PEERS = ("cache_aware",)  # quick is a harness check within make bench-quick's 4 minutes


# --set prefix_two=1: the product with two Envoys (--ingresses 2, requests alternate), so a
# conversation's turns go through two pickers (issue 28: two pickers' hit rate within 3 points of one),
# each the other's --picker-peer as the README says; prefix_two=2 adds the same without peers
TWO = Setup("product2", "confgen render + confgen-sidecar, two Envoys (--ingresses 2, each picker the other's "
            "--picker-peer; requests alternate)", "product", diagnostic=True)
TWO_ALONE = Setup("product2alone", "confgen render + confgen-sidecar, two Envoys (--ingresses 2, no --picker-peer; "
                  "requests alternate)", "product", diagnostic=True, alone=True)


# --set prefix_weighted=1: the endpoint picker on its earlier rule (`--picker rule=weighted`: the weighted
# sum of prefix, load, KV and cost scores that `prefix_affinity` ran before the predicted finish time),
# the row issue 28's mixed workload compares with
WEIGHTED = Setup("product_weighted", "confgen render + confgen-sidecar --picker rule=weighted (the earlier "
                 "prefix_affinity)", "product", diagnostic=True, sidecar_args=("--picker", "rule=weighted"))


def setups(ctx: Context, w: Workload, first_seed: bool = True) -> list[Setup]:
    own, _ = policy_setups()
    two = [TWO, TWO_ALONE][:int(ctx.option("prefix_two", 0))]
    two += [WEIGHTED] if ctx.option("prefix_weighted", 0) else []
    if ctx.quick:  # the harness check: the product as shipped and one peer
        return [PRODUCT, *two, *(vllm(p) for p in QUICK_PEERS)]
    # --set prefix_peers=0: the product rows alone (a diagnostic run)
    peers = [vllm(p) for p in w.peers] if ctx.option("prefix_peers", 1) else []
    return [PRODUCT, *two, *own, *w.extra, *(w.context if first_seed else ()), *peers]


def prompt_tokens(r: dict[str, Any]) -> int:
    return wl.chat_prompt_tokens(r["body"]["messages"])


def capacity_rps(requests: list[dict[str, Any]], hit: float) -> float:
    """Requests/s the fleet completes with full batches when `hit` of the prompt tokens are cached."""
    mean_prompt = statistics.fmean(prompt_tokens(r) for r in requests)
    mean_out = statistics.fmean(r["out"] for r in requests)
    return sum(FLEET.worker_rps(mean_out, mean_prompt * (1.0 - hit)))


def rate_for(w: Workload, seed: int) -> tuple[float, float]:
    """(offered rate, capacity at HIT_REF) for a workload: its mean prompt and output from a long
    probe of the same generator, so the rate does not depend on the window's luck."""
    probe = w.build(10.0, 60.0, seed + 1000)
    cap = capacity_rps(probe, HIT_REF)
    return LOAD * cap, cap


def ideal_hit(requests: list[dict[str, Any]], warmup_s: float = 0.0) -> float:
    """Share of the prompt tokens of the requests scheduled from `warmup_s` on that are in blocks
    some earlier request already sent (what one infinite cache in front of all the traffic
    would hit): the ceiling of any router's measured hit rate."""
    seen: set[str] = set()
    hit = total = 0
    for r in sorted(requests, key=lambda x: x["t"]):
        blocks = block_hashes(wl.engine_text(r), r["body"]["model"])
        n = 0
        for b in blocks:
            if b not in seen:
                break
            n += 1
        if r["t"] >= warmup_s:
            hit += min(n * BLOCK_TOKENS, prompt_tokens(r) - 1)
            total += prompt_tokens(r)
        seen.update(blocks)
    return hit / total if total else 0.0


def working_set_blocks(requests: list[dict[str, Any]]) -> int:
    """Distinct prompt blocks the requests carry (the cache the whole run would need)."""
    out: set[str] = set()
    for r in requests:
        out.update(block_hashes(wl.engine_text(r), r["body"]["model"]))
    return len(out)


def run_workload(ctx: Context, w: Workload, seeds: list[int], warmup_s: float, window_s: float) -> dict[str, Any]:
    rate, cap = rate_for(w, seeds[0])
    per_seed: dict[str, list[dict[str, Any]]] = {}
    info: list[dict[str, Any]] = []
    for seed in seeds:
        requests = w.build(rate, warmup_s + window_s, seed)
        deadline = requests[-1]["t"] + 1.0
        measured = [r for r in requests if r["t"] >= warmup_s]
        info.append({"seed": seed, "requests": len(requests), "measured": len(measured),
                     "conversations": len({r["session"] for r in requests if r["kind"] == "turn"}),
                     "ideal_hit": ideal_hit(requests, warmup_s), "working_set_blocks": working_set_blocks(requests),
                     "header_sent": sum(1 for r in requests if "x-session-id" in r["headers"])})
        for s in setups(ctx, w, seed == seeds[0]):
            row = measure_or_fail(ctx, FLEET.spec(seed), list(FLEET.max_num_seqs), requests, s,
                                  f"px-{w.key}-{s.key}-{seed}", warmup_s=warmup_s, deadline_s=deadline,
                                  path=wl.CHAT_PATH, ingresses=2 if s.key in (TWO.key, TWO_ALONE.key) else 1)
            row["seed"] = seed
            per_seed.setdefault(s.key, []).append(row)
            print(f"  [{w.key} seed {seed}] {s.label}: p99 {fmt_ms(row['p99_ms'])} ttft p99 "
                  f"{fmt_ms(row['ttft_p99_ms'])} ms, hit {_pct(row['prefix_hit_rate'])}, 429 {row['shed']}, "
                  f"ok {row['ok']}/{row['requests']}, picker late {row.get('picker_late', '-')} "
                  f"({row['wall_s']:.0f}s)", flush=True)
    pooled = {k: {**_stats.pooled(rows), "label": rows[0]["label"].split(" (FAILED")[0],
                  "fleet_by_worker": _sum_workers(rows)} for k, rows in per_seed.items()}
    return {"workload": w.key, "label": w.label, "rate_rps": rate, "capacity_rps": cap, "seeds": seeds,
            "warmup_s": warmup_s, "window_s": window_s, "seed_info": info, "pooled": pooled,
            "per_seed": {k: [_lean_row(r) for r in rows] for k, rows in per_seed.items()}}


def _lean_row(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("seed", "p50_ms", "p90_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms", "ntpot_p50_ms", "ntpot_p99_ms",
            "prefix_hit_rate", "shed", "other_errors", "requests", "ok", "fleet_by_worker", "failed", "wall_s")
    return {k: r.get(k) for k in keep}


def _sum_workers(rows: list[dict[str, Any]]) -> list[int]:
    out: list[int] = []
    for r in rows:
        for i, v in enumerate((r.get("fleet_by_worker") or {}).values()):
            if i == len(out):
                out.append(0)
            out[i] += int(v)
    return out


def best_peer(data: dict[str, Any], key: str = "p99_ms") -> str | None:
    """The vLLM Router policy with the lowest pooled `key` (a row without it never wins)."""
    rows = data["pooled"]
    have = [k for k in rows if k.startswith("vr_") and rows[k].get(key) is not None]
    return min(have, key=lambda k: rows[k][key]) if have else None


def seed_ratios(data: dict[str, Any], ours: str, ref: str | None, key: str) -> tuple[float, float, float] | None:
    """(min, median, max) over the seeds of ours[key] / ref[key], seed by seed."""
    return _stats.seed_ratios(data["per_seed"], ours, ref, key)



def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"



def table(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    peer, peer_ttft = best_peer(data), best_peer(data, "ttft_p99_ms")
    head = ["setup", "seeds", "P50 ms", "P99 ms (pooled)", "P99 per seed: median [min-max]",
            "P99 / vLLM Router best: median of seeds [min-max]", "TTFT P50 ms", "TTFT P99 ms",
            "TTFT P99 / vLLM Router best TTFT", "NTPOT P50 ms/token", "NTPOT P99 ms/token",
            "prefix-cache hit: mean [min-max]", "429", "other errors", "measured requests", "requests per worker"]
    out = []
    for key, r in data["pooled"].items():
        mark = " **(vLLM Router best P99)**" if key == peer else ""
        mark += " **(best TTFT P99)**" if key == peer_ttft and key.startswith("vr_") else ""
        out.append([r["label"] + mark, str(r["seeds"]), fmt_ms(r["p50_ms"]), fmt_ms(r["p99_ms"]),
                    fmt_ms3(r["spread"]["p99_ms"]),
                    fmt_x3(seed_ratios(data, key, peer, "p99_ms")), fmt_ms(r["ttft_p50_ms"]), fmt_ms(r["ttft_p99_ms"]),
                    fmt_x3(seed_ratios(data, key, peer_ttft, "ttft_p99_ms")), fmt_ms(r["ntpot_p50_ms"]),
                    fmt_ms(r["ntpot_p99_ms"]), fmt_pct3(r["spread"]["prefix_hit_rate"]), str(r["shed"]),
                    str(r["other_errors"]), str(r["requests"]), "/".join(str(v) for v in r["fleet_by_worker"])])
    return head, out


def summary(raw: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per workload and product setup: its figures against vLLM Router's best."""
    head = ["workload", "setup", "seeds", "P99 ms (pooled)", "P99 / vLLM Router best: median of seeds [min-max]",
            "TTFT P99 ms", "TTFT P99 / best TTFT", "NTPOT P99 ms/token", "prefix-cache hit [min-max]",
            "hit ceiling", "429", "vLLM Router best (P99 ms, hit)"]
    out = []
    for key, data in raw.items():
        rows = data["pooled"]
        peer, peer_ttft = best_peer(data), best_peer(data, "ttft_p99_ms")
        ceiling = statistics.fmean(i["ideal_hit"] for i in data["seed_info"])
        ref = "-" if peer is None else (f"{rows[peer]['label'].removeprefix('vLLM Router ')} "
                                        f"({fmt_ms(rows[peer]['p99_ms'])}, {_pct(rows[peer]['prefix_hit_rate'])})")
        for k, r in rows.items():
            if not rows_kind(k):
                continue
            out.append([key, _short(r["label"]), str(r["seeds"]), fmt_ms(r["p99_ms"]),
                        fmt_x3(seed_ratios(data, k, peer, "p99_ms")), fmt_ms(r["ttft_p99_ms"]),
                        fmt_x3(seed_ratios(data, k, peer_ttft, "ttft_p99_ms")), fmt_ms(r["ntpot_p99_ms"]),
                        fmt_pct3(r["spread"]["prefix_hit_rate"]), _pct(ceiling), str(r["shed"]), ref])
    return head, out


def targets(data: dict[str, Any], w: Workload) -> list[Target]:
    """Issue 17's targets, for each product row of the workload (the product as shipped, the
    recommended session setup where a header is sent, and each PRODUCT_POLICIES row)."""
    if not w.headline:
        return []
    out: list[Target] = []
    peer, peer_ttft = best_peer(data), best_peer(data, "ttft_p99_ms")
    rows = data["pooled"]
    ours = [k for k in rows if rows_kind(k)]
    for key in ours:
        r = rows[key]
        name = f"[{w.key}] {_short(r['label'])}"
        for fig, ref, what in (("p99_ms", peer, "P99"), ("ttft_p99_ms", peer_ttft, "TTFT P99")):
            s = seed_ratios(data, key, ref, fig)
            if ref is None:
                continue
            met = None if s is None else s[1] <= LIMIT
            out.append(Target(f"{name}: {what} vs vLLM Router's best ({rows[ref]['label']}), median of "
                              f"{r['seeds']} seed(s)", f"<= {LIMIT:g}x",
                              f"{fmt_ms(r[fig])} vs {fmt_ms(rows[ref][fig])} ms pooled; per seed {fmt_x3(s)}",
                              None if s is None else s[1], False if r[fig] is None else met, LIMIT))
        if not w.header:
            hit = r["prefix_hit_rate"]
            out.append(Target(f"{name}: prefix-cache hit rate", f">= {HIT_TARGET:.0%}",
                              f"{fmt_pct3(r['spread']['prefix_hit_rate'])} (mean [min-max] of the seeds)",
                              hit, hit is not None and hit >= HIT_TARGET, None))
        out.append(Target(f"{name}: requests shed (429)", "0", f"{r['shed']} of {r['requests']}", float(r["shed"]),
                          r["shed"] == 0 and r["seeds_ok"] == r["seeds"], 0.0))
    return out


def rows_kind(key: str) -> bool:
    """Is this row one of ours (a product setup: as shipped, recommended, or a policy row)?"""
    return key in ("product", "rec") or key.startswith("pol_")


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    warmup_s = ctx.option("prefix_warmup_s", ctx.scale(4, 2))
    window_s = ctx.option("prefix_window_s", ctx.scale(5, 3))
    own, unknown = policy_setups()
    chosen = [w for w in WORKLOADS if not ctx.quick or w.key in QUICK]
    # --set prefix_workloads=N: the first N workloads only (plain conversations first);
    # --set prefix_skip=K: from the K+1th on (prefix_skip=3 prefix_workloads=1: the mix alone)
    chosen = chosen[int(ctx.option("prefix_skip", 0)):]
    chosen = chosen[: int(ctx.option("prefix_workloads", len(chosen)))]
    groups: list[str] = []
    series: dict[str, list[float | None]] = {}
    for w in chosen:
        n_seeds = int(ctx.option("prefix_seeds", ctx.scale(w.seeds, 1)))
        seeds = [ctx.seed + 100 * k for k in range(max(1, n_seeds))]
        data = run_workload(ctx, w, seeds, warmup_s, window_s)
        res.raw[w.key] = data
        head, rows = table(data)
        info = data["seed_info"]
        hit_ceiling = statistics.fmean(i["ideal_hit"] for i in info)
        ws = statistics.fmean(i["working_set_blocks"] for i in info)
        per_worker_blocks = KV_TOKENS // BLOCK_TOKENS
        res.tables.append((
            f"**{w.label}** ({w.key}) - {FLEET.describe_workers()}; block prefix cache of "
            f"{per_worker_blocks} blocks per worker. {data['rate_rps']:.1f} req/s = {LOAD:.0%} of an estimated "
            f"{data['capacity_rps']:.1f} req/s with {HIT_REF:.0%} of prompt tokens cached; seeds "
            f"{', '.join(map(str, seeds))}, each {window_s:g} s measured after {warmup_s:g} s "
            f"({statistics.fmean(i['measured'] for i in info):.0f} measured requests per seed on average); "
            f"distinct prompt blocks per seed {ws:.0f} = {ws / per_worker_blocks:.1f}x one worker's cache, "
            f"{ws / (per_worker_blocks * len(FLEET.speeds)):.1f}x the fleet's; a single infinite cache would hit "
            f"{hit_ceiling:.0%} of prompt tokens; x-session-id sent on "
            f"{sum(i['header_sent'] for i in info)} of {sum(i['requests'] for i in info)} requests", head, rows))
        res.targets += targets(data, w)
        groups.append(w.key)
        peer = best_peer(data)
        ref = data["pooled"][peer]["p99_ms"] if peer else None
        shown = {k: _short(r["label"]) for k, r in data["pooled"].items() if not k.startswith("vr_")}
        if peer:
            shown[peer] = "vLLM Router best"
        for key, name in shown.items():
            values = series.setdefault(name, [None] * (len(groups) - 1))
            values.append(ratio(data["pooled"][key]["p99_ms"], ref))
        for values in series.values():
            values.extend([None] * (len(groups) - len(values)))
    head, rows = summary(res.raw)
    res.tables.insert(0, ("Summary: the product rows on every workload against vLLM Router's best policy (details "
                          "per workload below; hit ceiling = what one infinite cache in front of all traffic hits)",
                          head, rows))
    res.chart = {"groups": {"title": "Prefix workloads: pooled P99 relative to vLLM Router's best (lower is better)",
                            "groups": groups, "series": series}}
    res.summary = (
        "The engines keep a vLLM-like prefix cache (confgen/simulate, prefix_cache_mode blocks): prompt blocks of "
        f"{BLOCK_TOKENS} tokens keyed by chained hashes of the text, an LRU of kv_cache_tokens / {BLOCK_TOKENS} blocks "
        "per worker, request headers ignored; a request's cached leading blocks are not prefilled again. So a "
        "router that sends a conversation's next turn, or an agent's next task, where its prefix already is saves "
        "most of the prefill, and the routers differ by how they trade that against balance.")
    res.notes += [
        "Figures are pooled over the seeds' measured requests (P50/P99 of all of them together); the spread is "
        "min-max across the seeds of the per-seed figure; a ratio is the median over the seeds of the per-seed "
        "ratio to the vLLM Router policy with the lowest pooled P99 (for TTFT, the one with the lowest pooled "
        "TTFT P99), with its min-max. Each seed is a fresh fleet (empty caches) and its own arrivals, identical "
        "for every setup.",
        "TTFT = first streamed `data:` line, NTPOT = end-to-end latency / output tokens (the simulator generates "
        "exactly max_tokens), both measured from the request's scheduled time like the end-to-end latency; a turn "
        "waits for the previous turn's answer and that wait is charged to the setup.",
        "Workloads (bench/_workload.py): conversations (ChatSpec) of 8-16 turns, system prompt 1,000-3,000 tokens, "
        "user turns 40-240, answers 16-48, think time 2 s mean (>= 1 s), bodies are chat `messages` resending the "
        "whole conversation; `header` = the very same requests plus x-session-id; agents (AgentSpec): contexts "
        "of 1,500-4,000 tokens (48 contexts, Zipf popularity 0.8), each request its own 40-400-token task, answers "
        "16-64; mix: half the requests are conversation turns, half one-shot single-message prompts of "
        "200-2,000 tokens with no shared prefix.",
        f"Load: {LOAD:.0%} of the fleet's capacity when {HIT_REF:.0%} of the prompt tokens are cached (capacity model "
        "of bench/scenarios/_fleets.py with the prefill of the uncached half): a router that caches less runs "
        "hotter, one that caches more cooler.",
        "Product as shipped = `confgen render` of the topology a user writes (defaults) + confgen-sidecar with "
        "default flags. The recommended session setup = ring_hash on x-session-id with its load bound "
        "(examples/03-session-affinity.yaml) + the sidecar. vLLM Router: each policy listed, same flags as the "
        "matrix; its consistent_hash hashes the x-session-id header when one is sent.",
    ]
    res.notes.append(f"The product as shipped balances this pool with `{default_policy()}` (confgen's default for "
                     "the bench's user topology).")
    if own:
        res.notes.append("Policy rows: " + ", ".join(s.label for s in own) + " (the topology's `balancing`, "
                         "everything else as shipped).")
    if unknown:
        res.notes.append(f"Not run: the product with balancing policy {', '.join(unknown)} (not in confgen's "
                         "balancing table at this commit); the rows appear once it is.")
    res.notes.append("Seeds: " + "; ".join(f"{k} {len(d['seeds'])}" for k, d in res.raw.items()) + ". Rows for "
                     "context (the render alone and a bare Envoy on plain clients, the recommended ring_hash "
                     "session setup where a header is sent) run on the first seed only in the full run, to keep "
                     "`make bench` within its budget; `--set prefix_seeds=N` runs every workload on N seeds.")
    if ctx.quick:
        res.notes.append(f"Quick mode: the {', '.join(QUICK)} workload only, 1 seed, {window_s:g} s measured, "
                         f"vLLM Router {' and '.join(QUICK_PEERS)} only: it shows the harness works, not the targets.")
    return res


def _short(label: str) -> str:
    label = label.replace("confgen render (balancing: {policy: ", "policy ")
    label = label.replace("}) + confgen-sidecar", " + sidecar")
    for long, short in (("confgen render + confgen-sidecar (as shipped)", "product (as shipped)"),
                        ("confgen render (ring_hash on x-session-id, load bound) + confgen-sidecar (recommended)",
                         "ring_hash session (recommended)"), (" + confgen-sidecar", ""), ("confgen render ", "")):
        label = label.replace(long, short)
    return label
