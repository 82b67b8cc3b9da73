"""Three real llama-servers behind the rendered Envoy and the sidecar as shipped.

Requests through Envoy, streamed and not, carry usage; /v1/models is answered by the sidecar
(started without --listen: it listens on the topology's sidecar.port, where Envoy asks); the
sidecar parses the real /metrics on every probe (busy slots, deferred requests, prompt-cache
counters, no KV gauge); a killed server is taken out and readmitted when it comes back.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.realengine.rig import RealRig, real_rig, sse_events
from tests.realengine.servers import LOADING_CONTEXT, MODEL_ALIAS, LlamaServer, http, llama_servers, now, wait

Start = Callable[..., AbstractContextManager[list[LlamaServer]]]
SERVING = {"HEALTHY", "DEGRADED"}  # DEGRADED still takes traffic (a slow probe on a loaded machine)


@pytest.fixture(scope="module")
def rig(llama_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealRig]:
    tmp = tmp_path_factory.mktemp("real-rig")
    with ExitStack() as stack:
        servers = stack.enter_context(llama_servers(llama_binary, tiny_model, tmp, 3, slots=4, context=16384))
        yield stack.enter_context(real_rig(tmp, servers, capacity=4))


def _ok(rig: RealRig, body: dict[str, object], path: str = "/v1/completions") -> bytes:
    status, raw = rig.post(body, path)
    assert status == 200, raw
    return raw


def test_non_streamed_answers_through_envoy_carry_usage(rig: RealRig) -> None:
    """Completions and chat through Envoy: 200, plain ASCII text, `usage` with exactly
    max_tokens generated (the model cannot stop early), the server's own model name."""
    for i in range(6):
        answer = json.loads(_ok(rig, {"prompt": f"hello {i}", "max_tokens": 12}))
        assert answer["usage"]["completion_tokens"] == 12 and answer["usage"]["prompt_tokens"] > 0
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["choices"][0]["text"].isascii() and answer["model"] == MODEL_ALIAS
    chat = json.loads(_ok(rig, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9},
                          "/v1/chat/completions"))
    assert chat["usage"]["completion_tokens"] == 9
    assert chat["choices"][0]["message"]["content"].isascii()


