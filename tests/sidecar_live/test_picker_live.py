"""The endpoint picker live: simulated fleet + rendered Envoy (prefix_affinity) + the sidecar.

Plain chat clients (no session header) resend growing conversations; the picker must send
each turn back to the worker holding its prefix (the simulator reports its prefix-cache
hits), spill when that worker's queue grows, and never cost a request when it dies or
comes back (Envoy's failure_mode_allow: least_request picks meanwhile).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, WorkerSpec, fleet_topology, run_fleet_in_thread
from tests.sidecar_live.rig import FAST_ARGS, REPO, Rig, SidecarProcess, poll, worker_specs

pytestmark = pytest.mark.timeout(240)


@contextlib.contextmanager
def picker_rig(tmp: Path, workers: Sequence[WorkerSpec], *, capacity: int = 8,
               extra_args: Sequence[str] = (), ready_tokens: int = 4) -> Iterator[Rig]:
    """`ready_tokens`: the answers asked for until the picker has picked one (what a worker learns first)."""
    with run_fleet_in_thread(FleetSpec(workers=tuple(workers), seed=5)) as fleet:
        port, admin, listen, grpc_port = free_port(), free_port(), free_port(), free_port()
        text = fleet_topology(
            name="live", admin=admin, port=port, workers=[f"127.0.0.1:{w.port}" for w in fleet.workers],
            models=["sim-model"], capacity=capacity,
            pool=["balancing: {policy: prefix_affinity}", "health: {enabled: false}",
                  "outlier_detection: {enabled: false}"],
            tail=[f"sidecar: {{port: {listen}, grpc_port: {grpc_port}, grpc_socket_dir: {tmp / 'sockets'}}}"])
        topo_path = tmp / "topology.yaml"
        topo_path.write_text(text)
        xds = tmp / "envoy"
        topo, _ = parse_topology(text.encode())
        write_tree(envoy.render(topo, config_dir=str(xds)), xds, rank=envoy.layout.write_rank)
        args = ["--topology", str(topo_path), "--xds-dir", str(xds), "--listen", f"127.0.0.1:{listen}",
                *FAST_ARGS, *extra_args]
        sidecar = SidecarProcess(args, tmp / "sidecar.log", listen)
        with EnvoyProcess(xds / "bootstrap.json") as proxy:
            sidecar.start()
            try:
                sidecar.wait_ready()
                rig = Rig(fleet, proxy, sidecar, topo_path, xds, port, admin,
                          extra={"grpc_port": grpc_port, "socket": str(tmp / "sockets" / "grpc.sock")})
                assert poll(lambda: _picker_ready(rig, ready_tokens), timeout=30), sidecar.log_tail()
                yield rig
            finally:
                code = sidecar.stop()
            assert code == 0, f"sidecar exited {code} on SIGTERM:\n{sidecar.log_tail()}"


def _picker_ready(rig: Rig, tokens: int = 4) -> bool:
    """The picker has the fleet view: a request gets picked (counted by reason)."""
    status, _ = chat(rig, [{"role": "user", "content": "warm up"}], max_tokens=tokens)
    return status == 200 and picks(rig.sidecar) > 0


def picks(sidecar: SidecarProcess, reason: str | None = None) -> float:
    total = 0.0
    for line in sidecar.metrics().splitlines():
        if line.startswith("confgen_picker_picks_total{") and (reason is None or f'reason="{reason}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _raw_chat(rig: Rig, messages: list[dict[str, str]]) -> tuple[int, str | None, Any]:
    """(status, retry-after, the JSON body) of one chat request."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "sim-model", "messages": messages, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{rig.port}/v1/chat/completions", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers.get("retry-after"), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("retry-after"), json.loads(err.read())


def chat(rig: Rig, messages: list[dict[str, str]], *, max_tokens: int | None = 4,
         headers: dict[str, str] | None = None, timeout: float = 30.0) -> tuple[int, str]:
    """(status, the worker that answered); `max_tokens` None: the body sets none."""
    import urllib.error
    import urllib.request

    fields: dict[str, Any] = {"model": "sim-model", "messages": messages}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    body = json.dumps(fields).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{rig.port}/v1/chat/completions", data=body, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("x-sim-worker", "-")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("x-sim-worker", "-")
    except OSError:
        return 0, "-"


