"""The fleet shapes the sweep runs, their workloads and their estimated capacity."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from confgen.simulate import EngineRequest

# Request mixes: (prompt tokens lo..hi, log-uniform), (output tokens lo..hi, uniform).
MIXES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "chat": ((100, 1500), (40, 300)),
    "prompt": ((1500, 6000), (16, 96)),
    "output": ((50, 400), (200, 600)),
    "bench": ((64, 1024), (16, 64)),  # the real bench's one-shot requests (bench._workload.WorkloadSpec)
    "bench_prompt": ((768, 3072), (4, 16)),  # its prompt-heavy fleet's (bench/scenarios/_fleets.MATRIX)
    "bench_output": ((32, 256), (32, 96)),  # its output-heavy fleet's
}
PREFILL_MS_PER_1K = 60.0
DECODE_GROWTH = 0.03
KV_CACHE_TOKENS = 65536


@dataclass(frozen=True)
class Shape:
    """One simulated fleet and its traffic."""

    name: str
    speeds: tuple[float, ...]
    max_num_seqs: int
    mix: str = "chat"
    decode_ms: float = 30.0
    load: float = 0.78
    bursty: bool = False  # arrival rate alternates 1.5x / 0.5x of the mean every `burst_s`
    burst_s: float = 8.0
    slowdown: bool = False  # worker 0 runs at half its speed from mid-run on
    requests: int = 2400

    def prompt_mean(self) -> float:
        lo, hi = MIXES[self.mix][0]
        return (hi - lo) / math.log(hi / lo)

    def output_mean(self) -> float:
        lo, hi = MIXES[self.mix][1]
        return (lo + hi) / 2

    def worker_rps(self, speed: float) -> float:
        """Requests/s one worker sustains with full batches: a batch of B finishes B requests
        every `output` steps, and each admitted request's prefill stalls the whole batch."""
        out, prompt = self.output_mean(), self.prompt_mean()
        batch = min(self.max_num_seqs, max(1.0, KV_CACHE_TOKENS / (prompt + out / 2)))
        step_s = self.decode_ms * (1 + DECODE_GROWTH * (batch - 1)) / 1000
        prefill_s = PREFILL_MS_PER_1K * prompt / 1000 / 1000
        return speed * batch / (out * step_s + batch * prefill_s)

    def capacity_rps(self) -> float:
        """Estimated fleet capacity (before the mid-run slowdown)."""
        return sum(self.worker_rps(s) for s in self.speeds)

    def rate(self) -> float:
        return self.load * self.capacity_rps()

    def duration_s(self) -> float:
        return self.requests / self.rate()

    def workload(self, seed: int) -> list[EngineRequest]:
        """The requests (fresh objects every call: the engines fill them in)."""
        rng = random.Random(seed)
        (plo, phi), (olo, ohi) = MIXES[self.mix]
        rate = self.rate()
        out: list[EngineRequest] = []
        t = 0.0
        for i in range(self.requests):
            r = rate
            if self.bursty:
                r = rate * (1.5 if int(t / self.burst_s) % 2 == 0 else 0.5)
            t += rng.expovariate(r)
            prompt = int(math.exp(rng.uniform(math.log(plo), math.log(phi))))
            out.append(EngineRequest(f"r{i}", prompt_tokens=prompt, max_tokens=rng.randint(olo, ohi), arrival=t))
        return out


def _spread(n: int, speeds: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(speeds[i % len(speeds)] for i in range(n))


MATRIX: tuple[Shape, ...] = (
    Shape("3w one much slower (1, 1, 0.4), seqs 8", (1.0, 1.0, 0.4), 8),
    Shape("3w (1, 0.75, 0.5), seqs 4", (1.0, 0.75, 0.5), 4),
    Shape("12w three speeds (6x1, 3x0.75, 3x0.5), seqs 4", (1.0,) * 6 + (0.75,) * 3 + (0.5,) * 3, 4),
    Shape("5w wide spread (1 .. 0.25), seqs 16", (1.0, 0.7, 0.5, 0.35, 0.25), 16),
    Shape("6w narrow spread (1 .. 0.85), seqs 32", (1.0, 0.95, 0.9, 1.0, 0.85, 0.9), 32),
    Shape("8w equal speeds, seqs 16", (1.0,) * 8, 16),
    Shape("4w equal speeds, seqs 64, output-heavy", (1.0,) * 4, 64, mix="output"),
    Shape("4w (1, 1, 0.6, 0.6), seqs 16, prompt-heavy", (1.0, 1.0, 0.6, 0.6), 16, mix="prompt"),
    Shape("4w (1, 1, 0.6, 0.6), seqs 32, output-heavy", (1.0, 1.0, 0.6, 0.6), 32, mix="output"),
    Shape("6w (1, 1, 1, 0.7, 0.7, 0.5), seqs 8, bursty", (1.0, 1.0, 1.0, 0.7, 0.7, 0.5), 8, bursty=True),
    Shape("6w equal, seqs 16, one slows 2x mid-run", (1.0,) * 6, 16, slowdown=True),
    Shape("48w (1, 0.8, 0.6), seqs 8", _spread(48, (1.0, 0.8, 0.6)), 8, requests=4000),
)
