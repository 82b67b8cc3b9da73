"""The simulated fleets of the routing matrix, and the capacity each one is loaded against.

Capacity model (the simulator's own latency model, confgen/simulate/_engine.py): a worker
with batch limit B and speed s runs steps of `decode_ms * (1 + decode_growth * (B - 1)) / s`;
each step gives every running request one token, and a step that admits a request is longer
by that request's prefill, `prefill_ms_per_1k * uncached_prompt_tokens / 1000 / s`, which
every running request waits out. With full batches, N requests of mean output O and mean
prompt P take N * O / B steps plus N prefills, so one worker completes

    1 / (O * step(B) / B + prefill(P))   requests per second,

and the fleet's capacity is the sum over its workers (a worker that slows down mid-run
counts at its slowed speed: the load stays below capacity the whole run). The matrix
workloads have no shared prefixes, so nothing is cached and the estimate needs no hit rate.
At the offered load (75-80 %) batches are not always full, which is why queues stay short
enough to measure; past 100 % they grow without bound. tests/bench/test_capacity.py checks
the estimate against the simulator's engine in virtual time for every fleet: with a
near-ideal router the queues stay bounded at 90 % of it and grow at 110 %.
"""

from __future__ import annotations

from dataclasses import dataclass

from confgen.simulate import FaultSpec, FleetSpec, ScheduledFault, WorkerSpec

from .._workload import WorkloadSpec


@dataclass(frozen=True)
class Slowdown:
    worker: int  # index into the fleet
    at: float  # share of the measured window after which the worker slows
    factor: float = 2.0


@dataclass(frozen=True)
class FleetPlan:
    key: str
    label: str
    speeds: tuple[float, ...]
    max_num_seqs: tuple[int, ...]  # per worker (what the topology declares as its capacity)
    decode_ms: float
    prompt_tokens: tuple[int, int] = (64, 1024)
    output_range: tuple[int, int] = (8, 40)
    arrivals: str = "poisson"
    load: float = 0.78  # offered load as a share of the estimated capacity
    ingresses: int = 1
    slowdown: Slowdown | None = None
    prefill_ms_per_1k: float = 60.0
    decode_growth: float = 0.03
    prefix_cache_size: int = 16
    prefix_cache_mode: str = "key"  # the simulator's prefix cache: "key" (sessions) or "blocks" (vLLM-like)
    kv_cache_tokens: int = 65536  # per worker; in "blocks" mode also the prefix cache's size (/16 blocks)

    def __post_init__(self) -> None:
        if len(self.speeds) != len(self.max_num_seqs):
            raise ValueError(f"{self.key}: one max_num_seqs per worker")

    @property
    def even(self) -> bool:
        """Every worker alike (speed, batch, no slowdown): the target there is parity with the peer."""
        return len(set(self.speeds)) == 1 and len(set(self.max_num_seqs)) == 1 and self.slowdown is None

    def worker_name(self, i: int) -> str:
        return f"w{i:02d}-x{self.speeds[i]:g}-b{self.max_num_seqs[i]}"

    def spec(self, seed: int, slow_at_s: float | None = None) -> FleetSpec:
        """The fleet; `slow_at_s` (s after the fleet starts) schedules the slowdown, if any."""
        workers = []
        for i, (s, b) in enumerate(zip(self.speeds, self.max_num_seqs, strict=True)):
            schedule: tuple[ScheduledFault, ...] = ()
            if self.slowdown is not None and self.slowdown.worker == i and slow_at_s is not None:
                schedule = (ScheduledFault(slow_at_s, FaultSpec("slow", {"factor": self.slowdown.factor})),)
            workers.append(WorkerSpec(name=self.worker_name(i), models=("sim-model",), speed=s, max_num_seqs=b,
                                      decode_ms=self.decode_ms, prefill_ms_per_1k=self.prefill_ms_per_1k,
                                      decode_growth=self.decode_growth, prefix_cache_size=self.prefix_cache_size,
                                      prefix_cache_mode=self.prefix_cache_mode, kv_cache_tokens=self.kv_cache_tokens,
                                      fault_schedule=schedule))
        return FleetSpec(workers=tuple(workers), seed=seed)

    def effective_speeds(self) -> tuple[float, ...]:
        if self.slowdown is None:
            return self.speeds
        return tuple(s / self.slowdown.factor if i == self.slowdown.worker else s for i, s in enumerate(self.speeds))

    def worker_rps(self, out_mean: float, prompt_mean: float) -> list[float]:
        """Requests/s each worker completes with full batches (see the module docstring)."""
        out = []
        for s, b in zip(self.effective_speeds(), self.max_num_seqs, strict=True):
            step_s = self.decode_ms * (1 + self.decode_growth * (b - 1)) / 1000 / s
            prefill_s = self.prefill_ms_per_1k * prompt_mean / 1000 / 1000 / s
            out.append(1.0 / (out_mean * step_s / b + prefill_s))
        return out

    def round_robin_overload(self) -> float:
        """The highest offered load / capacity of any worker when requests are split evenly
        (round robin) at the plan's load: above 1, that worker's queue grows for as long as
        the run lasts, so round robin cannot have the lowest P99 among stable policies."""
        wl = self.workload(1.0, 1, 0)
        per = self.worker_rps(wl.output_mean(), wl.prompt_mean())
        share = self.capacity_rps() * self.load / len(per)
        return max(share / c for c in per)

    def work_s(self, out: int, prompt: int) -> float:
        """What one request of `out` tokens and a `prompt`-token prompt costs the fleet, in seconds of a
        worker at full batches (the capacity model's two terms, averaged over the workers weighted by
        their share of the capacity): the unit a shed share of the work is counted in."""
        wl = self.workload(1.0, 1, 0)
        caps = self.worker_rps(wl.output_mean(), wl.prompt_mean())
        total = 0.0
        for s, b, c in zip(self.effective_speeds(), self.max_num_seqs, caps, strict=True):
            step_s = self.decode_ms * (1 + self.decode_growth * (b - 1)) / 1000 / s
            total += c * (out * step_s / b + self.prefill_ms_per_1k * prompt / 1000 / 1000 / s)
        return total / sum(caps)

    def capacity_rps(self) -> float:
        wl = self.workload(1.0, 1, 0)
        return sum(self.worker_rps(wl.output_mean(), wl.prompt_mean()))

    def workload(self, rate: float, count: int, seed: int) -> WorkloadSpec:
        return WorkloadSpec(rate=rate, count=count, seed=seed, prompt_tokens=self.prompt_tokens,
                            output_range=self.output_range, session_share=0.0, arrivals=self.arrivals)

    def describe_workers(self) -> str:
        return (f"{len(self.speeds)} workers, speeds {_list(self.speeds)}, max_num_seqs {_list(self.max_num_seqs)}; "
                f"decode {self.decode_ms:g} ms/step at 1x, prefill {self.prefill_ms_per_1k:g} ms per 1k prompt tokens")

    def describe(self) -> str:
        parts = [self.describe_workers(), f"prompts {self.prompt_tokens[0]}-{self.prompt_tokens[1]} "
                 f"tokens (log-uniform), outputs {self.output_range[0]}-{self.output_range[1]}",
                 f"{self.arrivals} arrivals"]
        if self.slowdown is not None:
            parts.append(f"{self.worker_name(self.slowdown.worker)} slows {self.slowdown.factor:g}x after "
                         f"{self.slowdown.at:.0%} of the measured window")
        if self.ingresses > 1:
            parts.append(f"{self.ingresses} ingresses (requests alternate)")
        return "; ".join(parts)


