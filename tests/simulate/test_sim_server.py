"""The simulated worker over HTTP: wire formats, batching seen in /metrics, determinism."""

import asyncio
import json
from typing import Any

from confgen.simulate import Fleet, FleetSpec, WorkerSpec, run_fleet_in_thread

from ._helpers import complete, poll, scrape, session, sse_events, value

FAST = {"decode_ms": 2.0, "prefill_ms_per_1k": 5.0}


def test_completion_json_echoes_model_and_reports_usage() -> None:
    """POST /v1/completions: max_tokens honoured, model echoed, usage, x-sim-worker header."""
    spec = FleetSpec((WorkerSpec(name="w", models=("a", "b"), **FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            status, body, worker = await complete(s, fleet.urls[0], model="b", prompt="x" * 400, max_tokens=7)
            assert (status, worker) == (200, "w")
            assert body["model"] == "b" and body["object"] == "text_completion"
            assert len(body["choices"][0]["text"].split()) == 7
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"] == {
                "prompt_tokens": 100,
                "completion_tokens": 7,
                "total_tokens": 107,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            async with s.get(fleet.urls[0] + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["a", "b"]

    asyncio.run(run())


def test_unknown_model_is_an_openai_404() -> None:
    """A model this worker does not serve: 404 with an OpenAI-style error, like vLLM."""
    spec = FleetSpec((WorkerSpec(models=("a",), **FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            status, body, _ = await complete(s, fleet.urls[0], model="nope", max_tokens=1)
            assert status == 404
            assert body["error"]["code"] == 404 and "nope" in body["error"]["message"]
            async with s.post(fleet.urls[0] + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400

    asyncio.run(run())


def test_an_answer_the_client_says_is_shorter_than_max_tokens_stops_on_its_own() -> None:
    """x-sim-answer-tokens: N below max_tokens ends the answer at N tokens with finish reason "stop" (a
    model's end of sequence; max_tokens only bounds it), counted so in vLLM's request_success_total; at
    or above max_tokens the bound holds ("length"); a value that is not a positive integer is a 400."""
    spec = FleetSpec((WorkerSpec(name="w", **FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]

            async def answer(tokens: str) -> tuple[int, dict[str, Any]]:
                async with s.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 64},
                                  headers={"x-sim-answer-tokens": tokens}) as r:
                    return r.status, json.loads(await r.text())
            status, body = await answer("5")
            assert status == 200 and body["usage"]["completion_tokens"] == 5
            assert body["choices"][0]["finish_reason"] == "stop"
            status, body = await answer("500")
            assert status == 200 and body["usage"]["completion_tokens"] == 64
            assert body["choices"][0]["finish_reason"] == "length"
            for bad in ("0", "-3", "five", "1e3", "1000001", "9" * 5000):
                assert (await answer(bad))[0] == 400, bad
            samples = await scrape(s, url)
            reasons = {labels["finished_reason"]: v for labels, v in samples["vllm:request_success_total"]}
            assert reasons["stop"] == 1 and reasons["length"] == 1

    asyncio.run(run())


def test_sse_framing_ends_with_done_and_carries_usage() -> None:
    """Streaming: one data chunk per token, usage chunk with include_usage, then [DONE]."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            events = await sse_events(
                s, url, "/v1/completions",
                {"prompt": "abc", "max_tokens": 5, "stream_options": {"include_usage": True}},
            )  # fmt: skip
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [None] * 4 + ["length"]
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
            chat = await sse_events(
                s, url, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                 "stream_options": {"include_usage": True}},
            )  # fmt: skip
            assert chat[-1] == "[DONE]"
            parsed = [json.loads(e) for e in chat[:-1]]
            assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
            assert parsed[0]["object"] == "chat.completion.chunk"
            assert sum(1 for p in parsed if p["choices"] and p["choices"][0]["delta"].get("content")) == 3
            assert parsed[-1]["usage"]["total_tokens"] == parsed[-1]["usage"]["prompt_tokens"] + 3
            no_usage = await sse_events(s, url, "/v1/completions", {"prompt": "abc", "max_tokens": 2})
            assert all("usage" not in json.loads(e) for e in no_usage[:-1])

    asyncio.run(run())


def test_queueing_reported_in_metrics() -> None:
    """max_num_seqs=2 and 5 concurrent requests: /metrics shows 2 running and 3 waiting."""
    spec = FleetSpec((WorkerSpec(max_num_seqs=2, decode_ms=20, prefill_ms_per_1k=0),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            tasks = [asyncio.create_task(complete(s, url, prompt=f"p{i}", max_tokens=25)) for i in range(5)]

            async def queued() -> bool:
                m = await scrape(s, url)
                return (value(m, "vllm:num_requests_running"), value(m, "vllm:num_requests_waiting")) == (2, 3)

            await poll(queued)
            results = await asyncio.gather(*tasks)
            assert [r[0] for r in results] == [200] * 5
            m = await scrape(s, url)
            assert value(m, "vllm:generation_tokens_total") == 125
            assert value(m, "vllm:num_requests_waiting") == 0

    asyncio.run(run())


def test_slower_worker_reports_longer_model_durations() -> None:
    """Same request on speed 1 and speed 0.5 workers: the e2e time in /metrics doubles."""
    spec = FleetSpec(tuple(WorkerSpec(speed=sp, decode_ms=3, prefill_ms_per_1k=20) for sp in (1.0, 0.5)))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            sums = []
            for url in fleet.urls:
                assert (await complete(s, url, prompt="y" * 2000, max_tokens=10))[0] == 200
                sums.append(value(await scrape(s, url), "vllm:e2e_request_latency_seconds_sum"))
            # Durations come from the model (steps chained from the arrival), not wall clock.
            assert abs(sums[1] - 2 * sums[0]) < 1e-6
            assert sums[0] > 0

    asyncio.run(run())


def test_prefix_cache_hits_counted() -> None:
    """Same prompt prefix, or same x-session-id: cached_tokens in usage and hits in metrics/stats."""
    spec = FleetSpec((WorkerSpec(**FAST),))
    with run_fleet_in_thread(spec) as fleet:
        url = fleet.urls[0]

        async def run() -> None:
            async with session() as s:
                prompt = "shared system prompt " * 40
                first = (await complete(s, url, prompt=prompt + "q1", max_tokens=2))[1]
                second = (await complete(s, url, prompt=prompt + "q2", max_tokens=2))[1]
                assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
                headers = {"x-session-id": "conv-1"}
                for text in ("turn one", "something else entirely"):
                    async with s.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 2},
                                      headers=headers) as r:  # fmt: skip
                        last: dict[str, Any] = await r.json()
                assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                m = await scrape(s, url)
                assert value(m, "vllm:prefix_cache_hits_total") > 100

        asyncio.run(run())
        stats = fleet.workers[0].stats()
        assert stats["prefix_cache"]["hits"] == 2
        assert stats["prefix_cache"]["lookups"] == 4


def test_block_prefix_cache_hits_the_shared_blocks_and_ignores_the_session_header() -> None:
    """prefix_cache_mode blocks: a chat request that shares the system prompt of an earlier one hits
    the shared 16-token blocks only (not its own different tail), whatever x-session-id says; a
    request with the same session id but another text hits nothing; cache_config_info reports
    the block cache's size."""
    spec = FleetSpec((WorkerSpec(**FAST, prefix_cache_mode="blocks", kv_cache_tokens=16 * 512),))
    with run_fleet_in_thread(spec) as fleet:
        url = fleet.urls[0]

        async def run() -> list[int]:
            system = {"role": "system", "content": "tools and instructions " * 60}  # 1,380 characters
            cached = []
            async with session() as s:
                for headers, messages in (
                    ({"x-session-id": "a"}, [system, {"role": "user", "content": "first task " * 30}]),
                    ({"x-session-id": "b"}, [system, {"role": "user", "content": "another one " * 30}]),
                    ({"x-session-id": "b"}, [{"role": "user", "content": "unrelated " * 60}]),
                ):
                    async with s.post(url + "/v1/chat/completions", headers=headers,
                                      json={"messages": messages, "max_tokens": 2}) as r:
                        body: dict[str, Any] = await r.json()
                    cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                m = await scrape(s, url)
                assert m["vllm:cache_config_info"][0][0]["num_gpu_blocks"] == "512"
            return cached

        first, second, third = asyncio.run(run())
        shared = len("system: " + "tools and instructions " * 60 + "\nuser: ")  # common leading text
        assert first == 0 and third == 0
        assert second == (shared // 64) * 16  # the full 64-character blocks of the shared text


def test_stats_expose_last_headers_and_status_counts() -> None:
    """/_sim/stats: counts per status, completed, and the last request's headers."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            await complete(s, url, max_tokens=1)
            await complete(s, url, model="missing", max_tokens=1)
            async with s.get(url + "/health", headers={"X-Probe": "yes"}) as r:
                assert r.status == 200 and await r.text() == ""
            async with s.get(url + "/_sim/stats") as r:
                stats = await r.json()
            assert stats["by_status"] == {"200": 2, "404": 1}
            assert stats["completed"] == 1 and stats["received"] == 3 and stats["in_flight"] == 0
            assert stats["last_headers"]["X-Probe"] == "yes"
            assert stats["authorization_seen"] == 0
            async with s.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1},
                              headers={"Authorization": "Bearer sk-secret"}) as r:  # fmt: skip
                assert r.status == 200
            async with s.get(url + "/_sim/stats") as r:
                stats = await r.json()
            assert stats["last_inference_headers"]["Authorization"] == "Bearer sk-secret"
            assert stats["authorization_seen"] == 1

    asyncio.run(run())


def test_tgi_answers_429_above_its_capacity_and_vllm_queues() -> None:
    """Overload: TGI rejects with 429 when its queue is full; vLLM (no limit) queues them all."""
    tgi = WorkerSpec(name="tgi", engine="tgi", max_num_seqs=1, max_queue=1, decode_ms=20, prefill_ms_per_1k=0)
    vllm = WorkerSpec(name="vllm", max_num_seqs=1, decode_ms=5, prefill_ms_per_1k=0)

    async def run() -> None:
        async with Fleet(FleetSpec((tgi, vllm))) as fleet, session() as s:
            results = await asyncio.gather(
                *(complete(s, fleet.urls[0], prompt=f"{i}", max_tokens=10) for i in range(4))
            )
            statuses = sorted(r[0] for r in results)
            assert statuses.count(429) >= 1 and statuses.count(200) >= 2
            rejected = next(r[1] for r in results if r[0] == 429)
            assert rejected == {"error": "Model is overloaded", "error_type": "overloaded"}
            results = await asyncio.gather(*(complete(s, fleet.urls[1], prompt=f"{i}", max_tokens=3) for i in range(6)))
            assert [r[0] for r in results] == [200] * 6

    asyncio.run(run())


def test_health_and_metrics_per_engine_kind() -> None:
    """Each kind serves its own health body and a parseable /metrics with its names."""
    kinds = {"vllm": "vllm:num_requests_running", "vllm_v0": "vllm:gpu_cache_usage_perc",
             "sglang": "sglang:num_queue_reqs", "tgi": "tgi_queue_size",
             "llamacpp": "llamacpp:requests_deferred"}  # fmt: skip
    spec = FleetSpec(tuple(WorkerSpec(engine=k, **FAST) for k in (*kinds, "openai")))  # type: ignore[arg-type]

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            by_kind = {w.spec.engine: w.url for w in fleet.workers}
            for kind, name in kinds.items():
                assert name in await scrape(s, by_kind[kind]), kind
            async with s.get(by_kind["llamacpp"] + "/health") as r:
                assert (r.status, await r.json()) == (200, {"status": "ok"})
            async with s.get(by_kind["sglang"] + "/health_generate") as r:
                assert r.status == 200
            async with s.get(by_kind["openai"] + "/metrics") as r:
                assert r.status == 404
            assert (await complete(s, by_kind["openai"], max_tokens=1))[0] == 200

    asyncio.run(run())


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    """Determinism: the generated text depends on the seed and the prompt only."""

    def texts(seed: int) -> list[str]:
        spec = FleetSpec((WorkerSpec(**FAST), WorkerSpec(**FAST)), seed=seed)

        async def run() -> list[str]:
            async with Fleet(spec) as fleet, session() as s:
                out = []
                for url in fleet.urls:
                    for prompt in ("alpha", "beta"):
                        out.append((await complete(s, url, prompt=prompt, max_tokens=12))[1]["choices"][0]["text"])
                return out

        return asyncio.run(run())

    first, again, other = texts(7), texts(7), texts(8)
    assert first == again
    assert first[0] == first[2]  # same prompt, other worker: same answer
    assert first != other


def test_llamacpp_answers_with_its_own_model_whatever_is_asked() -> None:
    """Like the real llama-server (tests/realengine): one model per server, the request's
    `model` ignored (no 404), the answer naming the server's own model; other kinds still
    refuse a model they do not serve."""
    spec = FleetSpec((WorkerSpec(engine="llamacpp", models=("tiny",), **FAST),  # type: ignore[arg-type]
                      WorkerSpec(engine="vllm", models=("tiny",), **FAST)))  # type: ignore[arg-type]

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            llama, vllm = fleet.urls
            for asked in ("tiny", "another"):
                status, body, _ = await complete(s, llama, model=asked, max_tokens=2)
                assert (status, body["model"]) == (200, "tiny")
            assert (await complete(s, vllm, model="another", max_tokens=2))[0] == 404

    asyncio.run(run())
