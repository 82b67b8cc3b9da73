"""What the endpoint picker adds per request: the same fleet behind the same Envoy render,
least_request vs prefix_affinity (ext_proc to the sidecar's picker), an open loop at a fixed
rate (bounded in count), end-to-end latency P50/P99/max, the requests that took longer than the
picker's message timeout (200 ms: what Envoy waits for an answer before it balances alone), the
picker's answers without a pick by reason (`confgen_picker_unpicked_total`) and the sidecar's CPU
per 1,000 req/s, and the cores the sidecar and Envoy (one worker thread) used.

    PYTHONPATH=$PWD python -m tests.sidecar_live.picker_overhead --rate 300 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench._procstat import cpu_s
from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, fleet_topology, run_fleet_in_thread
from tests.sidecar_live.rig import FAST_ARGS, SidecarProcess, worker_specs


async def _load(url: str, rate: float, count: int) -> tuple[list[float], int]:
    latencies: list[float] = []
    failures = 0
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=512)) as session:
        async def one(i: int) -> None:
            nonlocal failures
            body = {"model": "sim-model", "max_tokens": 1, "messages": [
                {"role": "system", "content": f"conversation {i % 50} " + "shared context " * 40},
                {"role": "user", "content": f"question {i}"}]}
            started = time.perf_counter()
            try:
                async with session.post(url, json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        failures += 1
                        return
            except (aiohttp.ClientError, TimeoutError):
                failures += 1
                return
            latencies.append(time.perf_counter() - started)

        start = time.perf_counter()
        tasks = []
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return latencies, failures


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _unpicked(metrics: str) -> dict[str, int]:
    """The picker's answers without a pick so far, by reason (warm-up second included)."""
    found = re.findall(r'^confgen_picker_unpicked_total\{reason="([a-z_]+)"\} ([0-9.e+]+)$', metrics, re.M)
    return {reason: int(float(v)) for reason, v in found if float(v)}


def _streams(stats: dict[str, int | str]) -> int:
    return sum(v for k, v in stats.items() if k.endswith(".ext_proc.streams_started") and isinstance(v, int))


def run(policy: str, rate: float, seconds: float) -> dict[str, float]:
    workers = worker_specs(["a", "b", "c", "d"], decode_ms=1.0, prefill_ms_per_1k=1.0, max_num_seqs=64)
    with run_fleet_in_thread(FleetSpec(workers=workers, seed=1)) as fleet, \
            tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        port, admin, listen, grpc_port = free_port(), free_port(), free_port(), free_port()
        text = fleet_topology(name="overhead", admin=admin, port=port,
                              workers=[f"127.0.0.1:{w.port}" for w in fleet.workers], models=["sim-model"],
                              capacity=64, pool=[f"balancing: {{policy: {policy}}}"],
                              tail=[f"sidecar: {{grpc_port: {grpc_port}, grpc_socket_dir: {tmp / 's'}}}"])
        (tmp / "t.yaml").write_text(text)
        topo, _ = parse_topology(text.encode())
        xds = tmp / "envoy"
        write_tree(envoy.render(topo, config_dir=str(xds)), xds, rank=envoy.layout.write_rank)
        sidecar = SidecarProcess(["--topology", str(tmp / "t.yaml"), "--xds-dir", str(xds), "--listen",
                                  f"127.0.0.1:{listen}", *FAST_ARGS], tmp / "sidecar.log", listen)
        with EnvoyProcess(xds / "bootstrap.json") as proxy:
            sidecar.start()
            try:
                sidecar.wait_ready()
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                asyncio.run(_load(url, rate, int(rate)))  # warm-up second
                assert sidecar.proc is not None
                streams0 = _streams(proxy.stats())
                cpu0, envoy0, t0 = cpu_s(sidecar.proc.pid), cpu_s(proxy.pid), time.perf_counter()
                latencies, failures = asyncio.run(_load(url, rate, int(rate * seconds)))
                cpu = cpu_s(sidecar.proc.pid) - cpu0
                envoy_cpu = cpu_s(proxy.pid) - envoy0
                wall = time.perf_counter() - t0
                metrics = sidecar.metrics()
                unpicked = _unpicked(metrics)
                # requests Envoy sent past the picker (the bypass share): no ext_proc stream opened
                bypassed = len(latencies) + failures - (_streams(proxy.stats()) - streams0)
                share = re.search(r"^confgen_picker_bypass_percent ([0-9.e+]+)$", metrics, re.M)
            finally:
                sidecar.stop()
    achieved = len(latencies) / wall
    return {"requests": len(latencies), "failures": failures, "achieved_rps": round(achieved, 1),
            "p50_ms": round(_pct(latencies, 0.5) * 1000, 2), "p99_ms": round(_pct(latencies, 0.99) * 1000, 2),
            "mean_ms": round(statistics.fmean(latencies) * 1000, 2), "max_ms": round(max(latencies) * 1000, 2),
            "over_200ms": sum(1 for x in latencies if x >= 0.2), "unpicked": unpicked,
            "bypassed": bypassed, "bypass_percent_at_end": float(share.group(1)) if share else None,
            "sidecar_cpu_per_1000_rps": round(cpu / wall / max(achieved, 1e-9) * 1000, 3),
            "sidecar_cores": round(cpu / wall, 2), "envoy_cores": round(envoy_cpu / wall, 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for policy in ("least_request", "prefix_affinity"):
            with contextlib.suppress(KeyboardInterrupt):
                print(json.dumps({"policy": policy, **run(policy, args.rate, args.seconds)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
