"""Deterministic open-loop workloads: arrivals, request mixes, multi-turn chat conversations and agents.

Everything is drawn from one `random.Random(seed)`, so two runs (and two routers) get the
very same requests at the very same offsets. Each request carries its scheduled send time
`t` (s from the run start); the load generator measures latency from it.
"""

from __future__ import annotations

import itertools
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


def describe(spec: WorkloadSpec | ChatSpec | AgentSpec) -> dict[str, Any]:
    return asdict(spec)


# -- chat workloads for prefix-cache routing (bench/scenarios/prefix.py) ---------------------------
#
# Bodies are OpenAI chat completions (`messages`), as the OpenAI SDK, LangChain or a chat
# front-end sends them: every turn resends the whole conversation. A request dict adds to
# the common fields (i, t, body, headers, session, after) `out` (max_tokens: the simulator
# generates exactly that many, the NTPOT denominator) and `kind` ("turn", "one-shot", "agent").

CHAT_PATH = "/v1/chat/completions"
MESSAGE_OVERHEAD_TOKENS = 3  # what the simulator adds per chat message (confgen/simulate/_server.py)


@dataclass(frozen=True)
class ChatSpec:
    """Multi-turn conversations, optionally mixed with one-shot requests.

    Conversations start as a Poisson process (the window opens on conversations already in
    progress); turn k+1 is scheduled a think time after turn k (exponential, `think_s` mean,
    at least `min_gap_s`) and sent no earlier than the end of turn k (`after`). Each turn's
    messages are the system prompt, every earlier user turn and assistant answer (drawn here,
    so the bodies are identical for every router), and the new user turn.

    `session_header`: clients send `x-session-id` (the conversation's id); without it the
    requests carry no header at all, like a plain OpenAI client. Same seed, same everything
    else: the two variants differ by that header only.
    `one_shot_share`: that share of the requests (in expectation) are single-message requests
    with no shared prefix (their own Poisson stream), the rest are conversation turns.
    """

    rate: float  # mean requests per second (turns + one-shots) over the window
    duration_s: float
    turns: tuple[int, int] = (8, 16)
    think_s: float = 2.0
    min_gap_s: float = 1.0
    system_tokens: tuple[int, int] = (1000, 3000)
    user_tokens: tuple[int, int] = (40, 240)
    output_range: tuple[int, int] = (16, 48)
    session_header: bool = False
    one_shot_share: float = 0.0
    one_shot_tokens: tuple[int, int] = (200, 2000)  # log-uniform
    model: str = "sim-model"
    stream: bool = True
    seed: int = 0

    def mean_turns(self) -> float:
        return sum(self.turns) / 2


@dataclass(frozen=True)
class AgentSpec:
    """Agent-style traffic: many one-shot requests that share a long system + tool prefix
    (one of `contexts`, Zipf popularity: context k is chosen with weight 1 / (k + 1) ** zipf)
    and differ after it (the task, its own tail)."""

    rate: float
    duration_s: float
    contexts: int = 48
    context_tokens: tuple[int, int] = (1500, 4000)
    tail_tokens: tuple[int, int] = (40, 400)
    output_range: tuple[int, int] = (16, 64)
    zipf: float = 0.8  # 0 = every context alike; 0.8: the hottest ~12 % of requests, the top 10 about half
    model: str = "sim-model"
    stream: bool = True
    seed: int = 0


def chat_prompt_tokens(messages: list[dict[str, str]]) -> int:
    """Prompt tokens as the simulator counts them: 'role: content' lines / 4 + 3 per message."""
    chars = sum(len(m["role"]) + 2 + len(m["content"]) for m in messages) + max(0, len(messages) - 1)
    return max(1, math.ceil(chars / CHARS_PER_TOKEN)) + MESSAGE_OVERHEAD_TOKENS * len(messages)


def _chat_request(t: float, spec_model: str, stream: bool, messages: list[dict[str, str]], max_tokens: int,
                  headers: dict[str, str], session: str | None, kind: str, turn: int = 0) -> dict[str, Any]:
    body = {"model": spec_model, "messages": [dict(m) for m in messages], "max_tokens": max_tokens, "stream": stream}
    return {"t": round(t, 6), "body": body, "headers": headers, "session": session, "turn": turn, "out": max_tokens,
            "kind": kind}


