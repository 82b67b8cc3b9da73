"""Discrete-event fleet model: engines, routers and the sidecar's weight loop in virtual time.

- Engines: `confgen.simulate.BatchEngine` (the simulator's pure continuous-batching model),
  one per worker, advanced event by event; no wall clock anywhere.
- Routers (`ROUTERS`): Envoy least_request as Envoy implements it (P2C over `choice_count`
  random picks with replacement when every weight is equal; otherwise an EDF schedule
  whose entries get weight / (active + 1)^active_request_bias when picked or (re)built,
  so a host's dynamic weight is only refreshed when it is picked; every EDS update
  rebuilds the schedule), round robin, vLLM Router's power_of_two (two distinct random
  workers, fewer in-flight wins), join-the-shortest-queue on in-flight per slot (full
  scan: what cache_aware falls back to under imbalance) and an oracle that knows every
  worker's true speed.
- The sidecar (`Knobs`): every `interval_s` each worker's load sample (running, waiting,
  KV use, its inter-token latency histogram's sum and count) goes through the shipped
  pure code: `sidecar.decide.weights.Trend.observe`, `relative_speeds`, `target`, and the publish
  gate `sidecar.decide.hysteresis.gate`; the published weights are what the Envoy model sees.

Everything random comes from one seeded `random.Random` per run, so a run is a function
of (shape, router, knobs, seed).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from confgen.envoy.eds import static_weight
from confgen.model import Balancing
from confgen.simulate import BatchEngine, LatencyModel
from sidecar.config import SidecarConfig
from sidecar.decide.hysteresis import HysteresisPolicy
from sidecar.decide.weights import Trend, WeightPolicy
from sidecar.observe.engines import LoadSample

from ._fleets import DECODE_GROWTH, KV_CACHE_TOKENS, PREFILL_MS_PER_1K, Shape
from ._loop import STEP, Events, Steps, sidecar_weights

_SHIPPED_BALANCING = Balancing()
_SHIPPED_SIDECAR = SidecarConfig(topology=Path("topology.yaml"))


@dataclass(frozen=True)
class Knobs:
    """The product's knobs under test: sidecar weight model + Envoy least_request. The
    defaults are the shipped ones (WeightPolicy, HysteresisPolicy, the sidecar's interval,
    confgen's Balancing), read from where they live."""

    policy: WeightPolicy = field(default_factory=WeightPolicy)
    hysteresis: HysteresisPolicy = field(default_factory=HysteresisPolicy)
    interval_s: float = _SHIPPED_SIDECAR.interval_s
    choice_count: int = _SHIPPED_BALANCING.choice_count
    active_request_bias: float = _SHIPPED_BALANCING.active_request_bias
    sidecar: bool = True  # False: Envoy least_request with the rendered weights only


class _Envoy:
    """Envoy's least_request load balancer for one pool (one worker thread)."""

    def __init__(self, rng: random.Random, n: int, choice_count: int, bias: float) -> None:
        self.rng, self.n, self.cc, self.bias = rng, n, choice_count, bias
        self.weights = [1] * n
        self.equal = True
        self._edf: list[tuple[float, int, int]] = []
        self._now = 0.0
        self._order = 0
        self.updates = 0

    def _dynamic(self, host: int, active: Sequence[int]) -> float:
        w = float(self.weights[host])
        if self.bias == 0:
            return w
        return w / (active[host] + 1) ** self.bias if self.bias != 1 else w / (active[host] + 1)

    def set_weights(self, weights: Sequence[int], active: Sequence[int]) -> None:
        self.weights = list(weights)
        self.updates += 1
        self.equal = len(set(self.weights)) == 1
        self._edf = []
        self._now = 0.0
        if not self.equal:
            for h in range(self.n):
                self._push(h, active)
            for _ in range(self.rng.randrange(self.n)):  # Envoy starts each schedule at a random pick
                self._pop(active)

    def _push(self, host: int, active: Sequence[int]) -> None:
        self._order += 1
        heapq.heappush(self._edf, (self._now + 1.0 / self._dynamic(host, active), self._order, host))

    def _pop(self, active: Sequence[int]) -> int:
        deadline, _, host = heapq.heappop(self._edf)
        self._now = deadline
        self._push(host, active)
        return host

    def pick(self, active: Sequence[int]) -> int:
        if not self.equal:
            return self._pop(active)
        best = self.rng.randrange(self.n)
        for _ in range(self.cc - 1):
            h = self.rng.randrange(self.n)
            if active[h] < active[best]:
                best = h
        return best


Picker = Callable[[Sequence[int]], int]


def _round_robin(n: int) -> Picker:
    state = [0]

    def pick(_active: Sequence[int]) -> int:
        state[0] = (state[0] + 1) % n
        return state[0]

    return pick


def _power_of_two(rng: random.Random, n: int) -> Picker:
    def pick(active: Sequence[int]) -> int:
        if n == 1:
            return 0
        a, b = rng.sample(range(n), 2)
        if active[a] == active[b]:
            return a
        return a if active[a] < active[b] else b

    return pick


def _least_per_slot(rng: random.Random, rates: Sequence[float]) -> Picker:
    """The worker with the fewest in-flight per unit of `rates` (ties: random)."""

    def pick(active: Sequence[int]) -> int:
        best = min((active[h] + 1) / rates[h] for h in range(len(rates)))
        ties = [h for h in range(len(rates)) if (active[h] + 1) / rates[h] <= best * (1 + 1e-12)]
        return ties[0] if len(ties) == 1 else rng.choice(ties)

    return pick


@dataclass
class RunResult:
    p50: float
    p99: float
    p999: float
    done: int
    eds_writes: int  # sidecar runs: cycles whose published weights changed
    writes_after_warmup: int  # ... after the first 60 s of virtual time
    slow_share: float  # share of requests the slowest worker took
    react_cycles: int | None = None  # slowdown runs: probe cycles until worker 0's weight fell 10 %


_ARRIVAL, _PROBE, _SLOW = 1, 2, 3  # after the engines' STEP (0)
_WARMUP_S = 60.0


def run(shape: Shape, router: str, seed: int, knobs: Knobs | None = None) -> RunResult:
    """Simulate `shape` under `router` ("envoy" uses `knobs`); deterministic in its inputs."""
    knobs = knobs or Knobs()
    rng = random.Random(seed * 7919 + 17)
    n = len(shape.speeds)
    capacity = shape.max_num_seqs
    models = [
        LatencyModel(max_num_seqs=capacity, speed=s, prefill_ms_per_1k=PREFILL_MS_PER_1K,
                     decode_ms=shape.decode_ms, decode_growth=DECODE_GROWTH, kv_cache_tokens=KV_CACHE_TOKENS)
        for s in shape.speeds
    ]
    engines = [BatchEngine(m, prefix_cache_size=0, histogram_bounds={"itl": (1.0,)}) for m in models]
    requests = shape.workload(seed)
    duration = requests[-1].arrival
    active = [0] * n
    routed = [0] * n
    true_speed = list(shape.speeds)

    envoy: _Envoy | None = None
    if router == "envoy":
        envoy = _Envoy(rng, n, knobs.choice_count, knobs.active_request_bias)
        envoy.set_weights([static_weight(capacity) * _per_slot(knobs)] * n, active)
        envoy.updates = 0
        picker: Picker = envoy.pick
    elif router == "round_robin":
        picker = _round_robin(n)
    elif router == "power_of_two":
        picker = _power_of_two(rng, n)
    elif router == "jsq":
        picker = _least_per_slot(rng, [1.0] * n)
    elif router == "oracle":
        picker = _least_per_slot(rng, true_speed)  # reads the list, so it sees the slowdown
    else:
        raise ValueError(f"unknown router {router!r}")

    events: Events[int] = Events()
    for i, r in enumerate(requests):
        events.push(r.arrival, _ARRIVAL, i)
    sidecar_on = envoy is not None and knobs.sidecar
    if sidecar_on:
        events.push(knobs.interval_s, _PROBE, 0)
    if shape.slowdown:
        events.push(duration / 2, _SLOW, 0)

    trends = [Trend()] * n
    published: list[int | None] = [None] * n
    streaks = [0] * n
    writes = writes_late = 0
    slowed_at: float | None = None
    weight_before = 0
    react: int | None = None
    latencies: list[float] = []
    steps = Steps(events, engines)

    for t, kind, idx in events:
        if kind == STEP:
            for r in steps.finished(idx, t):
                active[idx] -= 1
                latencies.append(t - r.arrival)
        elif kind == _ARRIVAL:
            r = requests[idx]
            h = picker(active)
            active[h] += 1
            routed[h] += 1
            engines[h].submit(r, t)
            steps.schedule(h)
        elif kind == _PROBE:
            assert envoy is not None
            samples = []
            for i, eng in enumerate(engines):
                hist = eng.histograms["itl"]
                samples.append(LoadSample(running=len(eng.running), waiting=len(eng.waiting),
                                          kv_usage=eng.kv_usage(), token_latency_s=hist.total,
                                          token_latency_n=float(hist.count)))
                trends[i] = trends[i].observe(samples[i], t, knobs.policy)
            if published[0] is None:
                published = list(envoy.weights)  # the render's weights are in force before the first cycle
            nxt, streaks = sidecar_weights(samples, trends, [capacity] * n, published, streaks, knobs.policy,
                                           knobs.hysteresis, max_weight=knobs.policy.max_weight)
            if slowed_at is not None and react is None and nxt[0] <= 0.9 * weight_before:
                react = math.ceil((t - slowed_at) / knobs.interval_s - 1e-9)
            if nxt != published:
                published = list(nxt)
                envoy.set_weights(nxt, active)
                writes += 1
                writes_late += t > _WARMUP_S
            if t + knobs.interval_s <= duration:
                events.push(t + knobs.interval_s, _PROBE, 0)
        elif kind == _SLOW:
            engines[0].model = replace(engines[0].model, speed=engines[0].model.speed / 2)
            true_speed[0] /= 2
            slowed_at = t
            weight_before = envoy.weights[0] if envoy is not None else 0

    latencies.sort()
    slowest = min(range(n), key=lambda h: shape.speeds[h])
    return RunResult(
        p50=_quantile(latencies, 0.5), p99=_quantile(latencies, 0.99), p999=_quantile(latencies, 0.999),
        done=len(latencies), eds_writes=writes, writes_after_warmup=writes_late,
        slow_share=routed[slowest] / max(1, sum(routed)), react_cycles=react,
    )


def _per_slot(knobs: Knobs) -> int:
    return max(1, round(knobs.policy.weight_per_slot))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


REFERENCES = ("round_robin", "power_of_two", "jsq")
PEERS = ("round_robin", "power_of_two", "jsq")
ROUTERS = ("envoy", *REFERENCES, "oracle")

__all__ = ["PEERS", "ROUTERS", "Knobs", "RunResult", "run"]