def picker_fallbacks(rig: Rig) -> int:
    """Requests Envoy sent without the picker's answer (it timed out or failed: failure_mode_allow).
    On a loaded machine a pick can miss its 200 ms; those requests go by least_request."""
    stats = rig.envoy.stats()
    return sum(int(v) for k, v in stats.items()
               if k.endswith(("ext_proc.failure_mode_allowed", "ext_proc.message_timeouts")) and str(v).isdigit())


def conversation_system(i: int) -> str:
    return f"You are assistant number {i}. " + f"Conversation {i} has a long shared context. " * 8


def prefix_hits(rig: Rig) -> tuple[int, int]:
    lookups = hits = 0
    for w in rig.fleet.workers:
        pc = w.stats()["prefix_cache"]
        lookups += pc["lookups"]
        hits += pc["hits"]
    return hits, lookups


def test_growing_conversations_go_back_to_the_worker_holding_their_prefix(tmp_path: Path) -> None:
    with picker_rig(tmp_path, worker_specs(["a", "b", "c", "d"])) as rig:
        before_hits, before_lookups = prefix_hits(rig)
        conversations = 12
        turns = 5
        homes: dict[int, Counter[str]] = {i: Counter() for i in range(conversations)}
        failures = 0

        def talk(i: int) -> None:
            nonlocal failures
            messages = [{"role": "system", "content": conversation_system(i)}]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"turn {turn} of conversation {i}: tell me more"})
                status, worker = chat(rig, messages)
                if status != 200:
                    failures += 1
                homes[i][worker] += 1
                messages.append({"role": "assistant", "content": f"answer {turn}"})

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(talk, range(conversations)))
        hits, lookups = prefix_hits(rig)
        hits, lookups = hits - before_hits, lookups - before_lookups
        assert failures == 0
        # Each conversation's first turn misses; every later turn should hit.
        ratio = hits / lookups
        assert ratio >= 0.7, (ratio, homes)
        spread = Counter(w for c in homes.values() for w in c)
        assert len(spread) == 4, spread  # conversations spread over every worker, not piled on one
        sticky = sum(c.most_common(1)[0][1] for c in homes.values()) / (conversations * turns)
        assert sticky >= 0.8, homes


def test_client_sent_destination_header_is_ignored(tmp_path: Path) -> None:
    with picker_rig(tmp_path, worker_specs(["a", "b"])) as rig:
        messages = [{"role": "system", "content": conversation_system(100)}, {"role": "user", "content": "same"}]
        status, home = chat(rig, messages)
        assert status == 200
        other = "b" if home == "a" else "a"
        forged = f"127.0.0.1:{rig.fleet.worker(other).port}"
        fallbacks = picker_fallbacks(rig)
        seen: Counter[str] = Counter()
        for _ in range(10):
            status, worker = chat(rig, messages, headers={"x-gateway-destination-endpoint": forged})
            assert status == 200
            seen[worker] += 1
        # The client named the other worker every time; the picker kept the prompt at home
        # (but for requests Envoy routed itself because the picker's answer came too late).
        assert seen[home] >= 10 - (picker_fallbacks(rig) - fallbacks), seen
        headers = {k.lower(): v for k, v in rig.fleet.worker(home).stats()["last_inference_headers"].items()}
        named = headers.get("x-gateway-destination-endpoint")
        assert named is None or forged not in named  # the client's value never reaches a worker
        if picker_fallbacks(rig) == fallbacks:  # every answer in time: the last one named home
            assert named is not None and named.split(",")[0] == f"127.0.0.1:{rig.fleet.worker(home).port}"