def _index(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Order by scheduled time, number them, link each turn to the previous one of its conversation."""
    requests.sort(key=lambda r: (r["t"], r["session"] or "", r["turn"]))
    last: dict[str, int] = {}
    for i, r in enumerate(requests):
        r["i"] = i
        r["after"] = last.get(r["session"]) if r["kind"] == "turn" else None
        if r["kind"] == "turn":
            last[r["session"]] = i
    return requests


def build_chat(spec: ChatSpec) -> list[dict[str, Any]]:
    """The requests of a ChatSpec (see its docstring), ordered by scheduled time."""
    rng = random.Random(f"chat|{spec.seed}")
    conv_rate = spec.rate * (1.0 - spec.one_shot_share) / spec.mean_turns()
    span = spec.mean_turns() * max(spec.think_s, spec.min_gap_s)
    out: list[dict[str, Any]] = []
    start = -span
    conv = 0
    while conv_rate > 0:
        start += rng.expovariate(conv_rate)
        if start >= spec.duration_s:
            break
        sid = f"conv-{spec.seed}-{conv:04d}"
        headers = {"x-session-id": sid} if spec.session_header else {}
        messages = [{"role": "system",
                     "content": f"[conversation {conv:04d}] " + text(rng, rng.randint(*spec.system_tokens))}]
        t = start
        for k in range(rng.randint(*spec.turns)):
            messages.append({"role": "user", "content": f"[{k}] " + text(rng, rng.randint(*spec.user_tokens))})
            max_tokens = rng.randint(*spec.output_range)
            if 0 <= t < spec.duration_s:
                out.append(_chat_request(t, spec.model, spec.stream, messages, max_tokens, dict(headers), sid,
                                         "turn", k))
            messages.append({"role": "assistant", "content": text(rng, max_tokens)})
            t += max(spec.min_gap_s, rng.expovariate(1.0 / spec.think_s))
        conv += 1
    if spec.one_shot_share > 0:
        single = random.Random(f"one-shot|{spec.seed}")
        lo, hi = spec.one_shot_tokens
        for n, t in poisson(single, spec.rate * spec.one_shot_share, 1_000_000):
            if t >= spec.duration_s:
                break
            tokens = int(math.exp(single.uniform(math.log(lo), math.log(hi))))
            messages = [{"role": "user", "content": f"[one-shot {n:05d}] " + text(single, tokens)}]
            out.append(_chat_request(t, spec.model, spec.stream, messages, single.randint(*spec.output_range), {},
                                     None, "one-shot"))
    return _index(out)


def loosely_bounded(requests: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    """The same requests from clients that send `max_tokens` as a generous bound (SDK defaults, front-ends
    that cap the worst case): each answer keeps its own length, which the simulator stops at with finish
    reason "stop" (`x-sim-answer-tokens`, the model's end of sequence), where the bound is not reached."""
    for r in requests:
        r["out"] = out = r.get("out", r["body"]["max_tokens"])
        r["headers"] = {**r["headers"], "x-sim-answer-tokens": str(out)}
        r["body"] = {**r["body"], "max_tokens": max(max_tokens, out)}
    return requests


def build_agents(spec: AgentSpec) -> list[dict[str, Any]]:
    """The requests of an AgentSpec: system = one shared context (instructions and tool
    definitions, identical for every request of that agent), user = the request's own task."""
    rng = random.Random(f"agents|{spec.seed}")
    contexts = [f"[agent {a:03d} instructions and tools] " + text(rng, rng.randint(*spec.context_tokens))
                for a in range(spec.contexts)]
    weights = list(itertools.accumulate(1.0 / (k + 1) ** spec.zipf for k in range(spec.contexts)))
    out: list[dict[str, Any]] = []
    for n, t in poisson(rng, spec.rate, 1_000_000):
        if t >= spec.duration_s:
            break
        a = rng.choices(range(spec.contexts), cum_weights=weights)[0]
        messages = [{"role": "system", "content": contexts[a]},
                    {"role": "user", "content": f"[task {n:05d}] " + text(rng, rng.randint(*spec.tail_tokens))}]
        out.append(_chat_request(t, spec.model, spec.stream, messages, rng.randint(*spec.output_range), {},
                                 f"agent-{a:03d}", "agent"))
    return _index(out)


def shared_prefix_chars(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Length of the common leading text of two chat requests, as the engine sees it."""
    ta, tb = engine_text(a), engine_text(b)
    n = 0
    for x, y in zip(ta, tb, strict=False):
        if x != y:
            break
        n += 1
    return n


def engine_text(request: dict[str, Any]) -> str:
    """The prompt text the simulated engine builds from a chat body ('role: content' lines)."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in request["body"]["messages"])
