"""What a global rate limit check costs, and a 10 s Redis outage, measured on real processes.

    python -m bench.ratelimit_bench [--rate 500] [--requests 3000] [--rounds 2] [--outage 10]

Latency: one Envoy + its sidecar as shipped (rendered config unmodified, sidecar default
flags, the store's default timeouts), a real redis-server, a simulated fleet answering one
token at once. The open-loop load generator (bench.loadgen, its own process) sends
`--requests` requests at `--rate` per second, alternating client `free` (no global limit) and
client `big` (a global budget it never reaches: every request pays the check and is
admitted); the difference of the two halves' end-to-end percentiles is the check's cost.
Also reported: Envoy's own counts of checks that errored or timed out (failure_mode_allowed:
admitted uncounted) and the sidecar's CPU seconds per round.

Flood (`--flood 500,1000`): 3 Envoys + 3 sidecars as shipped (default flags and timeouts) on one
Redis and one fleet; one key with a budget of 60 requests an hour sends `--flood-requests` requests
at each rate over the three Envoys in turn, `--flood-runs` times (a fresh Redis each run). Admitted
must stay within the budget + the documented fail-open bounds (each sidecar's local floor, the
budget / limits.store.envoys, per window, while Redis is slow or away; each Envoy's ceiling, twice
the budget, while the sidecar's checks time out); reported beside it: Redis's own count, the sidecars'
floor decisions for that key (confgen_sidecar_ratelimit_fail_open_total), the Envoys' checks that
failed open (failure_mode_allowed: no sidecar answer in time, not bounded), the achieved rate and
the answers' P50/P99. `--flood-busy 2` runs two busy loops beside each flood (the loaded machine
of docs/limits.md's flood table).

Outage: tests.sidecar_live's 3-Envoy rig, a key at 5 requests/s under 20 requests/s, Redis
killed for `--outage` seconds and started again (empty).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import loadgen
from bench._procstat import cpu_s
from bench._stats import pct, summarize
from confgen import limits, parse_topology
from tests.sidecar_live.glimits import KEYS, global_rig


def _job(rate: float, count: int) -> dict[str, Any]:
    """Requests alternate between client `free` (even) and `big` (odd): both halves meet the same
    machine at the same moments, so a loaded machine's swings hit them alike."""
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}

    def headers(client: str) -> dict[str, str]:
        return {"authorization": f"Bearer {KEYS[client]}", "content-type": "application/json"}

    return {"targets": None, "path": "/v1/completions", "deadline_s": count / rate + 5, "timeout_s": 10,
            "max_in_flight": 500, "requests": [{"i": i, "t": i / rate, "body": body,
                                                "headers": headers("free" if i % 2 == 0 else "big")}
                                               for i in range(count)]}


def latency(rate: float, count: int, rounds: int, workdir: Path) -> dict[str, Any]:
    out: dict[str, list[dict[str, Any]]] = {"free": [], "big": []}
    cpu: list[float] = []
    with global_rig(workdir / "rig", envoys=1, check_timeout=None, store_timeout=None, sidecar_args=(),
                    decode_ms=0.5) as rig:
        url = f"http://127.0.0.1:{rig.pairs[0].port}"
        sidecar = rig.pairs[0].sidecar
        assert sidecar is not None and sidecar.proc is not None
        before = rig.pairs[0].envoy.stats()
        for r in range(rounds):
            proc, path = loadgen.start(_job(rate, count), workdir, f"round-{r}")
            started = cpu_s(sidecar.proc.pid)
            loadgen.go(proc, [url])
            records = loadgen.collect(proc, path, count / rate + 60)
            cpu.append(cpu_s(sidecar.proc.pid) - started)
            for parity, client in ((0, "free"), (1, "big")):
                summary = summarize([rec for rec in records if rec["i"] % 2 == parity], warmup_s=1.0)
                out[client].append(summary)
                print(f"round {r} {client}: ok {summary['ok']}/{summary['requests']} p50 {summary['p50_ms']:.2f} ms "
                      f"p99 {summary['p99_ms']:.2f} ms, other errors {summary['other_errors']}", flush=True)
            print(f"round {r}: sidecar cpu {cpu[-1]:.1f} s for {count // 2} checks", flush=True)
        after = rig.pairs[0].envoy.stats()
        counters = {k: int(v) - int(before.get(k, 0)) for k, v in after.items() if "ratelimit.confgen_global" in k}
    result: dict[str, Any] = {"rate": rate, "requests": count, "rounds": out, "envoy_ratelimit_stats": counters,
                              "sidecar_cpu_s_per_round": cpu}
    for q in ("p50_ms", "p99_ms"):
        free = [s[q] for s in out["free"]]
        big = [s[q] for s in out["big"]]
        result[f"added_{q}"] = [b - f for b, f in zip(big, free, strict=True)]
    return result


