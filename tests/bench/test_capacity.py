"""The matrix's capacity estimate against the simulator's own engine, in virtual time (no wall
clock): below the estimate a fleet keeps up, above it queues grow. Deterministic (seeded)."""

from __future__ import annotations

import math
import random

import pytest

from bench._workload import arrivals
from bench.scenarios._fleets import MATRIX, FleetPlan
from confgen.simulate import BatchEngine, EngineRequest, LatencyModel


def _median_latency(plan: FleetPlan, load: float, n: int = 3000, seed: int = 1) -> float:
    """Median latency (virtual s) of the second half of `n` arrivals at `load` x the estimate,
    each sent to the worker with the least work per unit of speed and batch (a near-ideal router)."""
    engines = [BatchEngine(LatencyModel(max_num_seqs=b, speed=s, decode_ms=plan.decode_ms,
                                        prefill_ms_per_1k=plan.prefill_ms_per_1k, decode_growth=plan.decode_growth),
                           prefix_cache_size=0)
               for s, b in zip(plan.effective_speeds(), plan.max_num_seqs, strict=True)]
    wl = plan.workload(plan.capacity_rps() * load, n, seed)
    rng = random.Random(seed)
    lo, hi = wl.prompt_tokens
    reqs = []
    for i, t in arrivals(rng, wl):
        prompt = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        reqs.append(EngineRequest(str(i), prompt, rng.randint(*wl.output_range), t))
    for r in reqs:
        for e in engines:
            e.advance(r.arrival)
        target = min(engines, key=lambda e: (len(e.running) + len(e.waiting)) / e.model.max_num_seqs / e.model.speed)
        target.submit(r, r.arrival)
    while any(e.next_event_time() is not None for e in engines):
        now = min(t for e in engines if (t := e.next_event_time()) is not None)
        for e in engines:
            e.advance(now)
    late = sorted(r.duration or 0.0 for r in reqs[n // 2:])
    return late[len(late) // 2]


@pytest.mark.parametrize("plan", MATRIX, ids=[p.key for p in MATRIX])
def test_capacity_estimate_separates_stable_from_overloaded(plan: FleetPlan) -> None:
    """At 90 % of a fleet's estimated capacity the simulated engines keep up; at 110 % the
    median latency of the later requests is several times higher (queues grow without bound),
    so the 78 % the matrix offers is below capacity and the estimate is within about 10 %."""
    below = _median_latency(plan, 0.90)
    above = _median_latency(plan, 1.10)
    assert above > 3 * below, (plan.key, below, above)
