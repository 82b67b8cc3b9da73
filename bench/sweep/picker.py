"""The endpoint picker in virtual time: the shipped picker code over simulated engines.

`python -m bench.sweep.picker [--seeds 1,2,3] [--set KEY=VALUE ...]` runs each workload on its
fleets under each router and prints one table per workload (P50 / P90 / P99 / mean end to end,
TTFT P50 / P99, token-level prefix-cache hits, the busiest and idlest worker's share of the
requests against a fair share, and the predictor's median absolute error and median observed /
predicted). Deterministic: a run
is a function of (fleet, workload, router, seed, overrides).

- Engines: `confgen.simulate.BatchEngine` with vLLM-like block prefix caches (a prompt is a
  chain of 16-token blocks; two prompts share the blocks of their common prefix).
- Routers:
    lr          Envoy least_request (P2C, choice_count 3, bias 0.5 as rendered) over the sidecar's
                weights (the shipped `sidecar.decide.weights` + `hysteresis` loop): today's default
    weighted    the picker, `rule=weighted` (the earlier rule)
    predicted   the picker, `rule=predicted` (the shipped default)
    predicted2  two picker replicas, each request through one of them at random
    p2c         vLLM Router's power_of_two (two random workers, fewer in flight wins)
  Every picker router is `sidecar.outputs.picker` itself: Datastore + Picker fed by a probe
  every second with what the engines' metrics would say (running, waiting, KV use, the
  inter-token latency histogram, the prefill-phase histogram, prompt tokens prefilled, the
  generated-tokens-per-request histogram), releasing a request when it finishes.
- Workloads: `chat` (conversations from plain clients: one shared system prompt, 6-12 turns,
  each turn sent a think time after the previous one ended), `oneshot` (independent prompts of
  the sweep's mixes, Poisson arrivals), `mix` (half of each, the same clients).
- `--matrix-fleets`: one-shot on the real bench's matrix fleets instead (their speeds, slots, decode
  step and mixes, at 78 %, the saturation verdict off as it stays there; bench/results/matrix-virtual).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from hashlib import blake2b
from pathlib import Path

from confgen.envoy.eds import static_weight
from confgen.simulate import BatchEngine, EngineRequest, LatencyModel
from sidecar.decide.weights import Trend
from sidecar.observe.engines import LoadSample
from sidecar.outputs.picker.datastore import Datastore, EndpointFacts, PoolFacts
from sidecar.outputs.picker.predict import Prediction
from sidecar.outputs.picker.prompt import CHARS_PER_TOKEN, PromptInfo
from sidecar.outputs.picker.scheduling import Picker, PickerPolicy, PickRequest

from ._fleets import DECODE_GROWTH, KV_CACHE_TOKENS, MATRIX, MIXES, PREFILL_MS_PER_1K, Shape
from ._loop import STEP, Events, Steps, sidecar_weights
from ._model import Knobs, _Envoy

BLOCK = 16  # tokens per prompt block (the engines' and the picker's)
KV_TOKENS = 40_960
DIAGNOSE = False
ROUTERS = ("lr", "weighted", "predicted", "predicted2", "p2c")


@dataclass(frozen=True)
class Fleet:
    name: str
    speeds: tuple[float, ...]
    seqs: int
    decode_ms: float = 20.0
    kv_tokens: int = 40_960


@dataclass
class Turn:
    """One request: its prompt as block ids, its output length, the conversation it continues."""

    blocks: tuple[str, ...]
    output: int
    arrival: float
    conv: int | None = None  # conversation index; None: one-shot
    turn: int = 0
    home_key: int | None = None
    history_tokens: int = 0
    home_tokens: int = 0
    traffic_class: str = "standard"


@dataclass
class Conversation:
    system: int
    first_user: int
    turns: int
    start: float
    think_rng: random.Random
    blocks: list[str] = field(default_factory=list)
    done_turns: int = 0


@dataclass
class Result:
    lat: list[float]
    ttft: list[float]
    hits: float
    shares: list[float]
    err: float | None  # median |predicted - observed| / observed
    # (arrival, latency or None: refused, class)
    records: list[tuple[float, float | None, str]] = field(default_factory=list)
    bias: float | None = None  # median observed / predicted

    def q(self, values: Sequence[float], p: float) -> float:
        s = sorted(values)
        return s[min(len(s) - 1, max(0, int(p * len(s) + 0.5) - 1))] if s else math.nan


@lru_cache(maxsize=1 << 20)
def _hash(name: str) -> int:
    return int.from_bytes(blake2b(name.encode(), digest_size=8).digest(), "little")


def _blocks(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


class _Sim:
    def __init__(self, fleet: Fleet, router: str, seed: int, policy: PickerPolicy, max_tokens: int = 0,
                 reasons: bool = True, verdict: bool = True) -> None:
        self.fleet = fleet
        # the pool's saturation verdict as the picker sees it: True (the gate always open, as the
        # overload tables measure admission), False (never: the picker's own pressure and spike rules
        # alone open it, as at 78 % on the real bench where the verdict stays off)
        self.verdict = verdict
        self.max_tokens = max_tokens  # the bound the clients send (0: each answer's exact length)
        self.reasons = reasons  # the engines report why requests finished (vLLM); else as TGI, llama.cpp
        self.rng = random.Random(seed * 104729 + 7)
        self.router = router
        n = len(fleet.speeds)
        self.engines = [BatchEngine(LatencyModel(max_num_seqs=fleet.seqs, speed=s, prefill_ms_per_1k=PREFILL_MS_PER_1K,
                                                 decode_ms=fleet.decode_ms, decode_growth=DECODE_GROWTH,
                                                 kv_cache_tokens=fleet.kv_tokens),
                                    prefix_cache_blocks=True,
                                    histogram_bounds={"itl": (1.0,), "prefill": (1.0,), "generation_tokens": (1.0,)})
                        for s in fleet.speeds]
        self.addresses = [f"10.0.0.{i + 1}:8000" for i in range(n)]
        self.active = [0] * n
        self.routed = [0] * n
        pickers = 2 if router == "predicted2" else 1
        rule = "weighted" if router == "weighted" else "predicted"
        self.stores = [Datastore() for _ in range(pickers)]
        self.now = 0.0  # virtual time: the pickers' clock (their pressure and spike rules average over it)
        self.pickers = [Picker(replace(policy, rule=rule, replicas=pickers), rng=random.Random(seed * 31 + k),
                               clock=lambda: self.now) for k in range(pickers)]
        self.trends = [Trend()] * n
        knobs = Knobs()
        self.knobs = knobs
        self.envoy = _Envoy(self.rng, n, knobs.choice_count, knobs.active_request_bias)
        self.published: list[int] = [static_weight(fleet.seqs)] * n
        self.envoy.set_weights(self.published, self.active)
        self.streaks = [0] * n
        self.errors: list[float] = []
        self.ratios: list[float] = []  # observed / predicted
        self._probe()

    # -- the sidecar's view ---------------------------------------------------------------

    def _probe(self) -> None:
        facts = []
        samples = []
        for i, eng in enumerate(self.engines):
            itl, pre, gen = eng.histograms["itl"], eng.histograms["prefill"], eng.histograms["generation_tokens"]
            c = eng.counters
            sample = LoadSample(running=len(eng.running), waiting=len(eng.waiting), kv_usage=eng.kv_usage(),
                                token_latency_s=itl.total, token_latency_n=float(itl.count))
            samples.append(sample)
            self.trends[i] = self.trends[i].observe(sample, 0.0, self.knobs.policy)
            facts.append(EndpointFacts(
                address=self.addresses[i], serving=True, capacity=self.fleet.seqs, running=sample.running,
                waiting=sample.waiting, kv_usage=sample.kv_usage, token_latency_s=self.trends[i].token_latency_s,
                kv_blocks=self.fleet.kv_tokens // BLOCK, itl_sum=itl.total, itl_count=float(itl.count),
                prefill_seconds=pre.total, prefill_tokens=float(c.prompt_tokens - c.prefix_hits_tokens),
                finished=float(gen.count), finished_tokens=gen.total,
                # vLLM's finish reasons (`reasons`: TGI and llama.cpp report none)
                finished_bounded=float(c.requests_finished.get("length", 0)) if self.reasons else None))
        for store in self.stores:
            store.update([PoolFacts("pool", ("m",), tuple(facts))], {"m": "pool", None: "pool"})
        if self.router == "lr":
            nxt, self.streaks = sidecar_weights(samples, self.trends, [self.fleet.seqs] * len(samples), self.published,
                                                self.streaks, self.knobs.policy, self.knobs.hysteresis,
                                                max_weight=self.knobs.policy.max_weight)
            if nxt != self.published:
                self.published = nxt
                self.envoy.set_weights(nxt, self.active)

    # -- routing --------------------------------------------------------------------------

    def route(self, t: Turn) -> tuple[int | None, int | None, Prediction | None]:
        """(worker or None: refused, picker index, the prediction)."""
        n = len(self.engines)
        if self.router == "lr":
            return self.envoy.pick(self.active), None, None
        if self.router == "p2c":
            a, b = self.rng.sample(range(n), 2)
            return (a if self.active[a] <= self.active[b] else b), None, None
        k = self.rng.randrange(len(self.pickers))
        store, picker = self.stores[k], self.pickers[k]
        tokens = len(t.blocks) * BLOCK
        prompt = PromptInfo("m", "x" * (tokens * CHARS_PER_TOKEN), self.max_tokens or t.output, home=t.home_key,
                            history_chars=t.history_tokens * CHARS_PER_TOKEN,
                            home_chars=t.home_tokens * CHARS_PER_TOKEN)
        hashes = [_hash(b) for b in t.blocks]
        pick = picker.pick(PickRequest("pool", prompt, hashes, traffic_class=t.traffic_class, saturated=self.verdict),
                           store.endpoints("pool"))
        if pick.refused_for_s is not None:
            return None, k, pick.predicted
        chosen = pick.endpoints[0]
        chosen.in_flight += 1
        chosen.index.add(hashes)
        return self.addresses.index(chosen.address), k, pick.predicted

    def release(self, worker: int, k: int | None) -> None:
        if k is not None:
            e = next(x for x in self.stores[k].endpoints("pool") if x.address == self.addresses[worker])
            e.in_flight = max(0, e.in_flight - 1)


def _oneshot(rng: random.Random, mix: str, t: float, i: int) -> Turn:
    (plo, phi), (olo, ohi) = MIXES[mix]
    prompt = int(math.exp(rng.uniform(math.log(plo), math.log(phi))))
    return Turn(tuple(_blocks(f"o{i}", max(1, prompt // BLOCK))), rng.randint(olo, ohi), t)


def run(fleet: Fleet, workload: str, router: str, seed: int, *, load: float = 0.8, requests: int = 2400,
        policy: PickerPolicy | None = None, mix: str = "chat",
        surge: tuple[float, float, float] | None = None, classes: tuple[float, float] = (0.0, 0.0),
        bursty: bool = False, max_tokens: int = 0, reasons: bool = True, verdict: bool = True) -> Result:
    """`surge`: (start s, seconds, load) of a one-shot surge over `load`; `classes`: the shares
    of critical and sheddable requests (the rest standard); `bursty`: the one-shot arrivals on/off
    as the real bench's bursty fleet (bench._workload.bursty: 2 s at 1.75x the mean, 2 s at 0.25x);
    `max_tokens`: the max_tokens every client sends, a bound its answers stop short of (0: each request's
    exact answer length, as the bench's clients send); `reasons`: the engines report how many answers ran
    to their max_tokens (vLLM's finish reasons; TGI and llama.cpp do not)."""
    sim = _Sim(fleet, router, seed, policy or PickerPolicy(), max_tokens, reasons, verdict)
    rng = random.Random(seed)
    # capacity: requests/s a worker sustains with full batches (as bench.sweep's Shape estimates)
    shot_capacity = Shape("x", fleet.speeds, fleet.seqs, mix=mix, decode_ms=fleet.decode_ms).capacity_rps()
    out_mean, prompt_mean = 32.0, 3500.0 * 0.5  # half the prompt tokens cached (the bench's HIT_REF)
    conv_capacity = 0.0
    for s in fleet.speeds:
        step = fleet.decode_ms * (1 + DECODE_GROWTH * (fleet.seqs - 1)) / 1000
        conv_capacity += s * fleet.seqs / (out_mean * step + fleet.seqs * PREFILL_MS_PER_1K * prompt_mean / 1e6)
    events: Events[object] = Events()  # kinds: STEP, 1 a conversation's next turn, 2 a one-shot, 3 a probe

    conv_share = {"chat": 1.0, "hot": 1.0, "oneshot": 0.0, "mix": 0.5}[workload]
    rate = load / (conv_share / conv_capacity + (1 - conv_share) / shot_capacity)
    mean_turns = 12.0
    conv_rate = rate * conv_share / mean_turns
    shot_rate = rate * (1 - conv_share)
    convs: list[Conversation] = []
    total = 0
    t = 0.0
    if conv_rate > 0:
        while total < requests * conv_share:
            t += rng.expovariate(conv_rate)
            c = Conversation(system=rng.randint(1000, 3000) // BLOCK, first_user=rng.randint(3, 15),
                             turns=rng.randint(8, 16), start=t,
                             think_rng=random.Random(rng.random()))
            convs.append(c)
            total += c.turns
            events.push(t, 1, len(convs) - 1)
    t = 0.0
    shots = 0
    if shot_rate > 0:
        while shots < requests * (1 - conv_share):
            factor = surge[2] / load if surge is not None and surge[0] <= t < surge[0] + surge[1] else 1.0
            if bursty:  # thinning of a 1.75x process: every arrival on, 0.25 / 1.75 of them off
                t += rng.expovariate(shot_rate * factor * BURST_PEAK)
                if (t % BURST_PERIOD_S) >= BURST_PERIOD_S / 2 and rng.random() >= (2 - BURST_PEAK) / BURST_PEAK:
                    continue
            else:
                t += rng.expovariate(shot_rate * factor)
            turn = _oneshot(rng, mix, t, shots)
            u = rng.random()
            turn.traffic_class = ("critical" if u < classes[0] else
                                  "sheddable" if u < classes[0] + classes[1] else "standard")
            events.push(t, 2, turn)
            shots += 1
    shared = _blocks("sys", 2000 // BLOCK)  # "hot": one system prompt shared by every conversation
    steps = Steps(events, sim.engines)
    lat: list[float] = []
    ttft: list[float] = []
    pending: dict[int, tuple[Turn, int, int | None, Prediction | None]] = {}
    diag: list[tuple[Prediction, float, float, float]] = []

    records: list[tuple[float, float | None, str]] = []

    def submit(turn: Turn, now: float) -> None:
        worker, k, predicted = sim.route(turn)
        if worker is None:
            records.append((now, None, turn.traffic_class))
            return
        # an answer runs to the max_tokens its client sends, or (--max-tokens, a looser bound) stops short of it
        req = EngineRequest(f"r{len(pending)}-{now}", prompt_tokens=len(turn.blocks) * BLOCK, max_tokens=turn.output,
                            finish_reason="stop" if sim.max_tokens else "length",
                            arrival=now, cache_key=turn.blocks)
        pending[id(req)] = (turn, worker, k, predicted)
        classes_by_id[id(req)] = turn.traffic_class
        sim.active[worker] += 1
        sim.routed[worker] += 1
        sim.engines[worker].submit(req, now)
        steps.schedule(worker)
        requests_by_id[id(req)] = req

    requests_by_id: dict[int, EngineRequest] = {}
    classes_by_id: dict[int, str] = {}
    events.push(1.0, 3, None)
    measured_from = 0.0
    for now, kind, payload in events:
        sim.now = now
        if kind == STEP:
            i = payload
            assert isinstance(i, int)
            for r in steps.finished(i, now):
                turn, worker, k, predicted = pending.pop(id(r))
                sim.active[worker] -= 1
                sim.release(worker, k)
                if now >= measured_from:
                    lat.append(now - r.arrival)
                    records.append((r.arrival, now - r.arrival, classes_by_id.pop(id(r), "standard")))
                    ttft.append((r.first_token_at or now) - r.arrival)
                    if predicted is not None:
                        sim.errors.append(abs(predicted.own_s - (now - r.arrival)) / max(1e-3, now - r.arrival))
                        sim.ratios.append((now - r.arrival) / max(1e-3, predicted.own_s))
                        adm = r.admitted_at or r.arrival
                        first = r.first_token_at or now
                        diag.append((predicted, adm - r.arrival, first - adm, now - first))
                if turn.conv is not None:
                    c = convs[turn.conv]
                    c.blocks.extend(_blocks(f"c{turn.conv}.a{turn.turn}", max(1, turn.output // BLOCK)))
                    if c.done_turns < c.turns:
                        events.push(now + max(1.0, c.think_rng.expovariate(1 / 2.0)), 1, turn.conv)
        elif kind == 1:
            ci = payload
            assert isinstance(ci, int)
            c = convs[ci]
            system = shared if workload == "hot" else _blocks(f"c{ci}.s", c.system)
            history = len(system) + len(c.blocks) if c.done_turns else 0
            if c.done_turns == 0:
                c.blocks = _blocks(f"c{ci}.u0", c.first_user)
            else:
                c.blocks.extend(_blocks(f"c{ci}.u{c.done_turns}", rng.randint(2, 15)))
            blocks = tuple(system + c.blocks)
            turn = Turn(blocks, rng.randint(16, 48), now, ci, c.done_turns, home_key=_hash(f"c{ci}"),
                        history_tokens=history * BLOCK, home_tokens=(len(system) + c.first_user) * BLOCK)
            c.done_turns += 1
            submit(turn, now)
        elif kind == 2:
            assert isinstance(payload, Turn)
            submit(payload, now)
        elif kind == 3:
            sim._probe()
            if events.any_but(3):
                events.push(now + 1.0, 3, None)
    c_all = [e.counters for e in sim.engines]
    hits = sum(x.prefix_hits_tokens for x in c_all) / max(1, sum(x.prompt_tokens for x in c_all))
    routed = sum(sim.routed) or 1
    if diag and DIAGNOSE:
        def m(xs: list[float]) -> str:
            return f"{statistics.fmean(xs):.3f}"
        print(f"  predicted wait/prefill/decode {m([d[0].wait_s for d in diag])} {m([d[0].prefill_s for d in diag])} "
              f"{m([d[0].decode_s for d in diag])} | actual {m([d[1] for d in diag])} {m([d[2] for d in diag])} "
              f"{m([d[3] for d in diag])}", file=sys.stderr)
    return Result(lat, ttft, hits, [r / routed for r in sim.routed],
                  statistics.median(sim.errors) if sim.errors else None, records,
                  statistics.median(sim.ratios) if sim.ratios else None)


# KV caches that hold a run's conversations (the prefix bench's regime: the fleet's caches hold
# about every distinct block a run sends), so hits measure routing, not eviction.
CHAT_FLEETS = (
    Fleet("4 equal, seqs 8", (1.0,) * 4, 8, kv_tokens=163_840),
    Fleet("4 (1, 1, 0.6, 0.6), seqs 8", (1.0, 1.0, 0.6, 0.6), 8, kv_tokens=163_840),
    Fleet("8 equal, seqs 16", (1.0,) * 8, 16, kv_tokens=163_840),
)


def _fleets_oneshot() -> list[tuple[Fleet, str]]:
    out = [(Fleet("3w one 2.2x slower, seqs 8", (1.0, 1.0, 1 / 2.2), 8, 30.0, KV_CACHE_TOKENS), "chat")]
    for s in MATRIX:
        if s.slowdown or s.bursty or len(s.speeds) > 12:
            continue
        out.append((Fleet(s.name, s.speeds, s.max_num_seqs, s.decode_ms, KV_CACHE_TOKENS), s.mix))
    return out


OVERLOAD_FLEETS = (
    Fleet("uneven (1, 1, 0.5), seqs 8", (1.0, 1.0, 0.5), 8, 30.0, KV_CACHE_TOKENS),
    Fleet("4 equal, seqs 8", (1.0,) * 4, 8, 30.0, KV_CACHE_TOKENS),
    Fleet("12 mixed (6x1, 3x0.75, 3x0.5), seqs 4", (1.0,) * 6 + (0.75,) * 3 + (0.5,) * 3, 4, 30.0, KV_CACHE_TOKENS),
)
# The real bench's overload fleets (bench/scenarios/overload.py: decode 20 ms, its one-shot mix; the
# 12-worker fleet's 16/8 slots as 12 each here); the uneven one is also its bursty fleet.
BENCH_FLEETS = (
    Fleet("bench uneven (1, 1, 0.5), seqs 8", (1.0, 1.0, 0.5), 8, 20.0, KV_CACHE_TOKENS),
    Fleet("bench 4 equal, seqs 8", (1.0,) * 4, 8, 20.0, KV_CACHE_TOKENS),
    Fleet("bench 12 (4x1, 4x0.75, 4x0.5), seqs 12", (1.0,) * 4 + (0.75,) * 4 + (0.5,) * 4, 12, 20.0,
          KV_CACHE_TOKENS),
)
# The real bench's one-shot matrix (bench/scenarios/_fleets.MATRIX) where every worker has the same
# slots: its speeds, slots, decode step and request mixes (prompt-heavy and output-heavy their own),
# bursty arrivals on its bursty fleet; `--matrix-fleets` runs the routing tables on these at 78 %.
MATRIX_FLEETS = (
    (Fleet("bench wide (1, 1, 0.35), seqs 8", (1.0, 1.0, 0.35), 8, 20.0, KV_CACHE_TOKENS), "bench", False),
    (Fleet("bench narrow (1, 0.9, 0.8, 0.8), seqs 16", (1.0, 0.9, 0.8, 0.8), 16, 40.0, KV_CACHE_TOKENS), "bench",
     False),
    (Fleet("bench equal (4x1), seqs 8", (1.0,) * 4, 8, 25.0, KV_CACHE_TOKENS), "bench", False),
    (Fleet("bench prompt-heavy (1, 1, 0.5), seqs 8", (1.0, 1.0, 0.5), 8, 20.0, KV_CACHE_TOKENS), "bench_prompt",
     False),
    (Fleet("bench output-heavy (1, 0.7, 0.5), seqs 8", (1.0, 0.7, 0.5), 8, 15.0, KV_CACHE_TOKENS), "bench_output",
     False),
    (Fleet("bench bursty (1, 1, 0.5), seqs 8", (1.0, 1.0, 0.5), 8, 20.0, KV_CACHE_TOKENS), "bench", True),
)
MATRIX_LOAD = 0.78  # bench/scenarios/_fleets.FleetPlan.load
SURGES = ((1.18, 30.0), (1.5, 15.0), (3.0, 5.0))
BASE = 0.78
SURGE_AT = 60.0
FROM_S = 4.0  # measured from the surge's 5th second (a 5 s spike: its last second), as the real bench
BURST_PERIOD_S, BURST_PEAK = 4.0, 1.75  # bench._workload.WorkloadSpec's bursty arrivals


def _q(values: Sequence[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(p * len(s) + 0.5) - 1))] if s else math.nan


def overload(seeds: Sequence[int], policy: PickerPolicy, fleets: Sequence[Fleet] = OVERLOAD_FLEETS,
             mix: str = "chat") -> list[str]:
    """Per fleet: the steady run at 78 % (its refusals, its P99) and a bursty one (refusals), then each
    surge: the share refused from the surge's 5th second on against the excess, the admitted P99
    against the steady one; then three classes at 150 % (20 % critical, 30 % sheddable)."""
    lines = ["| fleet | surge | shed (excess) | admitted P99 / own at 78 % | classes: critical / sheddable / "
             "standard shed "
             "(standard's share of the excess not absorbed by sheddable) |", "|---|---|---|---|---|"]
    for fleet in fleets:
        cap = Shape("x", fleet.speeds, fleet.seqs, mix=mix, decode_ms=fleet.decode_ms).capacity_rps()
        steady = [run(fleet, "oneshot", "predicted", s, load=BASE, requests=int(cap * BASE * 120), policy=policy,
                      mix=mix) for s in seeds]
        own = statistics.median(_q([lat for at, lat, _c in r.records if lat is not None and at > SURGE_AT], 0.99)
                                for r in steady)
        refused78 = sum(1 for r in steady for _, lat, _ in r.records if lat is None)
        total78 = sum(len(r.records) for r in steady)
        lines.append(f"| {fleet.name} | 78 % steady | {refused78} of {total78} | P99 {own:.2f} s | |")
        print(lines[-1], file=sys.stderr, flush=True)
        burst = [run(fleet, "oneshot", "predicted", s, load=BASE, requests=int(cap * BASE * 120), policy=policy,
                     mix=mix, bursty=True) for s in seeds]
        refused = sum(1 for r in burst for _, lat, _ in r.records if lat is None)
        lines.append(f"| {fleet.name} | 78 % bursty | {refused} of {sum(len(r.records) for r in burst)} | | |")
        print(lines[-1], file=sys.stderr, flush=True)
        for load, dur in (*SURGES, (1.5, 15.0)):
            with_classes = (load, dur) == (1.5, 15.0) and lines[-1].startswith(f"| {fleet.name} | 300")
            count = int(cap * BASE * (SURGE_AT + dur + 30) + cap * (load - BASE) * dur)
            runs = [run(fleet, "oneshot", "predicted", s, load=BASE, requests=count, policy=policy, mix=mix,
                        surge=(SURGE_AT, dur, load), classes=(0.2, 0.3) if with_classes else (0.0, 0.0))
                    for s in seeds]
            window = [rec for r in runs for rec in r.records if SURGE_AT + FROM_S <= rec[0] < SURGE_AT + dur]
            shed = sum(1 for rec in window if rec[1] is None) / max(1, len(window))
            p99 = _q([rec[1] for rec in window if rec[1] is not None], 0.99)
            excess = 1 - 1 / load
            cls = ""
            if with_classes:
                def share(c: str, window: list[tuple[float, float | None, str]] = window) -> float:
                    rows = [rec for rec in window if rec[2] == c]
                    return sum(1 for rec in rows if rec[1] is None) / max(1, len(rows))
                left = max(0.0, excess - 0.3) / 0.5  # the excess sheddable traffic cannot absorb, over standard
                cls = (f"{share('critical') * 100:.1f} % / {share('sheddable') * 100:.1f} % / "
                       f"{share('standard') * 100:.1f} % ({left * 100:.1f} %)")
            lines.append(f"| {fleet.name} | {load * 100:.0f} % {dur:.0f} s{' classes' if with_classes else ''} | "
                         f"{shed * 100:.1f} % ({excess * 100:.1f} %) | {p99 / own:.2f}x | {cls} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def _row(name: str, r: Result, fair: float) -> str:
    lat, tt = r.lat, r.ttft
    err = f"{r.err * 100:.0f} %" if r.err is not None else "-"
    if r.bias is not None:
        err += f" ({r.bias:.2f})"
    refused = sum(1 for rec in r.records if rec[1] is None)
    return (f"| {name} | {r.q(lat, .5):.2f} | {r.q(lat, .9):.2f} | {r.q(lat, .99):.2f} | {statistics.fmean(lat):.2f} "
            f"| {r.q(tt, .5):.3f} | {r.q(tt, .99):.2f} | {r.hits * 100:.1f} % | {max(r.shares) * 100 - fair:+.1f} / "
            f"{min(r.shares) * 100 - fair:+.1f} | {err} | {refused} |")


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep.picker")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--workloads", default="chat,oneshot,mix")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--requests", type=int, default=2400)
    ap.add_argument("--fleets", default="", help="only fleets whose name contains this")
    ap.add_argument("--set", action="append", default=[], help="a --picker KEY=VALUE override")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="the max_tokens every client sends, a bound the answers stop short of (0: exact lengths)")
    ap.add_argument("--no-finish-reasons", action="store_true",
                    help="the engines do not say how many answers ran to their max_tokens (TGI, llama.cpp)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--overload", action="store_true", help="the admission table instead of the routing tables")
    ap.add_argument("--bench-fleets", action="store_true",
                    help="--overload on the real bench's fleets and one-shot mix (decode 20 ms)")
    ap.add_argument("--matrix-fleets", action="store_true",
                    help="one-shot routing on the real bench's matrix fleets (same slots everywhere) at 78 %%")
    args = ap.parse_args(argv)
    global DIAGNOSE
    DIAGNOSE = args.diagnose
    policy = PickerPolicy().with_overrides(args.set)
    seeds = [int(s) for s in args.seeds.split(",")]
    lines: list[str] = []
    if args.overload:
        fleets, mix = (BENCH_FLEETS, "bench") if args.bench_fleets else (OVERLOAD_FLEETS, "chat")
        text = "\n".join(overload(seeds, policy, fleets, mix)) + "\n"
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
    workloads = ["oneshot"] if args.matrix_fleets else args.workloads.split(",")
    for workload in workloads:
        cases: list[tuple[Fleet, str, bool]] = (
            list(MATRIX_FLEETS) if args.matrix_fleets else
            [(f, "chat", False) for f in CHAT_FLEETS] if workload != "oneshot" else
            [(f, m, False) for f, m in _fleets_oneshot()])
        load = MATRIX_LOAD if args.matrix_fleets else 0.8
        for fleet, mix, bursty in cases:
            if args.fleets and args.fleets not in fleet.name:
                continue
            lines.append(f"\n### {workload} on {fleet.name}" + (f" ({mix} mix)" if workload == "oneshot" else ""))
            lines.append("| router | P50 s | P90 s | P99 s | mean s | TTFT P50 s | TTFT P99 s | hits | "
                         "busiest / idlest share vs fair (points) | predictor error (median; median observed / "
                         "predicted) | refused |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
            for router in args.routers.split(","):
                results = [run(fleet, workload, router, s, load=load, requests=args.requests, policy=policy, mix=mix,
                               bursty=bursty, max_tokens=args.max_tokens, reasons=not args.no_finish_reasons,
                               verdict=not args.matrix_fleets)
                           for s in seeds]
                merged = Result([x for r in results for x in r.lat], [x for r in results for x in r.ttft],
                                statistics.fmean(r.hits for r in results),
                                [max(r.shares) for r in results] + [min(r.shares) for r in results],
                                statistics.median(r.err for r in results if r.err is not None)
                                if any(r.err is not None for r in results) else None,
                                [rec for r in results for rec in r.records],
                                statistics.median(r.bias for r in results if r.bias is not None)
                                if any(r.bias is not None for r in results) else None)
                merged.shares = [statistics.fmean(max(r.shares) for r in results),
                                 statistics.fmean(min(r.shares) for r in results)]
                lines.append(_row(router, merged, 100 / len(fleet.speeds)))
                print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

