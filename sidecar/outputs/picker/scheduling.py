"""Filters, scorers and the picker: how one endpoint is chosen for one request.

The shape of the inference extension's scheduler (filters narrow the candidates, scorers
each give every candidate a score in [0, 1], the picker takes the best weighted sum), with
our own rule:

    load(e)   = max(in_flight(e), running(e) + waiting(e))          requests
                (the picker's own count is fresh and sees every request through it; the
                 engine's count, a probe cycle old, also sees other clients)
    spill(e)  = max(spill_min, spill_fraction * capacity(e))        requests
    excess(e) = load(e) - min over candidates of load

    prefix(e) = matched blocks / prompt blocks * a, and 0 once excess(e) > spill(e)
                (a hot prefix spills instead of piling up: balance wins when queues diverge),
                a = min(1, prompt tokens / (prompt_share * max_tokens)): a cached prefix saves
                prefill, worth little beside a generation many times longer than the prompt
    load(e)   = 1 - min(1, (slow(e) load(e) - min of the same) / capacity(e)),
                slow(e) = time per token(e) / the fastest's (a request in flight on a worker
                half as fast holds it twice as long)
    kv(e)     = 1 - KV cache use (1 when not reported)
    cost(e)   = 1 - f * (1 - t_min / t(e)),  t(e) = time per token(e) * (1 + load(e) / capacity(e)),
                f = min(1, max_tokens / long_tokens)
                (a long generation goes where it finishes soonest; a short one barely cares)

    score(e)  = 3 prefix + 2 load + 1 kv + 2 cost            (weights: PickerPolicy)

Ties go to a random one of the best (no hot spot on the first endpoint). The answer is the
best endpoint then `fallbacks` more in score order, for the proxy's retries.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .datastore import Endpoint
from .prompt import PromptInfo

__all__ = ["FILTERS", "SCORERS", "Pick", "PickRequest", "Picker", "PickerPolicy", "Scorer"]


@dataclass(frozen=True, slots=True)
class PickerPolicy:
    weights: tuple[tuple[str, float], ...] = (("prefix", 3.0), ("load", 2.0), ("kv", 1.0), ("cost", 2.0))
    spill_min: float = 2.0  # requests
    spill_fraction: float = 0.25  # of the endpoint's capacity
    long_tokens: int = 512  # a generation this long or longer weighs cost fully
    default_max_tokens: int = 256  # when the request says nothing
    prompt_share: float = 0.5  # prefix counts fully while prompt tokens >= this x max_tokens
    fallbacks: int = 2  # endpoints after the first, for retries


    def with_overrides(self, pairs: Sequence[str]) -> PickerPolicy:
        """This policy with KEY=VALUE pairs applied (a scorer's name sets its weight); ValueError
        naming the pair when one is unknown or out of range."""
        weights = dict(self.weights)
        fields: dict[str, float | int] = {}
        numeric = {"spill_min": float, "spill_fraction": float, "prompt_share": float,
                   "long_tokens": int, "default_max_tokens": int, "fallbacks": int}
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            kind = float if key in SCORERS else numeric.get(key)
            if not sep or kind is None:
                raise ValueError(f"--picker {pair!r}: expected KEY=VALUE with KEY one of "
                                 f"{sorted([*SCORERS, *numeric])}")
            try:
                value = kind(raw)
            except ValueError as exc:
                raise ValueError(f"--picker {key}: {raw!r} is not a {kind.__name__}") from exc
            if not (value >= 0 and value == value) or (key in ("long_tokens", "default_max_tokens", "prompt_share")
                                                         and value <= 0) or value > 1e6:
                raise ValueError(f"--picker {key}: {raw} is out of range")
            if key in SCORERS:
                weights[key] = float(value)
            else:
                fields[key] = value
        return PickerPolicy(weights=tuple(weights.items()), **fields)  # type: ignore[arg-type]


@dataclass(slots=True)
class PickRequest:
    pool: str
    prompt: PromptInfo | None
    hashes: Sequence[int]
    subset: frozenset[str] | None = None
    # filled in while scoring, read by the metrics
    matched: dict[str, int] = field(default_factory=dict)


def load_of(e: Endpoint) -> float:
    f = e.facts
    return max(float(e.in_flight), f.running + f.waiting)


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
    reason: str  # prefix | spill | load | only | none
    matched_blocks: int  # of the chosen endpoint
    prompt_blocks: int


class Picker:
    """Filters, then weighted scorers, then the best (random among equals) and fallbacks."""

    def __init__(self, policy: PickerPolicy | None = None, *, rng: random.Random | None = None,
                 filters: Sequence[str] = ("subset", "serving")) -> None:
        self.policy = policy or PickerPolicy()
        unknown = [n for n, _ in self.policy.weights if n not in SCORERS] + [n for n in filters if n not in FILTERS]
        if unknown:
            raise ValueError(f"unknown scorer or filter: {unknown}")
        self._scorers = [(SCORERS[n], w) for n, w in self.policy.weights if w]
        self._filters = [FILTERS[n] for n in filters]
        self._rng = rng or random.Random()

    def pick(self, req: PickRequest, endpoints: Sequence[Endpoint]) -> Pick:
        cands = list(endpoints)
        for keep in self._filters:
            cands = keep(req, cands)
        blocks = len(req.hashes)
        if not cands:
            return Pick((), "none", 0, blocks)
        if len(cands) == 1:
            e = cands[0]
            return Pick((e,), "only", e.index.match(req.hashes), blocks)
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
