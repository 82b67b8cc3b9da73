"""Live check of the publish gate: the real sidecar (default flags) + a simulated fleet + Envoy.

    nice -n 10 .venv/bin/python -m bench.sweep.live_check [--seconds 300] [--warmup 60]

`confgen render` output unmodified (breakers in place), Envoy, `python -m sidecar.main`
with its default flags (2 s interval), a simulated vLLM fleet of 3 workers (1x, 1x, 0.5x;
max_num_seqs 8) under steady open-loop Poisson load at `--load` of its estimated capacity
for `--seconds`. Prints the EDS file replacements after `--warmup` (the gate's promise:
none on a steady fleet after the first minute), the published weights over time, and the
requests' outcome. Everything started here is stopped here, by its pid.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from confgen.simulate import FleetSpec, WorkerSpec, run_fleet_in_thread

from .. import loadgen
from .._proxies import POOL, PoolConfig, render, run_envoy, run_sidecar
from ._fleets import Shape

SPEEDS = (1.0, 1.0, 0.5)
SEQS = 8
DECODE_MS = 40.0
CHARS_PER_TOKEN = 4


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep.live_check", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    shape = Shape("live", SPEEDS, SEQS, decode_ms=DECODE_MS, load=args.load)
    rate = shape.rate()
    rng = random.Random(args.seed)
    (plo, phi), (olo, ohi) = (100, 1500), (40, 300)
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > args.seconds:
            break
        prompt = int(plo * (phi / plo) ** rng.random())
        body = {"model": "sim-model", "prompt": "x" * (prompt * CHARS_PER_TOKEN), "max_tokens": rng.randint(olo, ohi)}
        requests.append({"i": len(requests), "t": t, "body": body})
    workers = tuple(WorkerSpec(name=f"w{i}-x{s:g}", models=("sim-model",), speed=s, max_num_seqs=SEQS,
                               decode_ms=DECODE_MS, prefill_ms_per_1k=60.0, decode_growth=0.03)
                    for i, s in enumerate(SPEEDS))
    with tempfile.TemporaryDirectory(prefix="weights-live-") as tmp, \
            run_fleet_in_thread(FleetSpec(workers=workers, seed=args.seed)) as fleet:
        work = Path(tmp)
        rendered = render([("127.0.0.1", w.port, SEQS) for w in fleet.workers],
                          PoolConfig(lift_circuit_breakers=False), work / "envoy")
        changes: list[tuple[float, dict[str, int]]] = []
        stop = threading.Event()

        def watch(t0: float) -> None:
            seen: tuple[int, int] | None = None
            while not stop.wait(0.1):
                try:
                    st = rendered.eds_file.stat()
                    data = json.loads(rendered.eds_file.read_bytes())
                except (OSError, ValueError):
                    continue
                key = (st.st_ino, st.st_mtime_ns)
                if key != seen:
                    seen = key
                    weights = {lb["endpoint"]["address"]["socket_address"]["port_value"]: lb["load_balancing_weight"]
                               for group in data["resources"][0]["endpoints"] for lb in group["lb_endpoints"]}
                    changes.append((time.monotonic() - t0, weights))

        with run_envoy(rendered) as proc, run_sidecar(rendered, proc, work / "sidecar.log", interval_s=2.0):
            t0 = time.monotonic()
            watcher = threading.Thread(target=watch, args=(t0,), daemon=True)
            watcher.start()
            job = {"targets": [rendered.url], "requests": requests, "deadline_s": args.seconds,
                   "timeout_s": 120.0, "max_in_flight": 1000}
            load, out = loadgen.start(job, work, "live")
            records = loadgen.collect(load, out, timeout=args.seconds + 180)
            stop.set()
            watcher.join(timeout=5)
    late = [(at, w) for at, w in changes[1:] if at > args.warmup]
    ports = {w.port: w.name for w in fleet.workers}
    print(f"fleet {SPEEDS} seqs {SEQS}, {len(requests)} requests at {rate:.2f}/s ({args.load:.0%} of "
          f"{shape.capacity_rps():.2f}/s) for {args.seconds:g} s; pool {POOL}")
    print(f"EDS files seen: {len(changes)} (first is the render/first cycle); after {args.warmup:g} s: {len(late)}")
    for at, weights in changes:
        print(f"  t={at:6.1f} s  " + ", ".join(f"{ports.get(p, p)}={w}" for p, w in sorted(weights.items())))
    status = Counter(r["status"] for r in records)
    ok = sorted(r["end"] - r["start"] for r in records if r["status"] == 200)
    p99 = ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else float("nan")
    print(f"requests: {dict(status)}, P99 {p99:.2f} s, by worker {dict(Counter(r['worker'] for r in records))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