def test_a_hot_prefix_spills_when_its_worker_queues(tmp_path: Path) -> None:
    with picker_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4), capacity=4) as rig:
        messages = [{"role": "system", "content": conversation_system(7)}, {"role": "user", "content": "hot"}]
        status, home = chat(rig, messages)
        assert status == 200
        got: Counter[str] = Counter()
        lock = threading.Lock()

        def one(_: int) -> None:
            status, worker = chat(rig, messages, max_tokens=48, timeout=60)
            with lock:
                got[worker if status == 200 else f"status {status}"] += 1

        with ThreadPoolExecutor(16) as pool:  # 16 at once, same prompt: far past the spill margin (2)
            list(pool.map(one, range(16)))
        assert sum(got.values()) == 16 and all(k in ("a", "b", "c") for k in got), got
        assert got[home] < 16 and len(got) >= 2, got  # spilled instead of piling on the holder
        assert picks(rig.sidecar, "spill") > 0


def _load_loop(rig: Rig, stop: threading.Event, results: list[int], limit: int = 4000) -> None:
    i = 0
    while not stop.is_set() and i < limit:  # bounded in count; the caller bounds it in time
        messages = [{"role": "system", "content": conversation_system(i % 6)}, {"role": "user", "content": "q"}]
        status, _ = chat(rig, messages, max_tokens=2, timeout=20)
        results.append(status)
        i += 1


def test_picker_down_costs_no_request_and_routing_resumes_when_it_returns(tmp_path: Path) -> None:
    with picker_rig(tmp_path, worker_specs(["a", "b"])) as rig:
        stop = threading.Event()
        results: list[int] = []
        workers = [threading.Thread(target=_load_loop, args=(rig, stop, results)) for _ in range(3)]
        for t in workers:
            t.start()
        try:
            assert poll(lambda: len(results) >= 30, timeout=30)
            rig.sidecar.stop()  # the picker goes with it (SIGTERM, as a restart does)
            down_at = len(results)
            assert poll(lambda: len(results) >= down_at + 60, timeout=60)  # served while it is down
            rig.sidecar.start()
            rig.sidecar.wait_ready()
            assert poll(lambda: picks(rig.sidecar) >= 20, timeout=30), rig.sidecar.log_tail()
        finally:
            stop.set()
            for t in workers:
                t.join(timeout=60)
        assert len(results) > 100 and set(results) == {200}, Counter(results)


def _ext_proc(rig: Rig, counter: str) -> int:
    """One of Envoy's ext_proc counters, summed over its listeners."""
    return sum(v for k, v in rig.envoy.stats().items() if k.endswith(f".ext_proc.{counter}") and isinstance(v, int))


def _until_predicted(rig: Rig, warm_tokens: int) -> None:
    """Warm-up requests of `warm_tokens` until the picker predicts (it learned the workers' token latency
    from their metrics and a predicted pick has finished), 30 s at most."""
    def predicted() -> bool:
        assert chat(rig, [{"role": "user", "content": "warm"}], max_tokens=warm_tokens)[0] == 200
        return any(line.startswith("confgen_picker_prediction_ratio_count") and not line.endswith(" 0.0")
                   for line in rig.sidecar.metrics().splitlines())
    assert poll(predicted, timeout=30), rig.sidecar.log_tail()


def _learned(rig: Rig, name: str) -> list[float]:
    """Each endpoint's `confgen_picker_learned_<name>` (absent where not measured yet)."""
    prefix = f"confgen_picker_learned_{name}{{"
    return [float(line.rsplit(" ", 1)[1]) for line in rig.sidecar.metrics().splitlines() if line.startswith(prefix)]


def _until_learned_output(rig: Rig, warm_tokens: int, at_least: float) -> None:
    """Answers of `warm_tokens`, two at a time (one a worker of a two-worker rig whose workers take one
    each, where admission lets the second in), until every worker whose answers the picker learned has
    answers of `at_least` tokens or more (one it learned none of takes the pool's), 60 s at most."""
    def learned() -> bool:
        with ThreadPoolExecutor(2) as pool:
            sent = [pool.submit(chat, rig, [{"role": "user", "content": f"warm {i}"}], max_tokens=warm_tokens)
                    for i in range(2)]
            [f.result() for f in sent]
        out = _learned(rig, "output_tokens")
        return bool(out) and min(out) >= at_least
    assert poll(learned, timeout=60), (_learned(rig, "output_tokens"), rig.sidecar.log_tail())


