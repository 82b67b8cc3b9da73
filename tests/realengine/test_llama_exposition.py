"""The real llama-server against what our suite believes of it: its /metrics (names, types,
order) is the recorded fixture's and the simulator's; the sidecar's adapter reads its real
signals (busy slots, deferred requests, prompt-cache counters) and expects no KV gauge; its
health answers while the model loads and when every slot is busy; it echoes its own model
name whatever the request asks."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from confgen.simulate import BatchEngine, LatencyModel
from confgen.simulate._metrics_text import MetricsInput, render
from sidecar.observe.engines import extract
from tests.realengine.servers import LOADING_CONTEXT, MODEL_ALIAS, LlamaServer, http, now, wait
from tests.support.exposition import RECORDED_LLAMACPP, families

Start = Callable[..., AbstractContextManager[list[LlamaServer]]]
PROMPT = "the model server proxy token cache queue slot load health route pool worker engine stream " * 6


def _complete(server: LlamaServer, max_tokens: int, prompt: str = "hi", **extra: Any) -> dict[str, Any]:
    status, _, body = http("POST", server.url + "/v1/completions",
                           {"model": MODEL_ALIAS, "prompt": prompt, "max_tokens": max_tokens, **extra}, timeout=120)
    assert status == 200, body
    answer: dict[str, Any] = json.loads(body)
    return answer


def test_metrics_families_are_the_recorded_and_the_simulated_ones(start_llama: Start) -> None:
    """The real server's families with their types, in its order, are exactly the recorded
    fixture's (which the sidecar's tests read) and the simulator's: no KV gauge, the prompt
    cache counter, `n_busy_slots_per_decode` a gauge."""
    with start_llama(1) as (server,):
        _complete(server, 8)
        real = server.metrics_text()
    simulated = render("llamacpp", MetricsInput("m", [BatchEngine(LatencyModel())]))
    assert simulated is not None
    assert families(real) == families(RECORDED_LLAMACPP.read_text()) == families(simulated)
    assert "kv_cache" not in real
    assert ("llamacpp:n_busy_slots_per_decode", "gauge") in families(real)


def test_busy_slots_deferred_requests_and_prompt_cache_as_the_sidecar_reads_them(start_llama: Start) -> None:
    """One slot, three long requests at once: the real server reports one request processing
    and the others deferred, and the sidecar's adapter reads exactly that (no KV usage, which
    llama.cpp does not export); /health stays 200 with every slot busy. The same prompt again
    is served from the prompt cache: `prompt_tokens_cached_total` moves and the adapter's
    prefix hits follow it."""
    with start_llama(1, slots=1, context=8192) as (server,):  # one slot of 8192 tokens
        seen: list[tuple[float, float, float | None]] = []
        health_busy: list[int] = []

        def busy_view() -> bool:
            sample = extract("llamacpp", server.metrics_text().encode())
            assert sample is not None
            seen.append((sample.running, sample.waiting, sample.kv_usage))
            if sample.running == 1 and sample.waiting >= 1:
                health_busy.append(server.get("/health")[0])
                return True
            return False

        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(_complete, server, 6000, f"request {i}") for i in range(3)]
            try:
                assert wait(busy_view, timeout=60.0, interval=0.02), seen[-5:]
            finally:
                answers = [f.result(timeout=180) for f in futures]
        assert health_busy == [200]
        assert all(kv is None for _, _, kv in seen)
        assert [a["usage"]["completion_tokens"] for a in answers] == [6000] * 3

        before = extract("llamacpp", server.metrics_text().encode())
        _complete(server, 4, PROMPT)
        _complete(server, 4, PROMPT)
        after = extract("llamacpp", server.metrics_text().encode())
        assert before is not None and after is not None
        assert before.prefix_hits is not None and after.prefix_hits is not None
        reused = after.prefix_hits - before.prefix_hits
        assert reused >= 100, (before, after)  # the whole prompt but its last token, on the second run
        assert after.prefix_hits == server.metric("llamacpp:prompt_tokens_cached_total")
        assert after.prefix_queries == after.prefix_hits + server.metric("llamacpp:prompt_tokens_total")


def test_the_answer_names_the_servers_model_whatever_was_asked(start_llama: Start) -> None:
    """llama-server serves one model: it ignores the request's `model` and answers with its
    own name (the alias); the simulator does the same for engine llamacpp."""
    with start_llama(1) as (server,):
        for asked in (MODEL_ALIAS, "some-other-model"):
            answer = _complete(server, 4, model=asked)
            assert answer["model"] == MODEL_ALIAS
            assert answer["usage"]["completion_tokens"] == 4
            assert answer["choices"][0]["text"].isascii()


def test_while_the_model_loads_every_path_answers_503_then_all_serve(
    llama_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """llama-server answers HTTP before its model is loaded, and then every path, /metrics
    included, is 503 with the "Loading model" error (the simulator's slow_start does the same);
    once loaded, /health is 200 `{"status": "ok"}` and every path serves."""
    server = LlamaServer(llama_binary, tiny_model, tmp_path / "loading.log", slots=1, context=LOADING_CONTEXT)
    paths = ("/health", "/metrics", "/v1/models", "/v1/completions")
    answers: dict[str, list[tuple[int, bytes]]] = {p: [] for p in paths}
    try:
        server.start()

        def poll(path: str) -> None:
            body = {"model": MODEL_ALIAS, "prompt": "hi", "max_tokens": 1} if path == "/v1/completions" else None
            deadline = now() + 60.0
            while now() < deadline:
                status, _, raw = http("POST" if body else "GET", server.url + path, body, timeout=10.0)
                answers[path].append((status, raw))
                if status == 200:
                    return

        with ThreadPoolExecutor(len(paths)) as pool:
            list(pool.map(poll, paths))
    finally:
        server.stop()
    for path, seen in answers.items():
        loading = [raw for status, raw in seen if status == 503]
        assert loading, f"{path}: no answer while loading ({len(seen)} answers)"
        assert {json.loads(raw)["error"]["message"] for raw in loading} == {"Loading model"}, path
        assert json.loads(loading[0])["error"]["type"] == "unavailable_error"
        assert seen[-1][0] == 200 and all(status in (200, 503) for status, _ in seen), (path, seen[-1])
        assert [status for status, _ in seen] == sorted((status for status, _ in seen), reverse=True), path
    assert json.loads(answers["/health"][-1][1]) == {"status": "ok"}