def test_streamed_answers_through_envoy_end_with_usage(rig: RealRig) -> None:
    """Streamed completions and chat through Envoy arrive as server-sent events, one token a
    chunk, and with stream_options.include_usage the last chunk reports the usage."""
    for path, body in (
        ("/v1/completions", {"prompt": "stream me"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "stream me"}]}),
    ):
        raw = _ok(rig, {**body, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}, path)
        assert raw.rstrip().endswith(b"data: [DONE]")
        events = sse_events(raw)
        usage = [e["usage"] for e in events if e.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 16, events[-2:]
        texts = [c.get("text") or (c.get("delta") or {}).get("content") or "" for e in events for c in e["choices"]]
        assert "".join(texts).isascii() and sum(1 for t in texts if t) >= 8


def test_models_answered_by_the_sidecar_on_the_topologys_port(rig: RealRig) -> None:
    """GET /v1/models through Envoy reaches the sidecar (Envoy's `confgen.sidecar` cluster
    counts a 200), which was started without --listen: the topology's sidecar.port is the one
    address both use."""
    before = int(rig.envoy.stats().get("cluster.confgen.sidecar.upstream_rq_200", 0))
    status, _, body = http("GET", rig.url("/v1/models"))
    assert status == 200
    assert [m["id"] for m in json.loads(body)["data"]] == [MODEL_ALIAS]
    after = int(rig.envoy.stats().get("cluster.confgen.sidecar.upstream_rq_200", 0))
    assert after == before + 1


def _probe_errors(rig: RealRig) -> float:
    total = 0.0
    for line in rig.sidecar.metrics().splitlines():
        if line.startswith("confgen_sidecar_probe_errors_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _cycles(rig: RealRig) -> float:
    match = re.search(r"^confgen_sidecar_probe_cycles_total (\S+)$", rig.sidecar.metrics(), re.M)
    return float(match.group(1)) if match else 0.0


def test_the_sidecar_reads_the_real_load_on_every_probe(rig: RealRig) -> None:
    """Under load through Envoy, every probe of every real server parses (no probe error over
    the cycles), the sidecar sees requests running on the servers and the prompt cache's
    counters, and never a KV usage (llama.cpp has none)."""
    errors, cycles = _probe_errors(rig), _cycles(rig)
    running_seen: set[int] = set()

    def busy() -> bool:
        for server in rig.servers:
            sample = rig.endpoint(server)["sample"]
            assert sample is not None and sample["kv_usage"] is None
            assert sample["prefix_hits"] is not None and sample["prefix_queries"] is not None
            if sample["running"] > 0:
                running_seen.add(server.port)
        return len(running_seen) == len(rig.servers)

    # One request a slot (3 servers x 4), all at once, again while a server has not been seen running
    # (Envoy's balancer may leave one idle in a wave; at most 3 waves); a client timeout a loaded CI
    # machine cannot reach (a wave took ~10 s idle, over 30 s under the parallel suite).
    with ThreadPoolExecutor(12) as pool:
        futures: list[Any] = []
        try:
            for _ in range(3):
                futures += [pool.submit(rig.post, {"prompt": f"load {i}", "max_tokens": 2000}, timeout=170.0)
                            for i in range(12)]
                if wait(busy, timeout=25.0, interval=0.1):
                    break
            assert busy(), running_seen
        finally:
            statuses = [f.result(timeout=180)[0] for f in futures]
    assert statuses == [200] * len(futures)
    assert wait(lambda: _cycles(rig) >= cycles + 4, timeout=30.0)
    assert _probe_errors(rig) == errors, rig.sidecar.log_tail()
    hits = [rig.endpoint(s)["sample"]["prefix_queries"] for s in rig.servers]
    assert all(h > 0 for h in hits)


def test_killed_and_stalled_servers_are_taken_out_and_readmitted(
    llama_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """SIGKILL one of three real servers: the sidecar marks it unhealthy and every request
    through Envoy is still answered; the server restarted on its port is readmitted and
    serves again. SIGSTOP another (a stall): unhealthy by probe timeouts, readmitted after
    SIGCONT. Times are measured (printed), bounds are generous for a loaded machine."""
    with llama_servers(llama_binary, tiny_model, tmp_path, 3, slots=2) as servers, \
            real_rig(tmp_path, servers, capacity=2) as rig:
        victim = servers[0]
        assert wait(lambda: rig.endpoint(victim)["status"] in SERVING, timeout=20.0)
        killed = now()
        victim.kill()
        assert wait(lambda: rig.endpoint(victim)["status"] == "UNHEALTHY", timeout=20.0), rig.endpoint(victim)
        out_s = now() - killed
        answers = [rig.post({"prompt": f"after kill {i}", "max_tokens": 4})[0] for i in range(20)]
        assert answers == [200] * 20
        restarted = now()
        victim.start()
        victim.wait_ready()
        assert wait(lambda: rig.endpoint(victim)["status"] in SERVING, timeout=30.0), rig.endpoint(victim)
        back_s = now() - restarted
        served = victim.metric("llamacpp:tokens_predicted_total")

        def victim_serves() -> bool:
            assert rig.post({"prompt": "again", "max_tokens": 4})[0] == 200
            return victim.metric("llamacpp:tokens_predicted_total") > served

        assert wait(victim_serves, timeout=30.0)
        print(f"killed server unhealthy after {out_s:.2f} s; restarted server readmitted after {back_s:.2f} s")

        # A stalled engine (stopped, its socket still open) is taken out by probe timeouts
        # and readmitted once it runs again.
        stalled = servers[1]
        assert stalled.proc is not None
        stalled.proc.send_signal(signal.SIGSTOP)
        try:
            assert wait(lambda: rig.endpoint(stalled)["status"] == "UNHEALTHY", timeout=20.0), rig.endpoint(stalled)
        finally:
            stalled.proc.send_signal(signal.SIGCONT)
        assert wait(lambda: rig.endpoint(stalled)["status"] in SERVING, timeout=30.0), rig.endpoint(stalled)


def test_a_server_loading_its_model_is_kept_out_until_ready(
    llama_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """A third server starts behind a running rig and spends ~1.5 s loading (a large KV cache),
    answering 503 "Loading model" on /health and /metrics: the sidecar sees those 503s and keeps
    it out, every request through Envoy is answered by the other two meanwhile, and once it has
    loaded it is admitted and serves."""
    with llama_servers(llama_binary, tiny_model, tmp_path, 2, slots=2) as servers:
        late = LlamaServer(llama_binary, tiny_model, tmp_path / "late.log", slots=1, context=LOADING_CONTEXT)
        try:
            with real_rig(tmp_path, [*servers, late], capacity=2) as rig:
                assert wait(lambda: rig.endpoint(late)["status"] == "UNHEALTHY", timeout=20.0)
                late.start()
                during: list[tuple[str, int]] = []
                while late.get("/health", timeout=10.0)[0] == 503:
                    during.append((rig.endpoint(late)["status"], rig.post({"prompt": "x", "max_tokens": 2})[0]))
                assert during, "the server was ready before the first look"
                assert {status for status, _ in during} == {"UNHEALTHY"}
                assert {answer for _, answer in during} == {200}
                assert rig.endpoint(late)["errors"].get("http_status", 0) >= 1, rig.endpoint(late)
                assert wait(lambda: rig.endpoint(late)["status"] in SERVING, timeout=30.0), rig.endpoint(late)
                served = late.metric("llamacpp:tokens_predicted_total")

                def late_serves() -> bool:
                    assert rig.post({"prompt": "again", "max_tokens": 4})[0] == 200
                    return late.metric("llamacpp:tokens_predicted_total") > served

                assert wait(late_serves, timeout=30.0)
        finally:
            late.stop()


def _served_by(servers: list[LlamaServer], before: list[float]) -> int:
    """The index of the one server whose generated-token counter moved since `before`."""
    moved = [i for i, s in enumerate(servers) if s.metric("llamacpp:tokens_predicted_total") > before[i]]
    assert len(moved) == 1, moved
    return moved[0]


def _picks(rig: RealRig) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in rig.sidecar.metrics().splitlines()
               if line.startswith("confgen_picker_picks_total{"))


def test_prefix_affinity_sends_a_conversation_back_to_the_engine_holding_its_cache(
    llama_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The picker (policy prefix_affinity) against real engines: plain chat clients resend
    their growing conversations, one turn at a time; each turn goes back to the server that
    answered the conversation's first turn, and that server's own counter shows the reuse
    (`prompt_tokens_cached_total`, llama.cpp's prompt cache). Measured here: 24 of 24 turns
    home, 91 % of their prompt tokens reused; least_request on the same idle servers sent 6 of
    24 home and reused 52 %. A pick that misses its deadline on a loaded machine goes by
    least_request, hence the bars at 3 in 4 turns and 70 % of the tokens rather than all."""
    system = "You answer questions about the proxy, the queue and the cache of the model server fleet. " * 6
    with llama_servers(llama_binary, tiny_model, tmp_path, 3, slots=4, context=16384) as servers, \
            real_rig(tmp_path, servers, policy="prefix_affinity") as rig:
        assert wait(lambda: rig.post({"prompt": "warm up", "max_tokens": 2})[0] == 200 and _picks(rig) > 0,
                    timeout=30.0), rig.sidecar.log_tail()
        same, follow_ups, cached, prompt = 0, 0, 0.0, 0.0
        for conv in range(6):
            # Distinct from the first token: no conversation shares a cached prefix with another.
            messages = [{"role": "system", "content": f"Conversation {conv}. {system}"}]
            home = None
            for turn in range(5):
                messages.append({"role": "user", "content": f"question {turn} of conversation {conv}"})
                before = [s.metric("llamacpp:tokens_predicted_total") for s in servers]
                hits = [s.metric("llamacpp:prompt_tokens_cached_total") for s in servers]
                status, raw = rig.post({"messages": messages, "max_tokens": 8}, "/v1/chat/completions")
                assert status == 200, raw
                answer = json.loads(raw)
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
                served = _served_by(servers, before)
                if home is None:
                    home = served
                    continue
                follow_ups += 1
                same += served == home
                cached += servers[served].metric("llamacpp:prompt_tokens_cached_total") - hits[served]
                prompt += answer["usage"]["prompt_tokens"]
        print(f"prefix_affinity: {same} of {follow_ups} follow-up turns on their conversation's server; "
              f"the engines reused {cached / prompt:.0%} of those turns' prompt tokens from their cache")
        assert same >= 0.75 * follow_ups, (same, follow_ups)
        assert cached >= 0.7 * prompt, (cached, prompt)