def test_the_picker_learns_how_many_answers_run_to_their_max_tokens_from_the_engines(tmp_path: Path) -> None:
    """The simulated vLLM engines report why requests finished as vLLM does (request_success_total by
    finished_reason): an answer asked with max_tokens runs to it ("length"), one without stops on its own
    ("stop"). The picker learns the share per worker from their metrics (how far a request's max_tokens
    predicts its answer): all of them while every request sets max_tokens, less once answers without it
    come in. Requests go two at a time, distinct, so that both workers serve some (one alone would go to
    whichever the picker measured faster, every time)."""
    sent = iter(range(10_000))

    def pair(max_tokens: int | None) -> None:
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(chat, rig, [{"role": "user", "content": f"answer {next(sent)}"}],
                                   max_tokens=max_tokens) for _ in range(2)]
            assert [f.result()[0] for f in answers] == [200, 200]

    with picker_rig(tmp_path, worker_specs(["a", "b"])) as rig:
        def bounded_only() -> bool:
            pair(4)
            shares = _learned(rig, "bounded_share")
            return len(shares) == 2 and min(shares) == 1.0
        assert poll(bounded_only, timeout=30), (_learned(rig, "bounded_share"), rig.sidecar.log_tail())

        def some_stopped() -> bool:
            pair(None)
            shares = _learned(rig, "bounded_share")
            return len(shares) == 2 and max(shares) < 0.9
        assert poll(some_stopped, timeout=60), (_learned(rig, "bounded_share"), rig.sidecar.log_tail())


def _sent_to_a_stalled_picker(rig: Rig, started: float) -> list[int]:
    """The fault: the sidecar's process stopped (SIGSTOP) while eight requests arrive, until every stream has
    sent its headers to it (Envoy's `streams_started` past `started` by 8) and 60 ms more have passed (so the
    last of them is 60 ms old, past the 20 ms late rule, however slowly the eight arrived); then resumed.
    Their statuses."""
    import signal
    import time

    assert rig.sidecar.proc is not None
    pid = rig.sidecar.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(chat, rig, [{"role": "user", "content": f"late {i}"}]) for i in range(8)]
            assert poll(lambda: _ext_proc(rig, "streams_started") - started >= 8, timeout=10)
            time.sleep(0.06)  # the stall itself (the fault): the last request 60 ms old when the picker runs
            os.kill(pid, signal.SIGCONT)
            return [f.result(timeout=30)[0] for f in futures]
    finally:
        os.kill(pid, signal.SIGCONT)


def test_requests_that_reach_a_stalled_picker_late_are_answered_on_their_headers_without_a_pick(
        tmp_path: Path) -> None:
    """The fault: the sidecar's process stopped (SIGSTOP) while requests arrive, as a CPU-starved or paused
    picker; their headers reach it late once it runs again. Each is answered on its headers alone, with
    the override that ends the stream (Envoy sends it no body: one message a stream, not two), so Envoy
    balances them at once instead of after its 200 ms message timeout; every request is served."""
    with picker_rig(tmp_path, worker_specs(["a", "b"])) as rig:
        for _ in range(5):  # on time: picked on the body (two messages a stream); the floor of ages is set
            assert chat(rig, [{"role": "user", "content": "on time"}])[0] == 200
        behind = unpicked(rig.sidecar, "behind")
        started, sent = _ext_proc(rig, "streams_started"), _ext_proc(rig, "stream_msgs_sent")
        timeouts = _ext_proc(rig, "message_timeouts")
        results = _sent_to_a_stalled_picker(rig, started)
        assert results == [200] * 8
        assert unpicked(rig.sidecar, "behind") - behind == 8, rig.sidecar.log_tail()
        assert _ext_proc(rig, "streams_started") - started == 8
        assert _ext_proc(rig, "stream_msgs_sent") - sent == 8  # the headers only: no body sent to the picker
        assert _ext_proc(rig, "message_timeouts") == timeouts  # none waited Envoy's timeout
        assert chat(rig, [{"role": "user", "content": "after"}])[0] == 200


