"""Does prefix_affinity earn its place, and where does it lose? A quick check beside the
benchmark (bench/ has the full scenarios): the product render + sidecar (defaults) with
least_request vs prefix_affinity on the simulator, closed-loop clients, bounded in count.

    conversations: plain clients (no session header) resend growing chats, equal workers
    oneshot-uneven: distinct prompts (nothing to reuse), one worker at half speed, long answers

    PYTHONPATH=$PWD python -m tests.sidecar_live.picker_workloads --seeds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, WorkerSpec, fleet_topology, run_fleet_in_thread
from tests.sidecar_live.rig import SidecarProcess


async def _conversations(url: str, seed: int, clients: int, conversations: int, turns: int) -> list[float]:
    rng = random.Random(seed)
    latencies: list[float] = []
    queue = list(range(conversations))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def client() -> None:
            while queue:
                c = queue.pop()
                messages: list[dict[str, str]] = [{"role": "system", "content": f"Agent {c}. " + "context " * 300}]
                for t in range(turns):
                    messages.append({"role": "user", "content": f"question {t} " + "detail " * rng.randint(10, 60)})
                    started = time.perf_counter()
                    async with session.post(url, json={"model": "sim-model", "messages": messages,
                                                       "max_tokens": rng.randint(16, 64)}) as resp:
                        body = await resp.json()
                        assert resp.status == 200, body
                    latencies.append(time.perf_counter() - started)
                    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


async def _oneshot(url: str, seed: int, clients: int, count: int) -> list[float]:
    rng = random.Random(seed)
    latencies: list[float] = []
    left = [count]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                prompt = f"{rng.random()} " + "words " * rng.randint(50, 400)
                max_tokens = rng.choice([8, 16, 32, 200, 400])
                started = time.perf_counter()
                async with session.post(url, json={"model": "sim-model", "prompt": prompt,
                                                   "max_tokens": max_tokens}) as resp:
                    await resp.read()
                    assert resp.status == 200
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(workload: str, policy: str, seed: int) -> dict[str, Any]:
    if workload == "conversations":
        workers = tuple(WorkerSpec(name=n, models=("sim-model",), max_num_seqs=8, decode_ms=15.0,
                                   prefill_ms_per_1k=120.0, prefix_cache_size=64) for n in "abcd")
    else:
        workers = tuple(WorkerSpec(name=n, models=("sim-model",), max_num_seqs=8, decode_ms=10.0,
                                   speed=0.5 if n == "d" else 1.0) for n in "abcd")
    with run_fleet_in_thread(FleetSpec(workers=workers, seed=seed)) as fleet, \
            tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        port, admin, listen, grpc_port = free_port(), free_port(), free_port(), free_port()
        text = fleet_topology(name="wl", admin=admin, port=port, models=["sim-model"], capacity=8,
                              workers=[f"127.0.0.1:{w.port}" for w in fleet.workers],
                              pool=[f"balancing: {{policy: {policy}}}"],
                              tail=[f"sidecar: {{grpc_port: {grpc_port}, grpc_socket_dir: {tmp / 's'}}}"])
        (tmp / "t.yaml").write_text(text)
        topo, _ = parse_topology(text.encode())
        xds = tmp / "envoy"
        write_tree(envoy.render(topo, config_dir=str(xds)), xds, rank=envoy.layout.write_rank)
        sidecar = SidecarProcess(["--topology", str(tmp / "t.yaml"), "--xds-dir", str(xds),
                                  "--listen", f"127.0.0.1:{listen}"], tmp / "sidecar.log", listen)
        with EnvoyProcess(xds / "bootstrap.json"):
            sidecar.start()
            try:
                sidecar.wait_ready()
                time.sleep(2.5)  # one probe cycle: the picker has the fleet view
                base = f"http://127.0.0.1:{port}/v1/"
                if workload == "conversations":
                    lat = asyncio.run(_conversations(base + "chat/completions", seed, 24, 72, 6))
                else:
                    lat = asyncio.run(_oneshot(base + "completions", seed, 20, 500))
                hits = lookups = 0
                for w in fleet.workers:
                    pc = w.stats()["prefix_cache"]
                    hits, lookups = hits + pc["hit_tokens"], lookups + pc["query_tokens"]
            finally:
                sidecar.stop()
    return {"workload": workload, "policy": policy, "seed": seed, "n": len(lat),
            "p50_s": round(_pct(lat, 0.5), 3), "p90_s": round(_pct(lat, 0.9), 3), "p99_s": round(_pct(lat, 0.99), 3),
            "prefix_hit_tokens_ratio": round(hits / max(1, lookups), 3)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--workloads", default="conversations,oneshot-uneven")
    args = parser.parse_args()
    for workload in args.workloads.split(","):
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for policy in ("least_request", "prefix_affinity"):
                print(json.dumps(run(workload, policy, seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
