"""Proxy overhead: the same tiny requests straight to a worker, through Envoy, through the peer."""

from __future__ import annotations

import contextlib

from confgen.simulate import FleetSpec, WorkerSpec, run_fleet_in_thread

from .. import _proxies, _stats, loadgen
from .._harness import Context, Result, Target, fmt_ms

NAME = "overhead"
TITLE = "Proxy overhead (added latency vs calling the worker directly)"


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    count = int(ctx.scale(1000, 160))
    rate = 60.0
    requests = [{"i": i, "t": round(i / rate, 4), "headers": {},
                 "body": {"model": "sim-model", "prompt": f"ping {i}", "max_tokens": 1, "stream": False}}
                for i in range(count)]
    spec = FleetSpec(workers=(WorkerSpec(name="w0", max_num_seqs=256, decode_ms=0.5, prefill_ms_per_1k=0.0),),
                     seed=ctx.seed)
    out: dict[str, dict] = {}
    with run_fleet_in_thread(spec) as fleet:
        worker = fleet.workers[0]
        rendered = _proxies.render([("127.0.0.1", worker.port, 256)],
                                   _proxies.PoolConfig(policy="round_robin", capacity=256), ctx.work / "ovh.envoy")
        with contextlib.ExitStack() as stack:
            stack.enter_context(_proxies.run_envoy(rendered))
            peer = stack.enter_context(_proxies.run_vllm_router(fleet.urls, "round_robin",
                                                                ctx.work / "ovh.vllm-router.log"))
            targets = {"direct": worker.url, "envoy": rendered.url, "vllm-router": peer}
            for _round in range(2):  # interleave so drift on a shared machine hits every target alike
                for name, url in targets.items():
                    job = {"targets": [url], "requests": requests[: count // 2], "deadline_s": count / rate + 1,
                           "timeout_s": 10.0}
                    recs = loadgen.run(job, ctx.work, f"ovh-{name}-{_round}")
                    out.setdefault(name, {"records": []})["records"] += recs
    table = []
    summary = {}
    for name, d in out.items():
        s = _stats.summarize(d["records"])
        summary[name] = s
    base50, base99 = summary["direct"]["p50_ms"], summary["direct"]["p99_ms"]
    for name, s in summary.items():
        add50 = None if name == "direct" else s["p50_ms"] - base50
        add99 = None if name == "direct" else s["p99_ms"] - base99
        s["added_p50_ms"], s["added_p99_ms"] = add50, add99
        table.append([name, fmt_ms(s["p50_ms"]), fmt_ms(s["p99_ms"]), "-" if add50 is None else f"{add50:+.2f}",
                      "-" if add99 is None else f"{add99:+.2f}", str(s["errors"])])
    res.tables.append((f"{count} non-streaming requests (1 output token) at {rate:.0f} req/s per target, "
                       "one worker with 0.5 ms steps; targets interleaved in two halves",
                       ["target", "P50 ms", "P99 ms", "added P50 ms", "added P99 ms", "errors"], table))
    e50 = summary["envoy"]["added_p50_ms"]
    res.targets.append(Target("Envoy overhead at P50", "<= 1 ms", f"{e50:+.2f} ms (P99 "
                              f"{summary['envoy']['added_p99_ms']:+.2f} ms; peer P50 "
                              f"{summary['vllm-router']['added_p50_ms']:+.2f} ms)", e50, e50 <= 1.0, 1.0))
    res.raw = {name: {k: v for k, v in s.items()} for name, s in summary.items()}
    res.chart = {"bars": [(n, s["p50_ms"], s["p99_ms"]) for n, s in summary.items()]}
    res.notes.append("Envoy runs with --concurrency 1; the load generator is a separate Python (aiohttp) process "
                     "and its own latency is part of every row, including 'direct'.")
    return res
