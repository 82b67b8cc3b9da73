"""Run one router variant in front of a fresh simulated fleet on a fixed list of arrivals."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confgen.simulate import FleetHandle, run_fleet_in_thread

from .. import _proxies, _stats, loadgen
from .._harness import Context, fleet_stats, stats_delta
from ._fleets import FleetPlan


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    router: str  # "envoy" | "vllm-router"
    policy: str
    weights: str = ""  # "" none | "core": the sidecar's pure weight core | "daemon": the sidecar as shipped
    ingresses: int = 1


VARIANTS = (
    Variant("envoy_rr", "Envoy round_robin", "envoy", "round_robin"),
    Variant("envoy_p2c", "Envoy least_request P2C (choice_count 2)", "envoy", "least_request"),
    Variant("envoy_p2c_w", "Envoy least_request P2C + sidecar weights", "envoy", "least_request", weights="core"),
    Variant("envoy_p2c_d", "Envoy least_request P2C + sidecar daemon (weights + 80 % backpressure)", "envoy",
            "least_request", weights="daemon"),
    Variant("envoy_ring", "Envoy ring_hash (x-session-id, load bound 150 %)", "envoy", "ring_hash"),
    Variant("vr_rr", "vLLM Router round_robin", "vllm-router", "round_robin"),
    Variant("vr_p2", "vLLM Router power_of_two", "vllm-router", "power_of_two"),
    Variant("vr_cache", "vLLM Router cache_aware", "vllm-router", "cache_aware"),
)

WEIGHTS_INTERVAL_S = 0.5
SIDECAR_ARGS = ("--health", "slow_start_s=0")


@contextlib.contextmanager
def _front(ctx: Context, fleet: FleetHandle, plan: FleetPlan, v: Variant, tag: str,
           duration: float) -> Iterator[list[str]]:
    """Start the router(s) of variant `v`; yields the URLs clients send to."""
    if v.router == "vllm-router":
        with _proxies.run_vllm_router(fleet.urls, v.policy, ctx.work / f"{tag}.vllm-router.log") as url:
            yield [url]
        return
    workers = [("127.0.0.1", w.port, plan.max_num_seqs) for w in fleet.workers]
    cfg = _proxies.PoolConfig(policy=v.policy, capacity=plan.max_num_seqs,
                              lift_circuit_breakers=v.weights != "daemon")
    rendered = [_proxies.render(workers, cfg, ctx.work / f"{tag}.envoy{i}") for i in range(v.ingresses)]
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(_proxies.run_envoy(r)) for r in rendered]
        if v.weights == "daemon":
            # The sidecar as shipped; the circuit breaker it keeps at 80 % of capacity stays in force.
            for i, (r, p) in enumerate(zip(rendered, procs, strict=True)):
                stack.enter_context(_proxies.run_sidecar(
                    r, p, ctx.work / f"{tag}.sidecar{i}.log", WEIGHTS_INTERVAL_S,
                    (*SIDECAR_ARGS, "--ingresses", str(v.ingresses))))
        elif v.weights == "core":
            eps = [{"port": w.port, "capacity": plan.max_num_seqs, "metrics_url": f"{w.url}/metrics"}
                   for w in fleet.workers]
            stack.enter_context(_proxies.run_weights_core(eps, [r.eds_file for r in rendered], ctx.work, tag,
                                                          WEIGHTS_INTERVAL_S, duration + 120))
        yield [r.url for r in rendered]


def measure(ctx: Context, plan: FleetPlan, requests: list[dict[str, Any]], v: Variant, tag: str,
            duration: float) -> dict[str, Any]:
    started = time.monotonic()
    with run_fleet_in_thread(plan.spec(ctx.seed)) as fleet, _front(ctx, fleet, plan, v, tag, duration) as urls:
        before = fleet_stats(fleet)
        job = {"targets": urls, "requests": requests, "deadline_s": duration + 1.0, "timeout_s": 60.0,
               "max_in_flight": 4000}
        records = loadgen.run(job, ctx.work, tag)
        after = fleet_stats(fleet)
    summary = _stats.summarize(records)
    delta = stats_delta(before, after)
    summary["fleet_by_worker"] = delta["by_worker"]
    summary["prefix_hit_rate"] = delta["prefix_hit_rate"]
    summary["wall_s"] = time.monotonic() - started
    summary["label"] = v.label
    return summary


def slow_share(by_worker: dict[str, int], plan: FleetPlan) -> tuple[float | None, float]:
    """Share of requests that went to the slowest workers, and their share of capacity."""
    slowest = min(plan.speeds)
    names = [n for n in by_worker if n.endswith(f"x{slowest:g}")]
    total = sum(by_worker.values())
    cap = slowest * len(names) / sum(plan.speeds)
    return (sum(by_worker[n] for n in names) / total if total else None), cap


def workdir(ctx: Context, name: str) -> Path:
    path = ctx.work / name
    path.mkdir(parents=True, exist_ok=True)
    return path