def _refused(sidecar: SidecarProcess) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in sidecar.metrics().splitlines()
               if line.startswith("confgen_picker_refused_total{"))


def test_under_admission_a_request_that_reaches_the_picker_late_is_refused_on_its_headers(tmp_path: Path) -> None:
    """Admission always on (`admission_gate=0`) with a budget of 5 % of a service time (`budget_standard=0.05`:
    ~150 ms, past the predicted delay a worker a little slower than the other adds, short of a slot's
    wait): once both one-slot workers decode a long answer, a request's predicted start is past its budget
    (429). Then the picker's process is stopped (SIGSTOP) while eight requests arrive; their headers reach
    it late. Each is refused on its headers (the picker's immediate response, one message a stream), not passed to
    Envoy's balancer unadmitted, and none waits Envoy's message timeout; the long answers complete."""
    import time

    # the rig's first answers 150 tokens too, so no worker starts from a short mean
    with picker_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=1), capacity=1,
                    extra_args=["--picker", "admission_gate=0", "--picker", "budget_standard=0.05",
                                "--picker", "budget_step=0", "--picker", "hold=0"], ready_tokens=150) as rig:
        # answers of 150 tokens (3 s): the picker then expects a request in flight to hold its slot for
        # seconds, so the wait it predicts below outlasts the stall (it drains one second per second)
        _until_predicted(rig, warm_tokens=150)
        # ... on both workers: the wait it predicts is the shorter of the two (one that learned only the
        # rig's 4-token answers predicts 80 ms, which a stall on a loaded machine outlasts), so two at a time
        # until each that learned any has learned answers of 50 tokens or more (a wait of a second or more;
        # one that learned none takes the pool's)
        _until_learned_output(rig, warm_tokens=150, at_least=50.0)
        with ThreadPoolExecutor(2) as long_pool:
            # two answers of 500 tokens (10 s at 20 ms a step): both slots taken for the rest of the test.
            # One may be refused at once while the engines' last report still shows the warm-up running
            # (the budget allows no slot's wait): sent again until two are placed.
            long: list[Any] = []
            for attempt in range(40):
                placed = picks(rig.sidecar)
                sent_long = long_pool.submit(chat, rig, [{"role": "user", "content": f"long {attempt}"}],
                                             max_tokens=500, timeout=60)
                assert poll(lambda placed=placed, f=sent_long: picks(rig.sidecar) > placed or f.done(), timeout=10)
                if not sent_long.done():
                    long.append(sent_long)
                if len(long) == 2:
                    break
                time.sleep(0.1)
            assert len(long) == 2, rig.sidecar.log_tail()
            refused, behind = _refused(rig.sidecar), unpicked(rig.sidecar, "behind")
            timeouts = _ext_proc(rig, "message_timeouts")
            # picked and refused: the wait it predicts stands for the requests the picker will answer late
            # (drained one second per second since), so the stall follows at once
            # what the client sees (found by review: Envoy's local reply took the picker's 429 for a rate
            # limit's: body rate_limit_error, the topology's fixed retry-after): load shedding, the picker's wait
            status, retry, answer = _raw_chat(rig, [{"role": "user", "content": "on time"}])
            assert status == 429, (status, answer)
            assert (answer["error"]["type"], answer["error"]["code"]) == ("server_overloaded", "overloaded"), answer
            assert retry is not None and 1 <= int(retry) <= 60, retry
            # and the gauge says admission is on (admission_gate=0: always; it read 0, the pressure's alone)
            assert 'confgen_picker_admitting{pool="chat"} 1.0' in rig.sidecar.metrics()
            started, sent = _ext_proc(rig, "streams_started"), _ext_proc(rig, "stream_msgs_sent")
            results = _sent_to_a_stalled_picker(rig, started)
            assert results == [429] * 8, (results, unpicked(rig.sidecar, "behind") - behind,
                                          [line for line in rig.sidecar.metrics().splitlines()
                                           if line.startswith(("confgen_picker_pressure", "confgen_picker_refused"))])
            assert unpicked(rig.sidecar, "behind") - behind == 8
            assert _refused(rig.sidecar) - refused == 9  # the one on time and the eight late
            assert _ext_proc(rig, "stream_msgs_sent") - sent == 8  # the headers only
            assert _ext_proc(rig, "message_timeouts") == timeouts
            assert [f.result(timeout=60)[0] for f in long] == [200, 200]


