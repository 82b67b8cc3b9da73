"""Simulated LLM inference fleet: many fake engine servers in one process.

Each worker speaks an engine's wire formats (OpenAI completions/chat with SSE, /v1/models,
the engine's health endpoint and its exact Prometheus text), runs a continuous-batching
latency model, and can be switched into fault modes at run time. Deterministic under a seed.

    spec = FleetSpec.uniform(3, seed=7, speeds=(1, 1, 0.5), engine="vllm", max_num_seqs=4)
    with run_fleet_in_thread(spec) as fleet:        # sync code: tests, benchmarks
        fleet.workers[0].set_fault("crash")
        fleet.workers[0].revive()

    async with Fleet(spec) as fleet:                # async code
        fleet.urls

Admin per worker: POST /_sim/fault {"mode": ..., params}, GET /_sim/fault, GET /_sim/stats.
Fleet control channel (survives a worker crash): GET /_fleet/workers,
GET /_fleet/workers/{name}/stats, POST /_fleet/workers/{name}/{fault,crash,revive}.
"""

from ._cli import main
from ._engine import BLOCK_TOKENS, BatchEngine, EngineRequest, LatencyModel, simulate
from ._fleet import Fleet, FleetHandle, WorkerHandle, run_fleet_in_thread
from ._server import SimWorker, block_hashes
from ._spec import (
    ENGINE_KINDS,
    FAULT_MODES,
    EngineKind,
    FaultMode,
    FaultSpec,
    FleetSpec,
    ScheduledFault,
    SpecError,
    WorkerSpec,
)
from ._topology import fleet_topology

__all__ = [
    "BLOCK_TOKENS",
    "ENGINE_KINDS",
    "FAULT_MODES",
    "BatchEngine",
    "EngineKind",
    "EngineRequest",
    "FaultMode",
    "FaultSpec",
    "Fleet",
    "FleetHandle",
    "FleetSpec",
    "LatencyModel",
    "ScheduledFault",
    "SimWorker",
    "SpecError",
    "WorkerHandle",
    "WorkerSpec",
    "block_hashes",
    "fleet_topology",
    "main",
    "run_fleet_in_thread",
    "simulate",
]