def _list(values: tuple[float, ...] | tuple[int, ...]) -> str:
    return "/".join(f"{v:g}" for v in values)


MATRIX: tuple[FleetPlan, ...] = (
    FleetPlan("wide", "wide speed spread", (1.0, 1.0, 0.35), (8, 8, 8), decode_ms=20),
    FleetPlan("narrow", "narrow speed spread", (1.0, 0.9, 0.8, 0.8), (16, 16, 16, 16), decode_ms=40),
    FleetPlan("equal", "equal speeds", (1.0, 1.0, 1.0, 1.0), (8, 8, 8, 8), decode_ms=25),
    FleetPlan("batch", "batch sizes 4 to 64", (1.0, 1.0, 1.0), (4, 16, 64), decode_ms=30),
    FleetPlan("prompt_heavy", "prompt-heavy mix", (1.0, 1.0, 0.5), (8, 8, 8), decode_ms=20,
              prompt_tokens=(768, 3072), output_range=(4, 16)),
    FleetPlan("output_heavy", "output-heavy mix", (1.0, 0.7, 0.5), (8, 8, 8), decode_ms=15,
              prompt_tokens=(32, 256), output_range=(32, 96)),
    FleetPlan("bursty", "bursty arrivals", (1.0, 1.0, 0.5), (8, 8, 8), decode_ms=20, arrivals="bursty"),
    FleetPlan("slowdown", "a worker slows 2x mid-run", (1.0, 1.0, 1.0), (8, 8, 8), decode_ms=20,
              slowdown=Slowdown(worker=2, at=1 / 3)),
    FleetPlan("two_ingress", "two ingresses, one fleet", (1.0, 1.0, 0.5), (8, 8, 8), decode_ms=20, ingresses=2),
)
QUICK = ("wide",)
BY_KEY = {p.key: p for p in MATRIX}