def _runtime(rig: Rig) -> dict[str, str]:
    status, body = rig.envoy.admin_get("/runtime")
    assert status == 200, body
    return {k: str(v.get("final_value", "")) for k, v in json.loads(body)["entries"].items()}


def _set_runtime(rig: Rig, values: dict[str, str]) -> None:
    import urllib.parse

    status, body = rig.envoy.admin_post(f"/runtime_modify?{urllib.parse.urlencode(values)}")
    assert status == 200, body


def test_envoy_sends_the_bypass_share_of_requests_past_the_picker(tmp_path: Path) -> None:
    """The Envoy-side switch the picker sheds its work with when it cannot keep up (bypass.py): Envoy skips
    the ext_proc filter for the runtime share `confgen.picker.bypass` of requests, which least_request
    balances (served, no stream opened, nothing picked); the sidecar wrote 0 at its start."""
    key = envoy.PICKER_BYPASS_RUNTIME_KEY
    with picker_rig(tmp_path, worker_specs(["a", "b"])) as rig:
        assert poll(lambda: _runtime(rig).get(key) == "0", timeout=10), rig.sidecar.log_tail()
        assert 'confgen_picker_bypass_percent 0.0' in rig.sidecar.metrics()
        shares = {"100": (20, 0, 0), "50": (60, 10, 50), "0": (10, 10, 10)}  # requests, least and most streams
        for percent, (n, least, most) in shares.items():
            _set_runtime(rig, {key: percent})
            assert _runtime(rig)[key] == percent
            started, picked = _ext_proc(rig, "streams_started"), picks(rig.sidecar)
            late = unpicked(rig.sidecar, "behind")
            statuses = [chat(rig, [{"role": "user", "content": f"bypass {percent} {i}"}])[0] for i in range(n)]
            assert statuses == [200] * n, (percent, statuses)
            streams = _ext_proc(rig, "streams_started") - started
            assert least <= streams <= most, (percent, streams)
            # the requests that reached the picker were picked (no late rule here): the rest never reached it
            late = unpicked(rig.sidecar, "behind") - late
            assert picks(rig.sidecar) - picked + late >= streams, (percent, streams, late)
        # A client does not choose which side of the share it falls on: the draw is on the request id Envoy
        # sets itself (use_remote_address; a client's x-request-id is not kept), so one client-sent id
        # repeated still splits about as the share says.
        _set_runtime(rig, {key: "50"})
        started = _ext_proc(rig, "streams_started")
        for i in range(60):
            assert chat(rig, [{"role": "user", "content": f"same id {i}"}],
                        headers={"x-request-id": "4f1c1d2e-0000-4000-8000-000000000001"})[0] == 200
        assert 10 <= _ext_proc(rig, "streams_started") - started <= 50


def unpicked(sidecar: SidecarProcess, reason: str) -> float:
    prefix = f'confgen_picker_unpicked_total{{reason="{reason}"}} '
    return sum(float(line[len(prefix):]) for line in sidecar.metrics().splitlines() if line.startswith(prefix))


def _plain_envoy_bootstrap(listen: int, admin: int, picker: str) -> dict[str, Any]:
    """Envoy as the inference extension's standalone chart configures it for an EPP:
    ext_proc in FULL_DUPLEX_STREAMED mode, an ORIGINAL_DST cluster routed by the header."""
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc", "authority": "localhost"}, "timeout": "10s"},
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                "request_body_mode": "FULL_DUPLEX_STREAMED",
                                "response_body_mode": "FULL_DUPLEX_STREAMED",
                                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
            "message_timeout": "1000s",
        },
    }
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "plain",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "original_destination_cluster", "timeout": "60s"}}]}]},
        "http_filters": [ext_proc, router],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{"name": "plain", "address": {"socket_address": {"address": "127.0.0.1",
                                                                            "port_value": listen}},
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": [
                {"name": "original_destination_cluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "1s",
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": "x-gateway-destination-endpoint"}},
                {"name": "ext_proc", "type": "STATIC", "connect_timeout": "1s",
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "ext_proc", "endpoints": [{"lb_endpoints": [{"endpoint": {
                     "address": {"pipe": {"path": picker}}}}]}]}},
            ],
        },
    }


