"""Pure latency model of a continuous-batching engine (no I/O, no clock: time is passed in).

The engine runs in steps, like vLLM's scheduler loop. A step starts by admitting waiting
requests (FIFO) while fewer than `max_num_seqs` run and the KV cache has room; it lasts

    (decode_ms * (1 + decode_growth * (batch - 1)) + prefill_ms_per_1k * uncached / 1000) / speed

and at its end every running request has one more token (the admitted ones their first).
A request leaves when it has `max_tokens` tokens. Prompt tokens found in the prefix cache
are not prefilled again: either an LRU of keys (the session or the prompt's first characters,
`PrefixCache`) or, like vLLM's automatic prefix caching, an LRU of prompt blocks keyed by
chained hashes (`BlockPrefixCache`: a hit is the run of leading blocks the engine holds).

Callers drive it with `submit(request, now)`, `next_event_time()` and `advance(now)`;
`simulate()` runs a whole arrival list in virtual time, for tests and what-if questions.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BLOCK_TOKENS",
    "BatchEngine",
    "BlockPrefixCache",
    "EngineRequest",
    "Histogram",
    "LatencyModel",
    "PrefixCache",
    "simulate",
]


@dataclass(frozen=True)
class LatencyModel:
    """Timing parameters of one engine; every duration is divided by `speed`."""

    max_num_seqs: int = 16
    speed: float = 1.0
    prefill_ms_per_1k: float = 60.0
    decode_ms: float = 20.0
    decode_growth: float = 0.03
    kv_cache_tokens: int = 65536

    def prefill_seconds(self, uncached_tokens: int) -> float:
        return self.prefill_ms_per_1k * uncached_tokens / 1000.0 / 1000.0 / self.speed

    def decode_step_seconds(self, batch: int) -> float:
        return self.decode_ms * (1.0 + self.decode_growth * max(0, batch - 1)) / 1000.0 / self.speed


class Histogram:
    """Cumulative-bucket histogram as Prometheus exposes it (`le` upper bounds, +Inf last)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times

    def add(self, other: Histogram) -> None:
        """Fold another histogram with the same bounds into this one (data-parallel sums)."""
        if other.bounds != self.bounds:
            raise ValueError("histogram bounds differ")
        for i, n in enumerate(other._counts):
            self._counts[i] += n
        self.total += other.total
        self.count += other.count

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) pairs, ending with (inf, count)."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self._counts, strict=True):
            running += n
            out.append((bound, running))
        return out


# A key-cache key (session id or prompt-prefix hash), or a block cache's chained block hashes.
CacheKey = str | tuple[str, ...] | None


