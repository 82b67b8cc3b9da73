"""A deterministic open-loop workload: Poisson arrivals, prompt/output lengths, shared-prefix sessions.

Everything is drawn from one `random.Random(seed)`, so two runs (and two routers) get the
very same requests at the very same offsets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

_WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
    "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
)  # fmt: skip
_CHARS_PER_TOKEN = 4  # what the simulator assumes when it counts prompt tokens


@dataclass(frozen=True)
class WorkloadSpec:
    rate: float  # requests per second (Poisson)
    count: int  # requests in total (the run ends with the last arrival)
    model: str = "sim-model"
    prompt_tokens: tuple[int, int] = (64, 1024)  # log-uniform range
    output_range: tuple[int, int] = (16, 64)  # uniform: routing, not output-length luck, should set the tail
    session_share: float = 0.5  # share of requests that belong to a shared-prefix session
    sessions: int = 24
    session_prefix_tokens: int = 768
    stream: bool = True
    seed: int = 0


def _text(rng: random.Random, tokens: int) -> str:
    words: list[str] = []
    length = 0
    target = tokens * _CHARS_PER_TOKEN
    while length < target:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:target]


def poisson(rng: random.Random, rate: float, count: int) -> Iterator[tuple[int, float]]:
    """(index, offset in s) of `count` open-loop Poisson arrivals. Lazy, so a caller that
    draws from the same `rng` per request keeps one interleaved, reproducible sequence."""
    t = 0.0
    for index in range(count):
        t += rng.expovariate(rate)
        yield index, t


def build(spec: WorkloadSpec) -> list[dict[str, Any]]:
    """The requests: offset `t` (s from start), JSON `body`, `headers`, `session`."""
    rng = random.Random(spec.seed)
    prefixes = [
        f"[session {i:03d} system prompt] " + _text(rng, spec.session_prefix_tokens)
        for i in range(spec.sessions)
    ]
    lo, hi = spec.prompt_tokens
    out: list[dict[str, Any]] = []
    for index, t in poisson(rng, spec.rate, spec.count):
        prompt_tokens = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        max_tokens = rng.randint(*spec.output_range)
        headers: dict[str, str] = {}
        session: str | None = None
        if rng.random() < spec.session_share:
            # Zipf-like popularity: a few sessions are hot.
            s = min(int(rng.paretovariate(1.2)) - 1, spec.sessions - 1)
            session = f"s{s:03d}"
            headers["x-session-id"] = session
            prompt = prefixes[s] + f" [turn {index}] " + _text(rng, max(8, prompt_tokens // 4))
        else:
            prompt = f"[request {index}] " + _text(rng, prompt_tokens)
        body = {"model": spec.model, "prompt": prompt, "max_tokens": max_tokens, "stream": spec.stream}
        out.append({"i": index, "t": round(t, 6), "body": body, "headers": headers, "session": session})
    return out


def describe(spec: WorkloadSpec) -> dict[str, Any]:
    return asdict(spec)