def test_a_plain_envoy_configured_as_the_extension_documents_routes_through_the_picker(tmp_path: Path) -> None:
    with picker_rig(tmp_path, worker_specs(["a", "b", "c"])) as rig:
        listen = free_port()
        boot = _plain_envoy_bootstrap(listen, free_port(), rig.extra["socket"])  # the picker's Unix socket
        with EnvoyProcess(boot):
            plain = Rig(rig.fleet, rig.envoy, rig.sidecar, rig.topology_path, rig.xds_dir, listen, rig.admin)
            before, behind = picks(rig.sidecar), unpicked(rig.sidecar, "behind")
            homes: dict[int, Counter[str]] = {}
            for i in range(6):
                messages = [{"role": "system", "content": conversation_system(200 + i)}]
                homes[i] = Counter()
                for turn in range(3):
                    messages.append({"role": "user", "content": f"turn {turn}"})
                    status, worker = chat(plain, messages)
                    assert status == 200, (status, rig.sidecar.log_tail())
                    homes[i][worker] += 1
                    messages.append({"role": "assistant", "content": "ok"})
            # every request picked, but one the picker's loop took up late (a loaded machine: Envoy balances it)
            late = unpicked(rig.sidecar, "behind") - behind
            assert picks(rig.sidecar) - before + late == 18 and late <= 2, (late, rig.sidecar.log_tail())
            moved = sum(3 - c.most_common(1)[0][1] for c in homes.values())
            assert moved <= late, homes  # each conversation stayed home
            # Without a pick ORIGINAL_DST has nowhere to go: a forged header is removed, not obeyed.
            status, worker = chat(plain, [{"role": "user", "content": "x"}],
                                  headers={"x-gateway-destination-endpoint": "127.0.0.1:1"})
            assert status == 200 and worker in ("a", "b", "c")


def test_a_bad_picker_override_stops_the_sidecar_at_startup(tmp_path: Path) -> None:
    import subprocess
    import sys

    topo = tmp_path / "t.yaml"
    topo.write_text(fleet_topology(name="bad", admin=free_port(), port=free_port(), workers=["127.0.0.1:9"],
                                   models=["m"], capacity=4, pool=["balancing: {policy: prefix_affinity}"],
                                   tail=[f"sidecar: {{grpc_port: {free_port()}, grpc_socket_dir: {tmp_path / 's'}}}"]))
    proc = subprocess.run([sys.executable, "-m", "sidecar.main", "--topology", str(topo), "--xds-dir",
                           str(tmp_path / "x"), "--listen", f"127.0.0.1:{free_port()}", "--picker", "prefix=lots"],
                          capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert b"--picker prefix" in proc.stderr


def _held(sidecar: SidecarProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in sidecar.metrics().splitlines():
        if line.startswith("confgen_picker_held_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_with_hold_requests_wait_in_the_picker_for_a_slot_and_envoy_waits_for_them(tmp_path: Path) -> None:
    """`--picker hold=1`: two workers of two slots each, eight requests at once. Those that find every
    slot taken wait in the picker's lobby (Envoy's message timeout extended by the picker's
    override_message_timeout, within the rendered max_message_timeout) and are placed as slots free:
    every one answered 200, held ones counted with outcome slot, none reset while it waited (which a
    message timeout in Envoy would do)."""
    with picker_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=2), capacity=2,
                    extra_args=["--picker", "hold=1"]) as rig:
        _until_predicted(rig, warm_tokens=8)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: chat(rig, [{"role": "user", "content": f"q {i}"}], max_tokens=24,
                                               timeout=60), range(8)))
        assert [status for status, _ in got] == [200] * 8, got
        held = _held(rig.sidecar)
        assert held.get("slot", 0.0) >= 1 and not held.get("reset"), (held, rig.sidecar.log_tail())
