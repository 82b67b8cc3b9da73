"""Global limits' bounds under what a client controls and what fails, live: real Envoys with
their real sidecars, one real redis-server, a simulated fleet.

- 20 concurrent streams without max_tokens, each able to generate 2,000 tokens (the pool's
  max_output_tokens), on a 10,000-token budget: admitted tokens <= the budget + one request's
  worst case (each reserves its pool's maximum, not a constant).
- Redis unreachable (SIGSTOP) while answers end, then back: every admitted token is charged
  (Redis counters equal the answers' usage) within 10 s of its return; no reservation left.
- Every Redis call timing out (limits.store.timeout 1ms): the local floor holds a flood to the
  budget + the floors' share, never unlimited; the floor's decisions are counted per key.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.sidecar_live.glimits import GlobalRig, call, global_rig, spread, usage_of, wait_for_window
from tests.support.envoy import wait_until

pytestmark = pytest.mark.slow


def _metric(rig: GlobalRig, name: str, **labels: str) -> float:
    total = 0.0
    for pair in rig.pairs:
        assert pair.sidecar is not None
        for line in pair.sidecar.metrics().splitlines():
            if not (line.startswith(name + " ") or line.startswith(name + "{")):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _stream(prompt: str = "write a long story", max_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim-model", "prompt": prompt, "stream": True,
                            "stream_options": {"include_usage": True}}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def test_streams_without_max_tokens_reserve_the_pools_maximum(tmp_path: Path) -> None:
    budget, worst_output = 10_000, 2000
    with global_rig(tmp_path, envoys=3, envoys_in_store=3, decode_ms=0.2, default_max_tokens=worst_output,
                    pool_extra=[f"max_output_tokens: {worst_output}"]) as rig:
        wait_for_window(60, window=3600)
        bodies = [_stream() for _ in range(20)]
        results = spread(rig, "tok10k", bodies, concurrency=20)
        statuses = [r[0] for r in results]
        assert set(statuses) <= {200, 429}, statuses
        usages = [usage_of(s, p, True) for s, _, p, _ in results if s == 200]
        assert all(u is not None for u in usages)
        tokens = sum(u["total_tokens"] for u in usages if u)
        longest = max(u["completion_tokens"] for u in usages if u)
        worst = worst_output + -(-len(b'{"model": "sim-model", "prompt": "write a long story", "stream": true, '
                                      b'"stream_options": {"include_usage": true}}') // 4)
        print(f"\n20 streams without max_tokens: {len(usages)} admitted, {tokens} tokens for a budget of {budget} "
              f"(worst case of one request {worst}, longest answer {longest} tokens)")
        assert longest > 1000  # the simulator really generated long answers (up to 2,000)
        assert tokens <= budget + worst, (tokens, budget, worst)
        # every answer charged its usage (the stream-done calls are fire-and-forget)
        assert wait_until(lambda: rig.counted("client/tok10k/0") == tokens, timeout=10), \
            (rig.counted("client/tok10k/0"), tokens)


def _pause(rig: GlobalRig, resume: bool = False) -> None:
    os.kill(rig.redis.pid, signal.SIGCONT if resume else signal.SIGSTOP)  # our own redis-server, by pid


def test_charges_missed_while_redis_is_unreachable_are_applied_when_it_returns(tmp_path: Path) -> None:
    streams = 6
    with global_rig(tmp_path, envoys=2, envoys_in_store=2, decode_ms=25.0) as rig:  # output_tokens, an hour
        wait_for_window(60, window=3600)
        results: list[tuple[int, dict[str, str], bytes, dict[str, Any]]] = []
        worker = threading.Thread(target=lambda: results.extend(
            spread(rig, "out", [_stream(max_tokens=40) for _ in range(streams)], concurrency=streams)))
        worker.start()
        paused = False
        try:
            # all admitted (their reservations are in Redis) and generating: make Redis unreachable
            assert wait_until(lambda: rig.reserved("client/out/0") >= streams * 40, timeout=10)
            _pause(rig)
            paused = True
            worker.join(timeout=30)
            assert not worker.is_alive()
            assert [r[0] for r in results] == [200] * streams
            # each answer's end charge went to the sidecars' journals
            assert wait_until(lambda: _metric(rig, "confgen_sidecar_ratelimit_journal_entries") >= streams,
                              timeout=10)
        finally:
            if paused:
                _pause(rig, resume=True)
        back = time.monotonic()
        spent = sum(u["completion_tokens"] for u in (usage_of(s, p, True) for s, _, p, _ in results) if u)
        assert wait_until(lambda: rig.counted("client/out/0") == spent, timeout=10), \
            (rig.counted("client/out/0"), spent)
        charged_after = time.monotonic() - back
        assert wait_until(lambda: rig.reserved("client/out/0") == 0, timeout=5)
        assert wait_until(lambda: _metric(rig, "confgen_sidecar_ratelimit_journal_entries") == 0, timeout=5)
        assert rig.counted("client/out/0") == spent  # replayed once (a call Redis ran late is not charged twice)
        print(f"\n{streams} answers ended with Redis unreachable: {spent} tokens, all charged "
              f"{charged_after:.2f} s after it returned")


def test_checks_that_time_out_fall_back_to_the_local_floor(tmp_path: Path) -> None:
    limit, envoys = 60, 3
    # Redis stopped (SIGSTOP: connections stay open, nothing answers), so every store call times
    # out; a 1 ms timeout alone left it to chance (a call Redis answered in time was the store's)
    with global_rig(tmp_path, envoys=envoys, envoys_in_store=envoys, store_timeout="50ms") as rig:
        wait_for_window(60, window=3600)
        _pause(rig)
        try:
            flood = spread(rig, "reqh", [{"model": "sim-model", "prompt": "hi", "max_tokens": 1}] * 400,
                           concurrency=8)
            last = call(rig.pairs[0].url, "reqh", {"model": "sim-model", "prompt": "hi", "max_tokens": 1})[0]
        finally:
            _pause(rig, resume=True)
        statuses = [r[0] for r in flood]
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        admitted = statuses.count(200)
        on_floor = _metric(rig, "confgen_sidecar_ratelimit_fail_open_total", budget="client/reqh/0", client="reqh")
        print(f"\nevery store call timing out (Redis stopped, 50 ms): {admitted} of {len(statuses)} admitted for a "
              f"budget of {limit} over {envoys} Envoys; {on_floor:.0f} decisions on the local floor")
        assert on_floor >= len(statuses)  # every one decided on the floor, counted per key
        # each Envoy's floor (limit / envoys) and no more: never the flood
        assert admitted <= envoys * (limit // envoys), admitted
        assert last == 429  # this Envoy's floor is spent
