"""The pure batching model: no sockets, no clock, no sleeping."""

from confgen.simulate import BatchEngine, EngineRequest, LatencyModel, simulate
from confgen.simulate._engine import PrefixCache


def _requests(n: int, *, prompt: int = 400, max_tokens: int = 10, gap: float = 0.0) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", prompt, max_tokens, arrival=i * gap) for i in range(n)]


def test_at_most_max_num_seqs_run_and_the_rest_wait() -> None:
    """With max_num_seqs=2 and 5 arrivals, 2 run and 3 wait once the first step ends."""
    engine = BatchEngine(LatencyModel(max_num_seqs=2, decode_ms=10, prefill_ms_per_1k=0))
    for request in _requests(5, max_tokens=100):
        engine.submit(request, 0.0)
    assert (len(engine.running), len(engine.waiting)) == (1, 4)  # the first step took one
    first_end = engine.next_event_time()
    assert first_end is not None
    engine.advance(first_end)
    assert (len(engine.running), len(engine.waiting)) == (2, 3)


def test_slower_worker_takes_longer_for_the_same_request() -> None:
    """Speed 0.5 doubles every computed duration (prefill and decode)."""
    fast = simulate(LatencyModel(speed=1.0), _requests(1, max_tokens=20))
    slow = simulate(LatencyModel(speed=0.5), _requests(1, max_tokens=20))
    assert fast[0].duration is not None and slow[0].duration is not None
    assert slow[0].duration > fast[0].duration
    assert abs(slow[0].duration - 2 * fast[0].duration) < 1e-9


def test_prefill_grows_with_uncached_prompt_tokens() -> None:
    """Time to first token of a lone request = prefill(prompt) + one decode step."""
    model = LatencyModel(prefill_ms_per_1k=100, decode_ms=10, decode_growth=0)
    short, long_ = (
        simulate(model, [EngineRequest("a", 1000, 1, 0.0)]),
        simulate(model, [EngineRequest("b", 4000, 1, 0.0)]),
    )
    assert short[0].first_token_at is not None and long_[0].first_token_at is not None
    assert abs(short[0].first_token_at - (0.1 + 0.01)) < 1e-9
    assert abs(long_[0].first_token_at - (0.4 + 0.01)) < 1e-9


def test_decode_step_grows_with_batch_size() -> None:
    """Per-token time at batch 8 is (1 + growth * 7) times the batch-1 time."""
    model = LatencyModel(decode_ms=10, decode_growth=0.1, prefill_ms_per_1k=0)
    alone = simulate(model, _requests(1, max_tokens=50))[0]
    crowd = simulate(model, _requests(8, max_tokens=50))[7]
    assert alone.token_times is not None and crowd.token_times is not None
    gap_alone = alone.token_times[10] - alone.token_times[9]
    gap_crowd = crowd.token_times[10] - crowd.token_times[9]  # all 8 running by then
    assert abs(gap_alone - 0.010) < 1e-9
    assert abs(gap_crowd - 0.010 * 1.7) < 1e-9


def test_prefix_cache_hit_cuts_prefill_and_is_counted() -> None:
    """A second request with the same cache key prefills only what is not cached."""
    model = LatencyModel(prefill_ms_per_1k=100, decode_ms=1)
    first = EngineRequest("a", 2000, 2, 0.0, cache_key="session-1")
    second = EngineRequest("b", 2100, 2, 10.0, cache_key="session-1")
    other = EngineRequest("c", 2100, 2, 20.0, cache_key="session-2")
    engine = BatchEngine(model)
    for request in (first, second, other):
        engine.submit(request, request.arrival)
        while (end := engine.next_event_time()) is not None:
            engine.advance(end)
    assert second.cached_tokens == 2002  # prompt + generated tokens of the first turn
    assert other.cached_tokens == 0
    assert engine.counters.prefix_hit_requests == 1
    assert engine.counters.prefix_hits_tokens == 2002
    assert engine.counters.prefix_queries_tokens == 2000 + 2100 + 2100
    ttft = [r.first_token_at - r.arrival for r in (second, other) if r.first_token_at is not None]
    assert ttft[0] < ttft[1] / 5


def test_prefix_cache_is_lru() -> None:
    """The least recently used key is the one evicted."""
    cache = PrefixCache(2)
    cache.store("a", 100)
    cache.store("b", 100)
    assert cache.lookup("a", 200) == 100  # touch a
    cache.store("c", 100)
    assert cache.lookup("b", 200) == 0
    assert cache.lookup("a", 200) == 100
    assert cache.lookup("c", 50) == 49  # never the whole prompt


