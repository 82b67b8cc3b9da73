"""The simulated fleets the routing scenarios run, and their estimated capacity."""

from __future__ import annotations

from dataclasses import dataclass

from confgen.simulate import FleetSpec, WorkerSpec

from .._workload import WorkloadSpec


@dataclass(frozen=True)
class FleetPlan:
    label: str
    speeds: tuple[float, ...]
    max_num_seqs: int
    decode_ms: float
    load: float  # offered load as a share of the estimated fleet capacity

    def spec(self, seed: int) -> FleetSpec:
        workers = tuple(
            WorkerSpec(name=f"w{i:02d}-x{s:g}", models=("sim-model",), speed=s, max_num_seqs=self.max_num_seqs,
                       decode_ms=self.decode_ms, prefill_ms_per_1k=60.0, decode_growth=0.03,
                       prefix_cache_size=16)
            for i, s in enumerate(self.speeds)
        )
        return FleetSpec(workers=workers, seed=seed)

    def capacity_rps(self, wl: WorkloadSpec) -> float:
        """Requests/s the fleet sustains with full batches (mean output, mean prompt prefill)."""
        out_mean = sum(wl.output_range) / 2
        prompt_mean = 400.0
        step_s = self.decode_ms * (1 + 0.03 * (self.max_num_seqs - 1)) / 1000
        per_unit = self.max_num_seqs / (out_mean * step_s + 0.06 * prompt_mean / 1000)
        return per_unit * sum(self.speeds)


THREE = FleetPlan("3 workers (1x, 1x, 0.5x)", (1.0, 1.0, 0.5), max_num_seqs=8, decode_ms=40.0, load=0.8)
TWELVE = FleetPlan("12 workers (6x 1x, 3x 0.75x, 3x 0.5x)",
                   (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.75, 0.75, 0.5, 0.5, 0.5),
                   max_num_seqs=4, decode_ms=50.0, load=0.8)
