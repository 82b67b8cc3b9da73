"""Render scale: 10,000 workers in 200 pools -> parse + check, render, envoy --mode validate."""

from __future__ import annotations

import time

from confgen import envoy, runtime, verify
from confgen.topology import parse

from .._harness import Context, Result, Target

NAME = "render_scale"
TITLE = "Render scale: 10,000 workers in 200 pools"


def topology_text(pools: int, per_pool: int) -> str:
    out = ["version: 1", "name: scale", "admin: {address: 127.0.0.1, port: 9901}",
           f"envoy: {{max_eds_files: {pools}}}",
           "listeners:", "  - {name: public, address: 127.0.0.1, port: 8080}", "pools:"]
    for p in range(pools):
        out += [f"  - name: pool{p:03d}", "    engine: vllm", f"    models: [model-{p:03d}]", "    workers:"]
        for w in range(per_pool):
            n = p * per_pool + w
            out.append(f"      - 10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}:8000")
    return "\n".join(out) + "\n"


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    pools, per_pool = 200, 50
    text = topology_text(pools, per_pool).encode()
    rounds = int(ctx.scale(3, 1))
    best: dict[str, float] = {}
    size = files_n = 0
    problems: list[str] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        topo, _ = parse(text, "<scale>")
        t1 = time.perf_counter()
        files = envoy.render(topo, config_dir="/etc/confgen/envoy")
        t2 = time.perf_counter()
        # What `confgen validate --envoy` runs: every listener, route and cluster, and the first
        # endpoints of each pool; the full parse (`--envoy-all-endpoints`) is timed beside it.
        boot = envoy.static_bootstrap(files, max_endpoints=verify.SAMPLED_ENDPOINTS)
        problems = runtime.validate_envoy_static(boot)
        t3 = time.perf_counter()
        problems += runtime.validate_envoy_static(envoy.static_bootstrap(files))
        t4 = time.perf_counter()
        for k, v in (("parse", t1 - t0), ("render", t2 - t1), ("validate", t3 - t2), ("total", t3 - t0),
                     ("validate_all", t4 - t3)):
            best[k] = min(best.get(k, v), v)
        size, files_n = sum(len(b) for b in files.values()), len(files)
    res.tables.append((f"{pools * per_pool:,} workers in {pools} pools ({len(text) / 1e6:.2f} MB of YAML); best of "
                       f"{rounds} round(s)",
                       ["load + check s", "render s", "envoy --mode validate s (validate --envoy)", "total s",
                        "validate, every endpoint s", "files", "output MB", "validate errors"],
                       [[f"{best['parse']:.3f}", f"{best['render']:.3f}", f"{best['validate']:.3f}",
                         f"{best['total']:.3f}", f"{best['validate_all']:.3f}", str(files_n), f"{size / 1e6:.2f}",
                         str(len(problems))]]))
    res.targets.append(Target("Render + validate 10,000 workers", "<= 1 s", f"{best['total']:.2f} s "
                              f"(load+check {best['parse']:.2f}, render {best['render']:.2f}, validate "
                              f"{best['validate']:.2f})", best["total"], best["total"] <= 1.0 and not problems, 1.0))
    res.raw = {**best, "bytes": size, "files": files_n, "problems": problems[:5]}
    res.notes.append(f"`confgen validate --envoy` has Envoy parse every listener, route and cluster and the first "
                     f"{verify.SAMPLED_ENDPOINTS} endpoints of each pool (the rest come from the same builder and "
                     "differ only in values the topology checks bound); `--envoy-all-endpoints` parses them all, "
                     "timed in its own column and not part of the target.")
    res.notes.append("The generated topology sets `envoy: {max_eds_files: 200}`: topology validation caps EDS pools "
                     "at 100 by default, because Envoy opens one inotify instance per EDS file "
                     "(fs.inotify.max_user_instances is 128 here). Nothing is started: Envoy only validates.")
    return res
