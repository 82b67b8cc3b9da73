"""Filters, scorers and the picker: how one endpoint is chosen for one request.

The shape of the inference extension's scheduler: filters narrow the candidates, a scorer
values each, the picker takes the best. Two rules (`PickerPolicy.rule`):

`predicted` (the default): each candidate's value is a predicted cost in seconds
(predict.py): when this request would finish there (the queue ahead of it, the prefill of
the prompt blocks the endpoint probably does not hold, the decode of its tokens at the
endpoint's speed under its batch) plus what its admission costs the requests already
running there. The cheapest wins; candidates within `tie_s` / `tie_share` of it are equal,
and among equals a conversation goes to its rendezvous home (the highest hash of its
identity and the endpoint's address: every picker replica computes the same one) and any
other request to a random one. A follow-up turn this picker has no record of (its earlier
turns went through another replica, or before a restart) is assumed to be cached at its
rendezvous home, so two pickers send one conversation to one place. A pool in which no
endpoint has a measured time per token falls back to the weighted rule.

`weighted` (the earlier rule, kept as the fallback): a weighted sum of four scores in [0, 1]:

    load(e)   = max(in_flight(e), running(e) + waiting(e))          requests
    spill(e)  = max(spill_min, spill_fraction * capacity(e))        requests
    prefix(e) = matched blocks / prompt blocks * min(1, prompt tokens / (prompt_share * max_tokens)),
                0 once load(e) - min load > spill(e)
    load(e)   = 1 - min(1, (slow(e) load(e) - min of the same) / capacity(e))
    kv(e)     = 1 - KV cache use
    cost(e)   = 1 - f * (1 - t_min / t(e)),  t(e) = time per token(e) * (1 + load(e) / capacity(e))
    score(e)  = 3 prefix + 2 load + 1 kv + 2 cost

The answer is the best endpoint then `fallbacks` more in order, for the proxy's retries.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from hashlib import blake2b
from typing import Protocol

from .admission import Admission, WaitBudgets
from .datastore import Endpoint
from .lateness import LATE_S
from .predict import CostPolicy, Estimate, Prediction, Workload, expected_output, pool_estimates, predict
from .prompt import CHARS_PER_TOKEN, PromptInfo

__all__ = ["COST_KEYS", "FILTERS", "POLICY_KEYS", "SCORERS", "Pick", "PickRequest", "Picker", "PickerPolicy",
           "Scorer", "free_slots"]


RULES = ("predicted", "weighted")

# What `PickerPolicy.with_overrides` (--picker KEY=VALUE) accepts besides `rule` and a scorer's
# name (SCORERS: its weight), with each value's type: these PickerPolicy fields ...
POLICY_KEYS: Mapping[str, type[float] | type[int]] = {
    "spill_min": float, "spill_fraction": float, "prompt_share": float, "long_tokens": int,
    "default_max_tokens": int, "fallbacks": int, "tie_s": float, "tie_share": float, "replicas": int,
    "budget_standard": float, "budget_sheddable": float, "budget_floor_s": float, "budget_step": int,
    "slow_share": float,
    "admission_gate": int, "pressure_s": float, "open_share": float, "hold_ratio": float, "spike_ratio": float,
    "spike_s": float, "spike_min": int, "late_s": float, "bypass_max": int, "bypass_wait_s": float, "hold": int,
    "hold_max_s": float}
# ... and these fields of its CostPolicy (predict.py)
COST_KEYS: Mapping[str, type[float] | type[int]] = {
    "externality": float, "queue_externality": float, "growth": float, "prefill_ratio": float,
    "default_output": int, "output_cap": float}


@dataclass(frozen=True, slots=True)
class PickerPolicy:
    rule: str = "predicted"  # RULES
    cost: CostPolicy = field(default_factory=CostPolicy)
    tie_s: float = 0.005  # candidates this close to the cheapest (seconds) are equal ...
    tie_share: float = 0.05  # ... or this close, as a share of its cost (speeds measured within ~5 % are noise)
    block_tokens: int = 16  # prompt tokens one hashed block stands for (64 characters)
    replicas: int = 1  # pickers that share the fleet (each sees only the requests through it)
    # Admission (predicted rule only): a request is placed where its predicted delay (its wait
    # there, plus `slow_share` of the time its prefill and decode there take past its best case:
    # the fastest prefill and decode the pool offers it now) stays within its class's budget, and
    # refused at once (429) where nowhere does. A queue delays it, so does a slower worker: under
    # overload a long request is refused rather than decoded on a worker that would take far
    # longer, a short one is admitted there. The budget is this many times the pool's mean service
    # time (what one request holds a slot for), at least `budget_floor_s`; critical traffic is
    # never refused by the picker.
    # 0.4, not 0.5: the admitted requests of a surge wait at most 0.4 of a service time. On the
    # real-Envoy overload bench (bench/results/lobby/budget-0.4-open-0.5, 3 fleets, 118 % and 150 %
    # surges and the uneven fleet's 3x, 2 seeds) the admitted P99 stayed within 1.3x the product's own
    # at 78 % on 7 of 8 cells against 3 of 8 at 0.5 (equal fleet 1.25 / 1.28x against 1.34 / 1.37x),
    # the worst unchanged (12 workers at 118 %, 1.42x). The pressure still opens at `open_share`
    # (0.5): opening at 0.4 too shed 2 and 26 of 1,254 requests of the bursty fleet at 78 %.
    budget_standard: float = 0.4
    budget_sheddable: float = 0.03
    budget_floor_s: float = 0.0
    # 1: a standard request may always wait one slot's share of a service time on the endpoint with the fewest
    # slots (the least wait predicted once the slots are taken): on endpoints of one or two slots that step is
    # past the standard budget, and standard was refused exactly when sheddable was (130 % load, one slot:
    # 42 % against 46 %). 0: the budget alone. Pools of 4 slots or more are unchanged at the default budget.
    budget_step: int = 1
    # 0.5, measured on the real-Envoy bench (bench/results/admission-delay, uneven fleet 1x/1x/0.5x):
    # at 1 (the whole slowness, as before) a slow worker's free slots go unused under overload and
    # the pool sheds more than the excess (3x: 71.7 % against 66.7 %; standard traffic at 150 % with
    # classes 13.7 % against a bound of 11.7 %); at 0 (the wait alone) the share is exact but long
    # requests decode on the slow worker (admitted P99 1.48x its own at 78 % at 118 %); at 0.5 both
    # hold (shed 15.6 / 32.2 / 69.3 %, admitted P99 1.27 / 1.27 / 0.85x, standard 10.4 %).
    slow_share: float = 0.5
    # 1: refuse only under a standing queue, not a burst a 78 % load brings (measured on the
    # real-Envoy matrix, refusing on every prediction shed 17 % of its bursty fleet at 78 %): while
    # the pool's saturation verdict holds (sidecar.decide.saturation, once per probe cycle) or the
    # picker's own pressure does (`Pressure`: the pool's best predicted start, smoothed over
    # `pressure_s`, past `open_share` of a service time; it ends once under half the sheddable budget).
    # 0: whenever the prediction says so.
    admission_gate: int = 1
    pressure_s: float = 2.0  # 0: the verdict alone opens the gate
    # The pressure opens once that average reaches this many times the pool's median service time, at
    # least the standard budget: a level the bursty fleet's bursts at 78 % do not reach (0.5: 0 shed of
    # 2 x 1,254 requests; 0.4: 2 and 26). The spike rule stays at the standard budget, the queue
    # admission holds (bench/results/spike-rule measured it there).
    open_share: float = 0.5
    # Once open, the pressure holds while requests arrive (averaged over `pressure_s`) at
    # `hold_ratio` times what the pool serves or faster, however short the queue admission keeps:
    # a surge that admission holds at its budget leaves the best worker's start near nothing, and
    # closing then admits the surge whole until a new backlog reopens it (measured: 12 workers at
    # 118 % opened, closed and reopened every 10-15 s, in flight up to twice their slots). 0.9, not
    # 1.0: a pool serves more than its nominal capacity with full batches, so a 118 % surge reads
    # 1.02-1.17 (12 workers, sampled) and at 1.0 it still closed once; 78 % reads about 0.72.
    # 0: the queue alone decides.
    hold_ratio: float = 0.9
    # ... or a spike does (`Spike`): over the last `spike_s` requests arrived at `spike_ratio` times
    # what the pool serves or faster while the best predicted start is past the standard budget:
    # the gate opens at once instead of after most of `pressure_s`, whose backlog a short spike
    # would then shed for seconds. A 78 % fleet's bursts (1.75x for 2 s at the most measured)
    # stay under it. 0: no spike rule. Chosen on the real-Envoy bench (bench/results/spike-rule): with
    # it a 3x spike for 5 s sheds 64.3-69.0 % of its last second on the three overload fleets (excess
    # 66.7 %; 83.1 % on 12 workers without); at spike_min 20 the bursty fleet at 78 % shed 4 + 1 of
    # 2 x 1,254 requests, at 40 none.
    spike_ratio: float = 2.0
    spike_s: float = 0.5
    spike_min: int = 40  # arrivals in the window at the least (a few requests on a slow pool are no rate)
    weights: tuple[tuple[str, float], ...] = (("prefix", 3.0), ("load", 2.0), ("kv", 1.0), ("cost", 2.0))
    spill_min: float = 2.0  # requests
    spill_fraction: float = 0.25  # of the endpoint's capacity
    long_tokens: int = 512  # a generation this long or longer weighs cost fully
    default_max_tokens: int = 256  # when the request says nothing
    prompt_share: float = 0.5  # prefix counts fully while prompt tokens >= this x max_tokens
    fallbacks: int = 2  # endpoints after the first, for retries
    # A request that reaches the picker this many seconds late (its age, from the proxy's
    # request.time, past the floor of recent ages: lateness.py) is answered at once without a
    # pick: at a rate the picker cannot keep up with it sheds its own work, not the client's time.
    late_s: float = LATE_S
    # While requests keep reaching it late, Envoy skips the picker for a share of them (bypass.py:
    # raised by the share read `bypass_wait_s` late or more, lowered by 5 points each half second it
    # keeps up), at most `bypass_max` percent (0: never, the late rule alone). At 2,000 req/s on the
    # 2-core bench machine: 62-77 % skipped it, added P99 -7 to +9 ms (bench/results/picker-cost/bypass.md).
    bypass_max: int = 90
    bypass_wait_s: float = 0.005
    # 1: while every slot of a pool is taken and its admission is not on (the gate closed: a burst, or
    # the first seconds of a surge), a request waits in the picker (the lobby, lobby.py) instead of in
    # an engine's queue, and is placed when a slot frees, `hold_max_s` at the most; once admission is
    # on, the requests held are placed or refused with the time they waited counted in their delay.
    # A backlog held here can still be refused, one in the engines' queues can only drain. Critical
    # traffic never waits here, nor does a spike (arrivals at `spike_ratio` times what the pool serves:
    # placed at once, the spike rule opens admission). 0: every request placed at once (engine queues).
    # On by the worst case over the real-Envoy overload bench (bench/results/lobby, 3 fleets x 3 surges,
    # 2 seeds): admitted P99 at most 1.40x the product's own at 78 % against 1.90x without (12 mixed
    # workers at 150 %), shares within 3 points of the excess on 8 of 9 cells against 7; it costs the
    # equal fleet's 118 % / 150 % P99 0.03-0.06.
    hold: int = 1
    hold_max_s: float = 2.0

    @property
    def budgets(self) -> WaitBudgets:
        """The admission budgets of every pool the topology gives none of its own."""
        return WaitBudgets(self.budget_standard, self.budget_sheddable, self.budget_floor_s)

    def with_overrides(self, pairs: Sequence[str]) -> PickerPolicy:
        """This policy with KEY=VALUE pairs applied (a scorer's name sets its weight); ValueError
        naming the pair when one is unknown or out of range."""
        weights = dict(self.weights)
        fields: dict[str, float | int] = {}
        cost: dict[str, float | int] = {}
        rule = self.rule
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if key == "rule" and sep:
                if raw not in RULES:
                    raise ValueError(f"--picker rule: {raw!r} is not one of {list(RULES)}")
                rule = raw
                continue
            if key in COST_KEYS and sep:
                try:
                    number = COST_KEYS[key](raw)
                except ValueError as exc:
                    raise ValueError(f"--picker {key}: {raw!r} is not a {COST_KEYS[key].__name__}") from exc
                if not (0 <= number <= 1e6) or (key in ("default_output", "output_cap") and number <= 0):
                    raise ValueError(f"--picker {key}: {raw} is out of range")
                cost[key] = number
                continue
            kind = float if key in SCORERS else POLICY_KEYS.get(key)
            if not sep or kind is None:
                raise ValueError(f"--picker {pair!r}: expected KEY=VALUE with KEY one of "
                                 f"{sorted(['rule', *SCORERS, *POLICY_KEYS, *COST_KEYS])}")
            try:
                value = kind(raw)
            except ValueError as exc:
                raise ValueError(f"--picker {key}: {raw!r} is not a {kind.__name__}") from exc
            if not (value >= 0 and value == value) or (key in ("long_tokens", "default_max_tokens", "prompt_share")
                                                         and value <= 0) or value > 1e6 \
                    or (key == "bypass_max" and value > 100) or (key == "budget_step" and value > 1):
                raise ValueError(f"--picker {key}: {raw} is out of range")
            if key in SCORERS:
                weights[key] = float(value)
            else:
                fields[key] = value
        # from this policy, not the class defaults: what the caller set (replicas from --ingresses) stays
        return replace(self, rule=rule, cost=replace(self.cost, **cost),  # type: ignore[arg-type]
                       weights=tuple(weights.items()), **fields)  # type: ignore[arg-type]


@dataclass(slots=True)
class PickRequest:
    pool: str
    prompt: PromptInfo | None
    hashes: Sequence[int]
    subset: frozenset[str] | None = None
    traffic_class: str = "standard"  # critical | standard | sheddable
    saturated: bool = True  # the pool's saturation verdict (admission_gate: refuse only then)
    waited_s: float = 0.0  # held in the picker this long before this pick: counted in its delay
    observed: bool = False  # its arrival was counted already (`Picker.observe_held`): not again at the pick
    # filled in while scoring, read by the metrics
    matched: dict[str, int] = field(default_factory=dict)

    @property
    def home(self) -> int | None:
        return self.prompt.home if self.prompt is not None else None


def load_of(e: Endpoint) -> float:
    """Requests on the endpoint now: this picker's own (exact), its peer replicas' (as of their last
    batch) and the rest its engine last reported."""
    return e.in_flight + e.peers + e.bypass


# KV cache use from which requests waiting beside free slots mean the cache, not the batch, bounds
# the engine. Below it they are only between two scheduler steps (an engine admits arrivals at the
# start of its next step): a scrape sees that on a busy worker all the time.
KV_BOUND_USAGE = 0.9


def _slots(e: Endpoint) -> int:
    """The sequences the endpoint runs at once: its capacity, or, when its KV cache is full and
    requests wait beside free slots, what it runs now."""
    f = e.facts
    if f.waiting >= 1 and 1 <= f.running < f.capacity and (f.kv_usage or 0.0) >= KV_BOUND_USAGE:
        return max(1, int(f.running))
    return max(1, f.capacity)


def free_slots(endpoints: Sequence[Endpoint]) -> int:
    """Slots no request holds now on the serving endpoints (a request counts whole: 0.3 of one seen by
    a peer takes a slot)."""
    return sum(max(0, _slots(e) - math.ceil(load_of(e) - 1e-9)) for e in endpoints if e.facts.serving)


class Scorer(Protocol):
    def __call__(self, req: PickRequest, cands: Sequence[Endpoint], policy: PickerPolicy) -> list[float]: ...


def _spill(e: Endpoint, policy: PickerPolicy) -> float:
    return max(policy.spill_min, policy.spill_fraction * e.facts.capacity)


def score_prefix(req: PickRequest, cands: Sequence[Endpoint], policy: PickerPolicy) -> list[float]:
    if not req.hashes:
        return [0.0] * len(cands)
    floor = min(load_of(e) for e in cands)
    worth = min(1.0, req.prompt.prompt_tokens / (policy.prompt_share * _wanted(req, policy))) if req.prompt else 1.0
    out = []
    for e in cands:
        n = e.index.match(req.hashes)
        req.matched[e.address] = n
        out.append(0.0 if load_of(e) - floor > _spill(e, policy) else worth * n / len(req.hashes))
    return out


def _wanted(req: PickRequest, policy: PickerPolicy) -> int:
    """Output tokens the request may generate (its max_tokens, else the policy's default)."""
    return req.prompt.max_tokens if req.prompt is not None and req.prompt.max_tokens else policy.default_max_tokens


def _slowness(cands: Sequence[Endpoint]) -> list[float]:
    """Each endpoint's time per token over the fastest's (>= 1; 1 when not measured)."""
    known = [e.facts.token_latency_s for e in cands if e.facts.token_latency_s]
    fastest = min(known) if known else None
    return [e.facts.token_latency_s / fastest if fastest and e.facts.token_latency_s else 1.0 for e in cands]


def score_load(req: PickRequest, cands: Sequence[Endpoint], policy: PickerPolicy) -> list[float]:
    # A request in flight on a worker half as fast holds it twice as long: count it twice.
    loads = [load_of(e) * s for e, s in zip(cands, _slowness(cands), strict=True)]
    floor = min(loads)
    return [1.0 - min(1.0, (load - floor) / max(1, e.facts.capacity)) for e, load in zip(cands, loads, strict=True)]


def score_kv(req: PickRequest, cands: Sequence[Endpoint], policy: PickerPolicy) -> list[float]:
    return [1.0 - min(1.0, max(0.0, e.facts.kv_usage)) if e.facts.kv_usage is not None else 1.0 for e in cands]


def score_cost(req: PickRequest, cands: Sequence[Endpoint], policy: PickerPolicy) -> list[float]:
    f = min(1.0, _wanted(req, policy) / policy.long_tokens)
    known = [e.facts.token_latency_s for e in cands if e.facts.token_latency_s]
    default = sorted(known)[len(known) // 2] if known else 1.0
    times = [(e.facts.token_latency_s or default) * (1.0 + load_of(e) / max(1, e.facts.capacity)) for e in cands]
    best = min(times)
    return [1.0 - f * (1.0 - best / t) if t > 0 else 1.0 for t in times]


SCORERS: dict[str, Scorer] = {"prefix": score_prefix, "load": score_load, "kv": score_kv, "cost": score_cost}


Filter = Callable[[PickRequest, list[Endpoint]], list[Endpoint]]


def filter_serving(req: PickRequest, cands: list[Endpoint]) -> list[Endpoint]:
    return [e for e in cands if e.facts.serving]


def filter_subset(req: PickRequest, cands: list[Endpoint]) -> list[Endpoint]:
    return cands if req.subset is None else [e for e in cands if e.address in req.subset]


FILTERS: dict[str, Filter] = {"subset": filter_subset, "serving": filter_serving}


@dataclass(frozen=True, slots=True)
class Pick:
    endpoints: tuple[Endpoint, ...]  # best first; empty: none eligible
    reason: str  # prefix | spill | load | home | only | none | refused
    matched_blocks: int  # of the chosen endpoint
    prompt_blocks: int
    predicted: Prediction | None = None  # of the chosen endpoint, by the predicted rule
    refused_for_s: float | None = None  # admission: refused, the earliest start this far past its budget


def _rates(cands: Sequence[Endpoint], estimates: Sequence[Estimate]) -> tuple[float, float, int]:
    """The pool's median time one request holds a slot (seconds), the requests per second its slots
    serve, and the fewest slots an endpoint has."""
    slots = [_slots(e) for e in cands]
    holds = [est.out * est.tpot(n) + est.k * est.prompt for n, est in zip(slots, estimates, strict=True)]
    serves = sum(n / max(1e-3, h) for n, h in zip(slots, holds, strict=True))
    return statistics.median(holds), serves, min(slots)


def rendezvous(home: int, address: str) -> int:
    """The endpoint's rank for a conversation (highest wins): the same in every picker replica."""
    digest = blake2b(address.encode(), digest_size=8, key=home.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little")


class Picker:
    """Filters, then the predicted cost (or the weighted scorers), then the best (random among equals) and
    fallbacks; a request whose delay fits its class's budget nowhere in its pool is refused (`admission`)."""

    def __init__(self, policy: PickerPolicy | None = None, *, rng: random.Random | None = None,
                 filters: Sequence[str] = ("subset", "serving"),
                 clock: Callable[[], float] = time.monotonic,
                 pickers: Callable[[], int] | None = None) -> None:
        """`pickers`: how many pickers share the pools' arrivals now, this one included (the
        spike rule scales what it sees by it); default the policy's `replicas`."""
        self.policy = policy or PickerPolicy()
        self._pickers = pickers or (lambda: self.policy.replicas)
        unknown = [n for n, _ in self.policy.weights if n not in SCORERS] + [n for n in filters if n not in FILTERS]
        if unknown:
            raise ValueError(f"unknown scorer or filter: {unknown}")
        self._scorers = [(SCORERS[n], w) for n, w in self.policy.weights if w]
        self._filters = [FILTERS[n] for n in filters]
        self._rng = rng or random.Random()
        # the gate and budgets of each pool, from the predictions made there
        self.admission = Admission(self.policy, pickers=self._pickers, clock=clock)

    def _candidates(self, req: PickRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The endpoints the filters leave for the request."""
        cands = list(endpoints)
        for keep in self._filters:
            cands = keep(req, cands)
        return cands

    def _estimates(self, cands: Sequence[Endpoint]) -> list[Estimate] | None:
        """Each candidate's learned coefficients (None: the pool is not predicted)."""
        return pool_estimates([e.learner for e in cands], [e.facts.token_latency_s for e in cands], self.policy.cost)

    def pick(self, req: PickRequest, endpoints: Sequence[Endpoint]) -> Pick:
        cands = self._candidates(req, endpoints)
        blocks = len(req.hashes)
        if not cands:
            return Pick((), "none", 0, blocks)
        if self.policy.rule == "predicted":
            # one endpoint left too: nothing to choose, but its wait is still predicted and admitted (a pool
            # down to its last worker is when overload comes; the shortcut let every request past admission)
            predicted = self._predicted(req, cands)
            if predicted is not None:
                if len(cands) == 1 and predicted.refused_for_s is None:
                    return replace(predicted, reason="only")
                return predicted
        if len(cands) == 1:
            e = cands[0]
            return Pick((e,), "only", e.index.match(req.hashes), blocks)
        return self._weighted(req, cands)

    def _predicted(self, req: PickRequest, cands: list[Endpoint]) -> Pick | None:
        policy = self.policy
        estimates = self._estimates(cands)
        if estimates is None:
            return None
        prompt = req.prompt
        prompt_tokens = prompt.prompt_tokens if prompt is not None else 1
        wanted = prompt.max_tokens if prompt is not None and prompt.max_tokens else None
        typical = statistics.median(est.out for est in estimates)
        bounds = [est.bound for est in estimates if est.bound is not None]
        # max_tokens bounds the answer; how far it says its length, the engines' finish reasons tell
        output = (expected_output(float(wanted), typical, statistics.median(bounds) if bounds else None,
                                  policy.cost.output_cap) if wanted else typical)
        cached = []
        for e in cands:
            n = e.index.match(req.hashes) if req.hashes else 0
            req.matched[e.address] = n
            cached.append(min(prompt_tokens - 1, n * policy.block_tokens))
        home = req.home
        ranks = [rendezvous(home, e.address) for e in cands] if home is not None else None
        assumed = -1
        if ranks is not None and prompt is not None and prompt.history_chars:
            history = min(prompt_tokens - 1, prompt.history_chars // CHARS_PER_TOKEN)
            known = max(cached)
            h = max(range(len(cands)), key=ranks.__getitem__)
            home_tokens = prompt.home_chars // CHARS_PER_TOKEN
            # (the index counts whole blocks: the block the first turn ended in never matches a later turn)
            if known + 2 * policy.block_tokens < home_tokens <= history:
                # this replica holds no record of the conversation past what all share (its
                # earlier turns went through another replica): they went to its home
                assumed = h
                cached[h] = history
            elif policy.replicas > 1 and cached[h] < history:
                # the turns through the other replicas went home too, as often as they came
                # through them
                cached[h] = history
        preds = [predict(Workload(prompt_tokens, output, c), est, load_of(e), _slots(e), policy.cost)
                 for e, est, c in zip(cands, estimates, cached, strict=True)]
        costs = [p.cost_s for p in preds]
        if ranks is not None and policy.replicas > 1 and prompt is not None and not prompt.history_chars:
            # A first turn: its next turns may come through another replica, which sends them to
            # the rendezvous home. Going home is worth the prefill they would then not repeat,
            # as often as they come through another replica.
            h = max(range(len(cands)), key=ranks.__getitem__)
            e, est = cands[h], estimates[h]
            saved = est.k * prompt_tokens * (1.0 + policy.cost.externality * min(load_of(e), _slots(e)))
            costs[h] -= saved * (policy.replicas - 1) / policy.replicas
        best = min(costs)
        margin = max(policy.tie_s, policy.tie_share * best)
        equal = [i for i, c in enumerate(costs) if c <= best + margin]
        if len(equal) > 1:  # among equals: the most of the prompt held, then the rendezvous home
            most = max(cached[i] for i in equal)
            equal = [i for i in equal if cached[i] == most]
        if len(equal) == 1:
            first = equal[0]
        elif ranks is not None:
            first = max(equal, key=ranks.__getitem__)
        else:
            first = self._rng.choice(equal)
        rest = sorted((i for i in range(len(cands)) if i != first), key=lambda i: (costs[i], self._rng.random()))
        costs = [p.cost_s for p in preds]
        order = [first, *rest[: policy.fallbacks]]
        service, serves = self._rates(req.pool, cands, estimates)
        budget = self.admission.budget_at(req.pool, req.traffic_class, service)
        if req.observed:  # held in the lobby: its arrival counted when it came, the gate as it stands now
            opened = self.admission.gate(req.pool)
        else:  # observed on every pick, saturated or not
            wait = min(p.wait_s for p in preds)
            opened = self.admission.observe(req.pool, wait, service, serves)
        gated = policy.admission_gate and not (req.saturated or opened)
        # the delay a placement adds to the request's best case (no queue, the fastest prefill and
        # decode the pool offers it now): its wait there, and `slow_share` of what a slower worker
        # or a lost prefix adds
        ideal = min(p.prefill_s + p.decode_s for p in preds)
        delay = [req.waited_s + p.wait_s + policy.slow_share * (p.prefill_s + p.decode_s - ideal) for p in preds]
        if budget is not None and not gated and delay[first] > budget:
            # admitted where its delay stays within its budget, the cheapest of those; refused when nowhere
            admissible = [i for i, d in enumerate(delay) if d <= budget]
            if not admissible:
                return Pick((), "refused", 0, len(req.hashes), preds[first], min(delay) - budget)
            first = min(admissible, key=costs.__getitem__)
            rest = sorted((i for i in range(len(cands)) if i != first), key=lambda i: (costs[i], self._rng.random()))
            order = [first, *rest[: policy.fallbacks]]
        chosen = cands[first]
        matched = req.matched[chosen.address]
        top = max(req.matched.values())
        if first == assumed:
            reason = "home"
        elif top == 0:
            reason = "load"
        else:
            reason = "prefix" if matched == top else "spill"
        return Pick(tuple(cands[i] for i in order), reason, matched, len(req.hashes), preds[first])

    def _rates(self, pool: str, cands: Sequence[Endpoint], estimates: Sequence[Estimate]) -> tuple[float, float]:
        """The pool's service time and rate (`_rates`), its fewest slots told to admission (`budget_step`)."""
        service, serves, fewest = _rates(cands, estimates)
        if self.policy.budget_step:
            self.admission.slots(pool, service, fewest)
        return service, serves

    def observe_held(self, req: PickRequest, endpoints: Sequence[Endpoint], ahead: int) -> bool | None:
        """A request about to wait in the lobby behind `ahead` others while every slot is taken: its
        arrival, and the wait predicted for it (the engines' queues, those ahead in the lobby and itself,
        drained at the rate the pool serves), counted as a pick counts them. True: admission is on, or
        requests arrive at the spike rule's rate (place it now, do not hold); False: hold it; None: the
        pool is not predicted (place it now by the weighted rule)."""
        cands = self._candidates(req, endpoints)
        if not cands or self.policy.rule != "predicted":
            return None
        estimates = self._estimates(cands)
        if estimates is None:
            return None
        service, serves = self._rates(req.pool, cands, estimates)
        req.observed = True
        # the engines' own queues drain first (a request placed at once would wait behind them; once
        # admission is on they hold up to the budget, and a held request would wait behind them too)
        queued = sum(max(0.0, load_of(e) - _slots(e)) for e in cands)
        # each picker sharing the pool holds its share of the arrivals in a lobby of its own, which the
        # others do not see: as many ahead in each (the spike rule counts arrivals alike)
        ahead *= max(1, self._pickers())
        opened = self.admission.observe(req.pool, (queued + ahead + 1) / max(1e-9, serves), service, serves)
        # a spike (arrivals at the spike rule's rate) is not waited out: nothing held would be placed
        # before admission opens, and the lobby's own work comes on top of the spike's (measured: 12 workers
        # at 3x, admitted P99 2.33x their own at 78 % when held, bench/results/lobby)
        rushing = self.admission.rushing(req.pool)
        return opened or rushing or req.saturated or not self.policy.admission_gate

    def _weighted(self, req: PickRequest, cands: list[Endpoint]) -> Pick:
        blocks = len(req.hashes)
        totals = [0.0] * len(cands)
        for scorer, weight in self._scorers:
            for i, s in enumerate(scorer(req, cands, self.policy)):
                totals[i] += weight * s
        order = sorted(range(len(cands)), key=lambda i: (-totals[i], self._rng.random()))
        chosen = [cands[i] for i in order[: 1 + self.policy.fallbacks]]
        matched = req.matched.get(chosen[0].address)
        if matched is None:
            matched = chosen[0].index.match(req.hashes)
        best = max(req.matched.values(), default=matched)
        reason = "load" if best == 0 else "prefix" if matched == best else "spill"
        return Pick(tuple(chosen), reason, matched, blocks)
