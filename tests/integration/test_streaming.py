"""Streaming through the real Envoy: a long SSE generation is neither cut nor buffered,
and a stream that goes silent is cut after the pool's idle timeout."""

from __future__ import annotations

from pathlib import Path

from confgen.simulate import FleetSpec, WorkerSpec
from tests.integration._stack import stack, stream

TOPOLOGY = """
version: 1
name: streaming
admin: {address: 127.0.0.1, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
pools:
  - name: long
    engine: vllm
    models: [long]
    health: {enabled: false}
    workers: ["$w_long"]
  - name: stally
    engine: vllm
    models: [stally]
    health: {enabled: false}
    timeouts: {idle: 1s}
    workers: ["$w_stall"]
"""


def _fleet() -> FleetSpec:
    return FleetSpec(
        workers=(
            # 33 tokens at 500 ms per decode step: the generation lasts ~16.5 s.
            WorkerSpec(name="long", models=("long",), decode_ms=500.0, prefill_ms_per_1k=0.0),
            WorkerSpec(name="stall", models=("stally",), decode_ms=100.0),
        ),
        seed=9,
    )


def test_sse_stream_longer_than_15s_passes_uncut_and_unbuffered(tmp_path: Path) -> None:
    """A 16.5 s SSE generation (past Envoy's 15 s default route timeout) arrives whole,
    ending in `data: [DONE]`, and token by token: the first token arrives within a
    second, and the chunks are spread over the whole generation."""
    with stack(TOPOLOGY, _fleet(), tmp_path / "out") as s:
        s.wait_served({"model": "stally", "prompt": "warm", "max_tokens": 1})
        got = stream(s.port, {"model": "long", "prompt": "a long story", "max_tokens": 33}, timeout=10)
        assert (got.status, got.worker) == (200, "long")
        assert got.complete
        assert got.events[-1] == "[DONE]"
        assert len(got.events) == 34  # 33 tokens + [DONE]
        times = [t for t, _ in got.chunks]
        print(f"sse: {len(got.chunks)} chunks, first at {times[0]:.2f}s, last at {times[-1]:.2f}s")
        assert times[-1] > 15.5
        assert times[0] < 1.5
        # Unbuffered: chunks keep coming during the generation, not in one burst at the end.
        assert len(got.chunks) >= 20
        assert sum(1 for t in times if t < times[-1] / 2) >= 10


def test_stream_idle_past_the_idle_timeout_is_cut(tmp_path: Path) -> None:
    """A stream whose worker stalls mid-generation (no bytes for longer than the pool's
    timeouts.idle of 1 s) is cut by Envoy: the client gets the tokens sent so far, no
    [DONE], and a truncated body, about a second after the stall."""
    with stack(TOPOLOGY, _fleet(), tmp_path / "out") as s:
        s.wait_served({"model": "stally", "prompt": "warm", "max_tokens": 1})
        worker = s.worker("stall")
        got = stream(s.port, {"model": "stally", "prompt": "and then", "max_tokens": 100}, timeout=10,
                     on_first_chunk=lambda: worker.set_fault("stall"))  # fmt: skip
        assert (got.status, got.worker) == (200, "stall")
        assert not got.complete
        assert "[DONE]" not in got.events
        assert 1 <= len(got.events) < 100
        silence = got.ended - got.chunks[-1][0]
        print(f"idle cut: {len(got.events)} events, cut {silence:.2f}s after the last chunk, "
              f"downstream_rq_idle_timeout={s.stat('http.public.downstream_rq_idle_timeout')}")  # fmt: skip
        assert 0.9 <= silence < 3.5
        assert s.stat("http.public.downstream_rq_idle_timeout") == 1