FLOOD_KEY = "reqh"  # 60 requests an hour (tests.sidecar_live.glimits.CLIENTS)
FLOOD_BUDGET_ID = f"client/{FLOOD_KEY}/0"


@contextlib.contextmanager
def _busy(loops: int, limit_s: float) -> Iterator[None]:
    """`loops` busy-loop processes beside the run (a loaded machine), each bounded to `limit_s`,
    stopped by their pid."""
    procs = [subprocess.Popen([sys.executable, "-c",
                               f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end: pass"])
             for _ in range(loops)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def flood(rate: float, count: int, run: int, workdir: Path, busy: int = 0) -> dict[str, Any]:
    """One flood of `count` requests at `rate` on the 60/hour key over 3 Envoys as shipped
    (`busy` busy loops beside it: a loaded machine)."""
    from tests.sidecar_live.glimits import sidecar_metric, wait_for_window

    wait_for_window(count / rate + 30, window=3600, timeout=120)  # one hour window for the whole run
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}
    headers = {"authorization": f"Bearer {KEYS[FLOOD_KEY]}", "content-type": "application/json"}
    job = {"targets": None, "path": "/v1/completions", "deadline_s": count / rate + 5, "timeout_s": 10,
           "max_in_flight": 1000, "requests": [{"i": i, "t": i / rate, "body": body, "headers": headers}
                                               for i in range(count)]}
    name = f"flood-{int(rate)}-{run}"
    with global_rig(workdir / name, envoys=3, check_timeout=None, store_timeout=None, sidecar_args=(),
                    decode_ms=0.5) as rig:
        urls = [f"http://127.0.0.1:{pair.port}" for pair in rig.pairs]
        before = [pair.envoy.stats() for pair in rig.pairs]
        proc, path = loadgen.start(job, workdir, name)
        with _busy(busy, count / rate + 70):
            loadgen.go(proc, urls)
            records = loadgen.collect(proc, path, count / rate + 60)
        after = [pair.envoy.stats() for pair in rig.pairs]
        floor = sidecar_metric(rig, "confgen_sidecar_ratelimit_fail_open_total", f'client="{FLOOD_KEY}"')
        counted = rig.counted(FLOOD_BUDGET_ID)
        topo, _ = parse_topology(rig.pairs[0].topology.read_bytes())

    def delta(suffix: str) -> int:
        """An Envoy counter's growth over the run, summed over the Envoys (every stat ending in `suffix`)."""
        return sum(int(a.get(k, 0)) - int(b.get(k, 0)) for a, b in zip(after, before, strict=True)
                   for k in a if k.endswith(suffix))

    statuses = [r["status"] for r in records]
    sent = [r for r in records if r["start"] is not None]
    span = (max(r["start"] for r in sent) - min(r["start"] for r in sent)) if len(sent) > 1 else 0.0
    latencies = [(r["end"] - r["sched"]) * 1000 for r in records if r["end"] is not None and r["status"] in (200, 429)]
    # the documented bounds, from the rendered topology: the budget plus each sidecar's floor
    # (Redis away), or each Envoy's ceiling (checks failing open)
    budget = next(b for b in limits.budgets(topo) if b.id == FLOOD_BUDGET_ID)
    bound = budget.amount + len(rig.pairs) * limits.floor_amount(budget, limits.envoys(topo))
    ceiling = len(rig.pairs) * next(c.max_tokens for c in limits.ceilings(topo) if c.budget.id == FLOOD_BUDGET_ID)
    achieved = round(len(sent) / span, 1) if span else None
    result = {"rate": rate, "requests": count, "run": run, "busy_loops": busy, "achieved_rate": achieved,
              "admitted": statuses.count(200), "refused": statuses.count(429),
              "other": sum(1 for s in statuses if s not in (200, 429)), "redis_counted": counted,
              "floor_decisions_for_the_key": floor,
              "envoy_checks_failed_open": delta("ratelimit.confgen_global.failure_mode_allowed"),
              "envoy_check_errors": delta("ratelimit.confgen_global.error"), "budget": budget.amount,
              "bound_with_floors": bound, "bound_with_ceilings": ceiling,
              "refused_by_ceilings": delta("confgen_ceiling.http_local_rate_limit.rate_limited"),
              "p50_ms": pct(latencies, 50), "p99_ms": pct(latencies, 99)}
    print(f"flood {rate:.0f} req/s run {run}: {result}", flush=True)
    return result


def sse_cost(rate: float, count: int, workdir: Path, max_tokens: int = 64) -> dict[str, Any]:
    """What reading the usage costs a stream: two Envoys on one fleet, the same clients, one
    with token budgets in its topology (json_to_metadata response rules + sse_to_metadata on
    every response) and one without; client `free` (no limit of its own: no rate limit call)
    streams with include_usage through both, alternately."""
    from tests.sidecar_live.glimits import CLIENTS

    without = {k: v for k, v in CLIENTS.items() if k not in ("tok", "out")}
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"authorization": f"Bearer {KEYS['free']}", "content-type": "application/json"}
    job = {"targets": None, "path": "/v1/completions", "deadline_s": count / rate + 5, "timeout_s": 20,
           "max_in_flight": 500, "requests": [{"i": i, "t": i / rate, "body": body, "headers": headers}
                                              for i in range(count)]}
    out: dict[str, Any] = {}
    with global_rig(workdir / "sse", envoys=2, check_timeout=None, store_timeout=None, sidecar_args=(),
                    decode_ms=2.0, clients=[None, without]) as rig:
        urls = [f"http://127.0.0.1:{pair.port}" for pair in rig.pairs]  # even: with usage reading
        proc, path = loadgen.start(job, workdir, "sse")
        loadgen.go(proc, urls)
        records = loadgen.collect(proc, path, count / rate + 60)
        stats = rig.pairs[0].envoy.stats()
    for parity, name in ((0, "with_usage_filters"), (1, "without")):
        mine = [r for r in records if r["i"] % 2 == parity]
        summary = summarize(mine, warmup_s=1.0)
        good = [r for r in mine if r["status"] == 200 and r["ttft"] is not None and r["sched"] >= 1.0]
        tpot = [(r["end"] - r["sched"] - r["ttft"]) * 1000 / (max_tokens - 1) for r in good]
        out[name] = {"ok": summary["ok"], "requests": summary["requests"], "ttft_p50_ms": summary["ttft_p50_ms"],
                     "ttft_p99_ms": summary["ttft_p99_ms"], "e2e_p50_ms": summary["p50_ms"],
                     "e2e_p99_ms": summary["p99_ms"], "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99)}
        print(f"{name}: {out[name]}", flush=True)
    out["sse_to_metadata_stats"] = {k: v for k, v in stats.items() if k.startswith("sse_to_metadata")}
    return out


def outage(seconds: float, workdir: Path) -> dict[str, Any]:
    from tests.sidecar_live.test_global_limits_live import _first_refusal_after, run_redis_outage

    got = run_redis_outage(workdir / "outage", outage_s=seconds)
    out, back = got["out"], got["back"]
    statuses = [s for _, s in out]
    return {
        "outage_s": seconds, "requests": len(out), "failed": sum(1 for s in statuses if s not in (200, 429)),
        "admitted_uncounted": sum(1 for at, s in out if got["killed"] + 0.5 <= at < back and s == 200),
        "store_failures": got["failures"], "store_up_during": got["store_up_during"],
        "fail_closed_during": got["closed_during"],
        "enforced_after_s": _first_refusal_after(out, back),
        "admitted_per_s_after": sum(1 for at, s in out if back + 2 <= at < back + 4 and s == 200) / 2,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--outage", type=float, default=10.0)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--sse", type=int, default=0, metavar="N", help="also N streams for the usage filters' cost")
    parser.add_argument("--flood", default="", metavar="RATES", help="comma-separated flood rates, e.g. 500,1000")
    parser.add_argument("--flood-requests", type=int, default=5000)
    parser.add_argument("--flood-runs", type=int, default=2)
    parser.add_argument("--flood-busy", type=int, default=0, metavar="N",
                        help="N busy-loop processes beside each flood (a loaded machine)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="confgen-rl-bench-") as tmp:
        result: dict[str, Any] = {}
        if not args.skip_latency:
            result["latency"] = latency(args.rate, args.requests, args.rounds, Path(tmp))
        if args.sse:
            result["sse"] = sse_cost(40.0, args.sse, Path(tmp))
        if args.flood:
            result["flood"] = [flood(float(rate), args.flood_requests, run, Path(tmp), args.flood_busy)
                               for rate in args.flood.split(",") for run in range(args.flood_runs)]
        if args.outage > 0:
            result["outage"] = outage(args.outage, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
