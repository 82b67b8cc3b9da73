"""Deterministic open-loop workloads: arrivals, request mixes and multi-turn chat sessions.

Everything is drawn from one `random.Random(seed)`, so two runs (and two routers) get the
very same requests at the very same offsets. Each request carries its scheduled send time
`t` (s from the run start); the load generator measures latency from it.
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
CHARS_PER_TOKEN = 4  # what the simulator assumes when it counts prompt tokens


@dataclass(frozen=True)
class WorkloadSpec:
    rate: float  # mean requests per second
    count: int  # requests in total (the run ends with the last arrival)
    model: str = "sim-model"
    prompt_tokens: tuple[int, int] = (64, 1024)  # log-uniform range
    output_range: tuple[int, int] = (16, 64)  # uniform: routing, not output-length luck, should set the tail
    session_share: float = 0.5  # share of requests that belong to a shared-prefix session
    sessions: int = 24
    session_prefix_tokens: int = 768
    stream: bool = True
    seed: int = 0
    arrivals: str = "poisson"  # "poisson" | "bursty" (on/off modulated Poisson, same mean rate)
    burst_period_s: float = 4.0  # bursty: one on-phase and one off-phase per period
    burst_peak: float = 1.75  # bursty: on-phase rate = peak x mean, off-phase = (2 - peak) x mean

    def prompt_mean(self) -> float:
        """Mean prompt tokens of the log-uniform draw (before the per-request tag)."""
        lo, hi = self.prompt_tokens
        return float(lo) if hi <= lo else (hi - lo) / math.log(hi / lo)

    def output_mean(self) -> float:
        return sum(self.output_range) / 2


def text(rng: random.Random, tokens: int) -> str:
    words: list[str] = []
    length = 0
    target = tokens * CHARS_PER_TOKEN
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


def bursty(rng: random.Random, rate: float, count: int, period_s: float, peak: float) -> Iterator[tuple[int, float]]:
    """On/off modulated Poisson (thinning): `peak` x rate for the first half of every period,
    (2 - peak) x rate for the second half, so the mean rate is `rate`."""
    top = rate * peak
    low_share = (2.0 - peak) / peak
    t = 0.0
    index = 0
    while index < count:
        t += rng.expovariate(top)
        on = (t % period_s) < period_s / 2
        if on or rng.random() < low_share:
            yield index, t
            index += 1


def arrivals(rng: random.Random, spec: WorkloadSpec) -> Iterator[tuple[int, float]]:
    if spec.arrivals == "bursty":
        return bursty(rng, spec.rate, spec.count, spec.burst_period_s, spec.burst_peak)
    if spec.arrivals != "poisson":
        raise ValueError(f"unknown arrival process {spec.arrivals!r}")
    return poisson(rng, spec.rate, spec.count)


def build(spec: WorkloadSpec) -> list[dict[str, Any]]:
    """The requests: offset `t` (s from start), JSON `body`, `headers`, `session`."""
    rng = random.Random(spec.seed)
    prefixes = [
        f"[session {i:03d} system prompt] " + text(rng, spec.session_prefix_tokens)
        for i in range(spec.sessions)
    ]
    lo, hi = spec.prompt_tokens
    out: list[dict[str, Any]] = []
    for index, t in arrivals(rng, spec):
        prompt_tokens = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        max_tokens = rng.randint(*spec.output_range)
        headers: dict[str, str] = {}
        session: str | None = None
        if spec.session_share > 0 and rng.random() < spec.session_share:
            # Zipf-like popularity: a few sessions are hot.
            s = min(int(rng.paretovariate(1.2)) - 1, spec.sessions - 1)
            session = f"s{s:03d}"
            headers["x-session-id"] = session
            prompt = prefixes[s] + f" [turn {index}] " + text(rng, max(8, prompt_tokens // 4))
        else:
            prompt = f"[request {index}] " + text(rng, prompt_tokens)
        body = {"model": spec.model, "prompt": prompt, "max_tokens": max_tokens, "stream": spec.stream}
        out.append({"i": index, "t": round(t, 6), "body": body, "headers": headers, "session": session})
    return out


def describe(spec: WorkloadSpec | SessionSpec) -> dict[str, Any]:
    return asdict(spec)


@dataclass(frozen=True)
class SessionSpec:
    """Multi-turn chat: conversations that grow turn by turn, each turn's prompt the whole
    conversation so far (system prompt, every earlier user turn and answer, the new turn).

    Conversations start as a Poisson process; turn k+1 is scheduled a think time after turn
    k's scheduled time (exponential, `think_s` mean), never earlier than `min_gap_s`. The load
    generator sends a turn no earlier than the end of the conversation's previous turn (a
    client waits for the answer), and measures it from its scheduled time all the same, so
    a slow answer shows up in the next turn's latency rather than disappearing from it.
    The assistant text in later prompts is drawn here, not taken from the answer, so the
    prompts (and arrivals) are identical for every router.
    """

    rate: float  # mean requests (turns) per second over the window
    duration_s: float  # turns are scheduled within [0, duration_s)
    turns: tuple[int, int] = (4, 10)
    think_s: float = 3.0
    min_gap_s: float = 1.0
    system_tokens: tuple[int, int] = (600, 1500)
    user_tokens: tuple[int, int] = (40, 240)
    output_range: tuple[int, int] = (16, 48)
    model: str = "sim-model"
    stream: bool = True
    seed: int = 0

    def mean_turns(self) -> float:
        return sum(self.turns) / 2

    def mean_prompt_tokens(self) -> float:
        """Mean prompt of a turn (the conversation so far), for the nominal capacity."""
        k = self.mean_turns()
        per_turn = sum(self.user_tokens) / 2 + sum(self.output_range) / 2
        return sum(self.system_tokens) / 2 + per_turn * (k + 1) / 2


def build_sessions(spec: SessionSpec) -> list[dict[str, Any]]:
    """The turns, ordered by scheduled time; `after` = index of the previous turn of the same
    conversation (or None), `session` = the x-session-id."""
    rng = random.Random(spec.seed)
    conv_span = spec.mean_turns() * max(spec.think_s, spec.min_gap_s)
    # Conversations start over [-span, duration): the window opens on conversations in progress.
    conv_rate = spec.rate / spec.mean_turns()
    turns: list[dict[str, Any]] = []
    start = -conv_span
    conv = 0
    while True:
        start += rng.expovariate(conv_rate)
        if start >= spec.duration_s:
            break
        sid = f"conv-{spec.seed}-{conv:04d}"
        history = f"[conversation {conv:04d}] system: " + text(rng, rng.randint(*spec.system_tokens))
        t = start
        for k in range(rng.randint(*spec.turns)):
            user = f"\nuser [{k}]: " + text(rng, rng.randint(*spec.user_tokens))
            max_tokens = rng.randint(*spec.output_range)
            prompt = history + user + "\nassistant:"
            if 0 <= t < spec.duration_s:
                body = {"model": spec.model, "prompt": prompt, "max_tokens": max_tokens, "stream": spec.stream}
                turns.append({"t": round(t, 6), "body": body, "headers": {"x-session-id": sid}, "session": sid,
                              "turn": k})
            history = prompt + " " + text(rng, max_tokens)
            t += max(spec.min_gap_s, rng.expovariate(1.0 / spec.think_s))
        conv += 1
    turns.sort(key=lambda r: r["t"])
    last: dict[str, int] = {}
    for i, r in enumerate(turns):
        r["i"] = i
        r["after"] = last.get(r["session"])
        last[r["session"]] = i
    return turns