class PrefixCache:
    """LRU map from a cache key (session id or prompt-prefix hash) to tokens held in KV."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, int] = OrderedDict()

    def lookup(self, key: CacheKey, prompt_tokens: int) -> int:
        """Tokens of this prompt already cached (never the whole prompt: one must be computed)."""
        if not isinstance(key, str) or self.capacity == 0 or key not in self._entries:
            return 0
        self._entries.move_to_end(key)
        return max(0, min(self._entries[key], prompt_tokens - 1))

    def store(self, key: CacheKey, tokens: int) -> None:
        if not isinstance(key, str) or self.capacity == 0:
            return
        self._entries[key] = max(tokens, self._entries.get(key, 0))
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


BLOCK_TOKENS = 16  # vLLM's default --block-size (what cache_config_info reports)


class BlockPrefixCache:
    """vLLM's automatic prefix caching in miniature: an LRU of full prompt blocks of
    BLOCK_TOKENS tokens, each keyed by a hash chained over every block before it, so a
    lookup is the run of leading blocks held (two prompts that share a system prompt and
    differ after it share exactly the blocks of the common part). Capacity in blocks.
    Only prompt blocks are known (the request carries their hashes); generated tokens are
    not cached for a later prompt here."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[str, None] = OrderedDict()

    def lookup(self, key: CacheKey, prompt_tokens: int) -> int:
        if not isinstance(key, tuple) or self.capacity == 0:
            return 0
        matched = 0
        for block in key:
            if block not in self._blocks:
                break
            self._blocks.move_to_end(block)
            matched += 1
        return max(0, min(matched * BLOCK_TOKENS, prompt_tokens - 1))

    def store(self, key: CacheKey, tokens: int) -> None:
        if not isinstance(key, tuple) or self.capacity == 0:
            return
        for block in key[: tokens // BLOCK_TOKENS]:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)


@dataclass(eq=False)
class EngineRequest:
    """One request as the engine sees it; the engine fills in the timing fields."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    cache_key: CacheKey = None
    finish_reason: str = "length"
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    generated: int = 0
    aborted: bool = False
    token_times: list[float] | None = None  # kept only when asked for (simulate())

    @property
    def finished(self) -> bool:
        return self.finished_at is not None or self.aborted

    @property
    def duration(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival


@dataclass
class EngineCounters:
    """Cumulative counters a metrics endpoint reports (reset only by a restart)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    prefix_lookups: int = 0
    prefix_hit_requests: int = 0
    requests_finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    busy_slot_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    preemptions: int = 0
    longest_sequence: int = 0  # prompt + generated tokens of the longest finished request


class BatchEngine:
    """One engine (one data-parallel rank) of a worker. Deterministic given its inputs."""

    def __init__(
        self,
        model: LatencyModel,
        *,
        prefix_cache_size: int = 256,
        prefix_cache_blocks: bool = False,
        histogram_bounds: Mapping[str, Sequence[float]] | None = None,
        keep_token_times: bool = False,
    ) -> None:
        """`prefix_cache_blocks`: a block cache of the KV size (kv_cache_tokens / BLOCK_TOKENS
        blocks, the num_gpu_blocks the engine reports) instead of `prefix_cache_size` keys."""
        self.model = model
        self.cache: PrefixCache | BlockPrefixCache = (
            BlockPrefixCache(model.kv_cache_tokens // BLOCK_TOKENS) if prefix_cache_blocks
            else PrefixCache(prefix_cache_size))
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self.counters = EngineCounters()
        self.histograms = {k: Histogram(v) for k, v in (histogram_bounds or {}).items()}
        self.keep_token_times = keep_token_times
        self.last_step_seconds = 0.0
        self.last_step_batch = 0
        self._step_start: float | None = None
        self._step_end: float | None = None
        self._stalled_since: float | None = None

    # -- inputs ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest, now: float) -> None:
        """Queue a request; an idle engine starts a step at once."""
        if self.keep_token_times and request.token_times is None:
            request.token_times = []
        self.waiting.append(request)
        if self._step_end is None:
            self._start_step(now)

    def abort(self, request: EngineRequest, now: float) -> None:
        """Drop a request (client went away). The current step's length is unchanged."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
        request.aborted = True
        self.counters.requests_finished["abort"] += 1
        if not self.running and not self.waiting and self._stalled_since is None:
            self._step_start = self._step_end = None

    def stall(self, now: float) -> None:
        """Freeze the GPU: steps stop ending, tokens stop coming, admitted work stays running."""
        if self._stalled_since is None:
            self._stalled_since = now

    def resume(self, now: float) -> None:
        """Unfreeze: the interrupted step finishes what it had left."""
        since = self._stalled_since
        if since is None:
            return
        self._stalled_since = None
        if self._step_start is not None and self._step_end is not None:
            if self._step_start >= since:  # step began while stalled: run it whole from now
                self._step_end = now + (self._step_end - self._step_start)
                self._step_start = now
            else:
                self._step_end += now - since
        elif self.waiting:
            self._start_step(now)

    # -- outputs --------------------------------------------------------------------------

    @property
    def stalled(self) -> bool:
        return self._stalled_since is not None

    def next_event_time(self) -> float | None:
        """When the current step ends (None: idle or stalled)."""
        return None if self._stalled_since is not None else self._step_end

    def advance(self, now: float) -> list[EngineRequest]:
        """Run every step that ends at or before `now`; return requests that got tokens."""
        touched: dict[int, EngineRequest] = {}
        while self._stalled_since is None and self._step_end is not None and self._step_end <= now:
            end = self._step_end
            for request in self._finish_step(end):
                touched[id(request)] = request
            self._start_step(end)
        return list(touched.values())

    def kv_usage(self) -> float:
        used = sum(r.prompt_tokens + r.generated for r in self.running)
        return min(1.0, used / self.model.kv_cache_tokens)

    def kv_tokens(self) -> int:
        return sum(r.prompt_tokens + r.generated for r in self.running)

    # -- the step -------------------------------------------------------------------------

    def _start_step(self, now: float) -> None:
        admitted: list[EngineRequest] = []
        used = self.kv_tokens()
        while self.waiting and len(self.running) < self.model.max_num_seqs:
            candidate = self.waiting[0]
            # KV admission gate; an empty batch takes anything so nothing waits forever.
            if self.running and used + candidate.prompt_tokens > self.model.kv_cache_tokens:
                break
            self.waiting.popleft()
            self._admit(candidate, now)
            used += candidate.prompt_tokens
            admitted.append(candidate)
        if not self.running:
            self._step_start = self._step_end = None
            return
        prefill = sum(self.model.prefill_seconds(r.prompt_tokens - r.cached_tokens) for r in admitted)
        decode = self.model.decode_step_seconds(len(self.running))
        self.counters.prefill_seconds += prefill
        self.counters.decode_seconds += decode
        self.last_step_seconds = prefill + decode
        self.last_step_batch = len(self.running)
        self._observe(
            "iteration_tokens",
            sum(r.prompt_tokens - r.cached_tokens for r in admitted) + len(self.running) - len(admitted),
        )
        self._step_start = now
        self._step_end = now + prefill + decode

    def _admit(self, request: EngineRequest, now: float) -> None:
        request.admitted_at = now
        cached = self.cache.lookup(request.cache_key, request.prompt_tokens)
        request.cached_tokens = cached
        c = self.counters
        c.prompt_tokens += request.prompt_tokens
        c.prefix_queries_tokens += request.prompt_tokens
        c.prefix_hits_tokens += cached
        if request.cache_key is not None:
            c.prefix_lookups += 1
            c.prefix_hit_requests += cached > 0
        self.running.append(request)
        self._observe("queue", now - request.arrival)

    def _finish_step(self, end: float) -> list[EngineRequest]:
        self.counters.steps += 1
        self.counters.busy_slot_steps += len(self.running)
        still: list[EngineRequest] = []
        touched = list(self.running)
        for r in self.running:
            r.generated += 1
            self.counters.generation_tokens += 1
            if r.token_times is not None:
                r.token_times.append(end)
            if r.first_token_at is None:
                r.first_token_at = end
                self._observe("ttft", end - r.arrival)
                self._observe("prefill", end - (r.admitted_at or r.arrival))
                self.cache.store(r.cache_key, r.prompt_tokens)
            else:
                self._observe("itl", end - (r.last_token_at or end))
            r.last_token_at = end
            if r.generated >= r.max_tokens:
                self._finish(r, end)
            else:
                still.append(r)
        self.running = still
        return touched

    def _finish(self, r: EngineRequest, end: float) -> None:
        r.finished_at = end
        admitted = r.admitted_at if r.admitted_at is not None else r.arrival
        first = r.first_token_at if r.first_token_at is not None else end
        self.cache.store(r.cache_key, r.prompt_tokens + r.generated)
        self.counters.longest_sequence = max(self.counters.longest_sequence, r.prompt_tokens + r.generated)
        self.counters.requests_finished[r.finish_reason] = self.counters.requests_finished.get(r.finish_reason, 0) + 1
        self._observe("e2e", end - r.arrival)
        self._observe("inference", end - admitted)
        self._observe("decode", end - first)
        if r.generated > 1:
            self._observe("tpot", (end - first) / (r.generated - 1))
        self._observe("prompt_tokens", r.prompt_tokens)
        self._observe("generation_tokens", r.generated)
        self._observe("max_tokens_param", r.max_tokens)

    def _observe(self, name: str, value: float) -> None:
        hist = self.histograms.get(name)
        if hist is not None:
            hist.observe(value)


def simulate(
    model: LatencyModel,
    arrivals: Iterable[EngineRequest],
    *,
    prefix_cache_size: int = 256,
) -> list[EngineRequest]:
    """Run requests (with their `arrival` times) to completion in virtual time.

    Returns the same request objects with admitted/first-token/finished times and
    `token_times` filled in: the durations a live worker with this model would produce
    for the same arrivals.
    """
    engine = BatchEngine(model, prefix_cache_size=prefix_cache_size, keep_token_times=True)
    pending = sorted(arrivals, key=lambda r: r.arrival)
    done = list(pending)
    index = 0
    while index < len(pending) or engine.next_event_time() is not None:
        step_end = engine.next_event_time()
        next_arrival = pending[index].arrival if index < len(pending) else None
        # Arrivals at the same instant as a step end join after that step (as the server does).
        if next_arrival is not None and (step_end is None or next_arrival < step_end):
            engine.advance(next_arrival)
            engine.submit(pending[index], next_arrival)
            index += 1
        elif step_end is not None:
            engine.advance(step_end)
    return done
