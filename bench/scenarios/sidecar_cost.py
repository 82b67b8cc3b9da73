"""Sidecar cost: the real sidecar daemon probing 1,000 endpoints at 1 Hz (40 KB bodies), plus extraction time."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench._procstat import cpu_s, rss_mb
from bench.engines_bench import bench_extract
from confgen import envoy, runtime
from confgen.output import write_tree
from confgen.runtime import stop_process
from confgen.simulate import FleetSpec, WorkerSpec, run_fleet_in_thread
from confgen.topology import parse
from sidecar.observe.engines import extract

from .. import _proxies
from .._harness import Context, Result, Target, wait_until

NAME = "sidecar_cost"
TITLE = "Sidecar cost: 1,000 endpoints at 1 Hz"

ENDPOINTS = 1000
FLEETS = ("idle", "busy")  # progress counter flat / rising: decides how often /health is asked
POOLS = 10
SERVERS = 2  # metrics-server processes (500 ports each)
TARGET_BODY = 40_000


def _sim_body(seed: int) -> bytes:
    """A real /metrics body from the simulator after some traffic (histograms filled)."""
    spec = FleetSpec(workers=(WorkerSpec(name="m0", decode_ms=1.0),), seed=seed)
    with run_fleet_in_thread(spec) as fleet:
        url = fleet.workers[0].url
        for i in range(20):
            req = urllib.request.Request(f"{url}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "p" * (40 * i + 10), "max_tokens": 4 + i}).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                resp.read()
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            return resp.read()


def _pad(body: bytes, size: int) -> bytes:
    """Grow a body to about `size` bytes with extra (unwanted) histogram series, as a bigger vLLM emits."""
    if len(body) >= size:
        return body
    lines, i = [], 0
    while len(body) + sum(len(x) for x in lines) < size:
        lines.append(f'vllm:request_params_n_bucket{{engine="0",le="{i}",model_name="padding"}} {i}.0\n'.encode())
        i += 1
    return body + b"".join(lines)


def _topology(ports: list[int], listen: int, admin: int) -> str:
    per = len(ports) // POOLS
    pools = []
    for p in range(POOLS):
        workers = "\n".join(f"      - 127.0.0.1:{port}" for port in ports[p * per:(p + 1) * per])
        pools.append(f"""  - name: pool{p:02d}
    engine: vllm
    models: [model-{p:02d}]
    capacity: 16
    health: {{enabled: false}}
    workers:
{workers}""")
    return (f"version: 1\nname: cost\nadmin: {{address: 127.0.0.1, port: {admin}}}\n"
            f"listeners:\n  - {{name: public, address: 127.0.0.1, port: {listen}}}\npools:\n" + "\n".join(pools) + "\n")


def _measure(ctx: Context, ports: list[int], concurrency: str, warmup: float, window: float,
             tag: str) -> dict[str, float]:
    """Start Envoy + the sidecar on the 1,000-endpoint topology; CPU and memory of the sidecar."""
    listen, admin = runtime.free_port(), runtime.free_port()
    text = _topology(ports, listen, admin)
    xds = ctx.work / f"cost{tag}.envoy"
    topo, _ = parse(text.encode(), "<cost>")
    write_tree(envoy.render(topo, config_dir=str(xds)), xds)
    topo_path = ctx.work / f"cost{tag}.topology" / "topology.yaml"
    topo_path.parent.mkdir(parents=True, exist_ok=True)
    topo_path.write_text(text)
    rendered = _proxies.RenderedEnvoy(xds, listen, admin, {}, topo_path)
    with _proxies.run_envoy(rendered) as proxy, \
            _proxies.run_sidecar(rendered, proxy, ctx.work / f"cost{tag}.sidecar.log", 1.0,
                                 ("--max-concurrency", concurrency)) as sidecar:
        time.sleep(warmup)
        cpu0, t0 = cpu_s(sidecar.pid), time.monotonic()
        time.sleep(window)
        cpu1, t1 = cpu_s(sidecar.pid), time.monotonic()
        rss, hwm = rss_mb(sidecar.pid)
        with urllib.request.urlopen(proxy.admin_url + "/stats?filter=update_success", timeout=5) as r:
            updates = sum(int(ln.split(": ")[1]) for ln in r.read().decode().splitlines()
                          if ln.startswith("cluster.pool") and ln.split(": ")[1].isdigit())
    return {"cores": (cpu1 - cpu0) / (t1 - t0), "rss_mb": rss, "hwm_mb": hwm, "eds_updates": updates}


@contextlib.contextmanager
def _metrics_servers(ctx: Context, body_path: Path, busy: bool) -> Iterator[list[int]]:
    """SERVERS processes serving ENDPOINTS ports in all; stopped by their pids."""
    servers: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for i in range(SERVERS):
            out = ctx.work / f"cost.ports{i}.json"
            out.unlink(missing_ok=True)
            servers.append(subprocess.Popen([sys.executable, "-m", "bench._metrics_server", str(body_path), str(out),
                                             str(ENDPOINTS // SERVERS), *(["--busy"] if busy else [])]))
            if not wait_until(out.exists, 30):
                raise RuntimeError("metrics server did not start")
            time.sleep(0.1)
            ports += json.loads(out.read_text())
        yield ports
    finally:
        for s in servers:
            stop_process(s, timeout=10)


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    window = ctx.scale(20, 6)
    warmup = ctx.scale(5, 3)
    body = _pad(_sim_body(ctx.seed), TARGET_BODY)
    body_path = ctx.work / "cost.body.prom"
    body_path.write_bytes(body)
    runs: dict[str, dict[str, float]] = {}
    for fleet in FLEETS:
        with _metrics_servers(ctx, body_path, busy=fleet == "busy") as ports:
            # The wider pool is a what-if: a shorter window is enough to see the difference.
            for flag in ("64", *(() if ctx.quick or fleet == "busy" else (str(ENDPOINTS),))):
                runs[f"{fleet} {flag}"] = _measure(ctx, ports, flag, warmup, window if flag == "64" else window / 2,
                                                   tag=f"{fleet}{flag}")
    idle, busy = runs["idle 64"], runs["busy 64"]
    cores, hwm = max(idle["cores"], busy["cores"]), max(idle["hwm_mb"], busy["hwm_mb"])
    wide = runs.get(f"idle {ENDPOINTS}")
    # Extraction: the shipped micro-benchmark on a 50 KB cut of the repo's vLLM V1 fixture, and on our body.
    fixture = Path(__file__).resolve().parents[2] / "tests/sidecar/fixtures/vllm_v1_dp2.prom"
    raw = fixture.read_bytes()
    cut = raw if len(raw) <= 50_000 else raw[: raw.rindex(b"\n", 0, 50_000) + 1]
    assert extract("vllm", cut) is not None
    per_50k = bench_extract(cut, "vllm", rounds=int(ctx.scale(200, 50)))
    per_body = bench_extract(body, "vllm", rounds=int(ctx.scale(200, 50)))
    res.tables.append((f"confgen-sidecar (python -m sidecar.main, --interval 1) over {ENDPOINTS} endpoints in {POOLS} "
                       f"EDS pools, served by {SERVERS} metrics servers ({len(body) / 1000:.1f} KB body), "
                       f"real Envoy confirming writes; CPU from /proc/<pid>/stat over {window:.0f} s after "
                       f"{warmup:.0f} s warm-up",
                       ["fleet", "--max-concurrency", "CPU (cores)", "RSS MB", "peak RSS MB",
                        "EDS updates applied by Envoy", f"extract() per {len(cut) / 1000:.0f} KB fixture",
                        f"extract() per {len(body) / 1000:.0f} KB body"],
                       [[key.split()[0], f"{flag}{' (default)' if flag == '64' else ''}", f"{r['cores']:.3f}",
                         f"{r['rss_mb']:.0f}", f"{r['hwm_mb']:.0f}", str(r["eds_updates"]), f"{per_50k * 1000:.3f} ms",
                         f"{per_body * 1000:.3f} ms"] for key, r in runs.items() for flag in (key.split()[1],)]))
    res.targets.append(Target("Sidecar: 1,000 endpoints at 1 Hz", "<= 0.3 core, <= 150 MB",
                              f"{cores:.2f} core, {hwm:.0f} MB peak RSS, the worse of idle ({idle['cores']:.2f} core) "
                              f"and busy ({busy['cores']:.2f} core) fleets (default --max-concurrency 64"
                              + (f"; idle {wide['cores']:.2f} core with {ENDPOINTS})" if wide else ")"), cores,
                              cores <= 0.3 and hwm <= 150, 0.3))
    res.targets.append(Target("Metric extraction per 50 KB body", "<= 0.5 ms", f"{per_50k * 1000:.3f} ms",
                              per_50k * 1000, per_50k * 1000 <= 0.5, 0.5))
    res.raw = {"runs": runs, "extract_50k_s": per_50k,
               "extract_body_s": per_body, "body_bytes": len(body)}
    res.notes.append("The metrics body is the simulator's own vLLM exposition after some traffic, padded with extra "
                     "histogram series to 40 KB. 1,000 listening sockets come from 2 processes of 500 ports each "
                     "(bench/_metrics_server.py), not 1,000 engines. Idle fleet: the same body on every scrape (no "
                     "request running, the generated-token counter flat), so every probe asks /health and, the engine "
                     "being quiet, /metrics only every 3rd probe (quiet_metrics_probes). "
                     "Busy fleet: 4 requests running and the token counter rising on every scrape, so the sidecar "
                     "takes that progress as proof of life and asks /health only every health_every_s (5 s) per "
                     "endpoint. The target row shows the worse of the two.")
    return res