def test_stall_freezes_tokens_while_requests_keep_running() -> None:
    """Stalled: running > 0, the token counter is flat, no step end is due; resume continues."""
    engine = BatchEngine(LatencyModel(decode_ms=10, prefill_ms_per_1k=0))
    request = EngineRequest("a", 10, 100, 0.0)
    engine.submit(request, 0.0)
    engine.advance(0.095)
    tokens = engine.counters.generation_tokens
    assert tokens == 9
    engine.stall(0.095)
    engine.advance(5.0)
    assert engine.next_event_time() is None
    assert engine.counters.generation_tokens == tokens
    assert len(engine.running) == 1
    engine.resume(5.0)
    engine.advance(5.006)
    assert engine.counters.generation_tokens == tokens + 1  # the interrupted step's 5 ms remained


def test_same_arrivals_give_the_same_timings() -> None:
    """Determinism: the model is a function of its inputs."""
    model = LatencyModel(max_num_seqs=3, decode_growth=0.05)
    arrivals = [EngineRequest(f"r{i}", 100 + 37 * i, 5 + i, i * 0.013) for i in range(12)]
    again = [EngineRequest(r.request_id, r.prompt_tokens, r.max_tokens, r.arrival) for r in arrivals]
    first = simulate(model, arrivals)
    second = simulate(model, again)
    assert [r.token_times for r in first] == [r.token_times for r in second]
    assert all(r.finished_at is not None for r in first)


def test_block_prefix_cache_hits_only_the_shared_leading_blocks() -> None:
    """Chained block hashes: two prompts that share a long system prompt and differ after it
    hit exactly the shared blocks, a prompt that differs in its first block hits nothing, and
    the least recently used blocks go first when the cache is full."""
    from confgen.simulate._engine import BLOCK_TOKENS, BlockPrefixCache
    from confgen.simulate._server import block_hashes

    shared = "s" * 64 * 10  # 10 full blocks of 64 characters (16 tokens of 4 characters)
    a = block_hashes(shared + "a" * 64 * 3 + "tail", "m")
    b = block_hashes(shared + "b" * 64 * 2, "m")
    assert len(a) == 13 and len(b) == 12  # the partial trailing block is not hashed
    assert a[:10] == b[:10] and a[10] != b[10]
    assert block_hashes(shared, "other-model")[0] != a[0]  # seeded with the model
    cache = BlockPrefixCache(capacity_blocks=20)
    cache.store(a, 13 * BLOCK_TOKENS)
    assert cache.lookup(b, 12 * BLOCK_TOKENS) == 10 * BLOCK_TOKENS
    assert cache.lookup(block_hashes("x" + shared, "m"), 200) == 0
    assert cache.lookup(a, 13 * BLOCK_TOKENS) == 13 * BLOCK_TOKENS - 1  # never the whole prompt
    cache.store(b, 12 * BLOCK_TOKENS)  # 2 new blocks: 15 held
    cache.store(block_hashes("z" * 64 * 8, "m"), 8 * BLOCK_TOKENS)  # 23 > 20: the 3 oldest go
    assert len(cache) == 20
    assert cache.lookup(a, 1000) == 10 * BLOCK_TOKENS  # a's own 3 tail blocks were the oldest


def test_engine_with_block_cache_skips_the_prefill_of_cached_blocks() -> None:
    """A BatchEngine with prefix_cache_blocks sizes its cache from the KV size and prefills
    only the uncached tokens of a prompt that shares a prefix with an earlier one."""
    from confgen.simulate._server import block_hashes

    model = LatencyModel(decode_ms=10, prefill_ms_per_1k=100, kv_cache_tokens=16 * 64)
    engine = BatchEngine(model, prefix_cache_blocks=True)
    assert engine.cache.capacity == 64
    shared = "q" * 64 * 40
    first = EngineRequest("a", 41 * 16, 2, 0.0, cache_key=block_hashes(shared + "1" * 64, "m"))
    second = EngineRequest("b", 41 * 16, 2, 5.0, cache_key=block_hashes(shared + "2" * 64, "m"))
    for request in (first, second):
        engine.submit(request, request.arrival)
        while (end := engine.next_event_time()) is not None:
            engine.advance(end)
    assert first.cached_tokens == 0 and second.cached_tokens == 40 * 16
    assert second.first_token_at is not None and first.first_token_at is not None
    assert second.first_token_at - second.arrival < (first.first_token_at - first.arrival) / 5
