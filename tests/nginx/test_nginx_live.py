"""The rendered nginx config doing its job: the real nginx in front of the simulated fleet
(or tiny recording backends) on loopback. Loops are bounded in count and time."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

from confgen.runtime import free_port
from confgen.simulate import FleetSpec, WorkerSpec, run_fleet_in_thread
from tests.support.backends import TinyBackend
from tests.support.envoy import request

from ._support import running_nginx

CHAT = "/v1/chat/completions"


def _topology(pool_yaml: str, extra: str = "") -> str:
    return f"""
version: 1
name: live
listeners: [{{name: public, port: 8080}}]
pools:
{pool_yaml}
{extra}
"""


def _pool(name: str, workers: list[str], models: str = "[m]", more: str = "") -> str:
    lines = "\n".join(f"      - {w}" for w in workers)
    return f"""  - name: {name}
    engine: vllm
    models: {models}
    workers:
{lines}
{more}"""


def _chat(model: str = "m", max_tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}


def test_least_load_sends_a_slow_worker_less(tmp_path: Path) -> None:
    """random two least_conn gives a 4x slower worker clearly less than round robin's half."""
    spec = FleetSpec((WorkerSpec(models=("m",), decode_ms=4, name="fast"),
                      WorkerSpec(models=("m",), decode_ms=4, speed=0.25, name="slow")))
    with run_fleet_in_thread(spec) as fleet:
        workers = [f"127.0.0.1:{w.port}" for w in fleet.workers]
        yaml = _topology(_pool("p", workers, more="    balancing: {policy: least_request, choice_count: 2}"))
        with running_nginx(yaml, tmp_path) as ngx:
            def one(_: int) -> str:
                status, headers, _body = request(ngx.url + CHAT, _chat(max_tokens=16))
                assert status == 200
                return headers["x-sim-worker"]

            with ThreadPoolExecutor(6) as pool:
                counts = Counter(pool.map(one, range(48)))
    assert sum(counts.values()) == 48
    assert counts["slow"] < 0.4 * 48, counts


def test_consistent_hash_keeps_a_session_on_one_worker(tmp_path: Path) -> None:
    """hash $http_x_session_id consistent: each session's requests all land on one worker."""
    spec = FleetSpec.uniform(3, models=("m",), decode_ms=1)
    with run_fleet_in_thread(spec) as fleet:
        workers = [f"127.0.0.1:{w.port}" for w in fleet.workers]
        more = "    balancing: {policy: ring_hash, hash_on: {header: x-session-id}}"
        with running_nginx(_topology(_pool("p", workers, more=more)), tmp_path) as ngx:
            seen: dict[str, set[str]] = {}
            for session in range(8):
                for _ in range(4):
                    status, headers, _ = request(ngx.url + CHAT, _chat(), {"x-session-id": f"s{session}"})
                    assert status == 200
                    seen.setdefault(f"s{session}", set()).add(headers["x-sim-worker"])
    assert all(len(w) == 1 for w in seen.values()), seen
    assert len(set().union(*seen.values())) >= 2  # the sessions are spread, not all on one worker


def test_session_cookie_is_issued_and_sticks(tmp_path: Path) -> None:
    """Hashing on a cookie: a client without one gets it, and with it stays on the first worker."""
    spec = FleetSpec.uniform(3, models=("m",), decode_ms=1)
    with run_fleet_in_thread(spec) as fleet:
        workers = [f"127.0.0.1:{w.port}" for w in fleet.workers]
        more = "    balancing: {policy: ring_hash, hash_on: {cookie: confgen-session}}"
        with running_nginx(_topology(_pool("p", workers, more=more)), tmp_path) as ngx:
            for _client in range(4):
                status, headers, _ = request(ngx.url + CHAT, _chat())
                assert status == 200
                cookie = headers["set-cookie"].split(";")[0]
                assert cookie.startswith("confgen-session=")
                first = headers["x-sim-worker"]
                for _ in range(3):
                    status, again, _ = request(ngx.url + CHAT, _chat(), {"cookie": f"a=b; {cookie}"})
                    assert status == 200 and again["x-sim-worker"] == first
                    assert "set-cookie" not in again


def test_rate_limit_answers_429_json_with_retry_after(tmp_path: Path) -> None:
    """Past the global bucket nginx answers 429 with the OpenAI-style JSON and retry-after."""
    with TinyBackend("a") as backend:
        extra = "limits: {global: {requests: 2, per: 1m}}\nbackpressure: {retry_after: 3s}"
        yaml = _topology(_pool("p", [f"127.0.0.1:{backend.port}"]), extra)
        with running_nginx(yaml, tmp_path) as ngx:
            answers = [request(ngx.url + CHAT, _chat()) for _ in range(4)]
    assert [a[0] for a in answers] == [200, 200, 429, 429]
    _, headers, body = answers[2]
    assert headers["retry-after"] == "3"
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"


def _busy_fleet_statuses(tmp_path: Path, backpressure: str) -> Counter[int]:
    """18 clients, 90 requests, on 3 simulated workers of 4 slots each (12 busy, 6 waiting)."""
    spec = FleetSpec(tuple(WorkerSpec(models=("m",), max_num_seqs=4, decode_ms=10, name=n) for n in "abc"))
    with run_fleet_in_thread(spec) as fleet:
        workers = [f"127.0.0.1:{w.port}" for w in fleet.workers]
        yaml = _topology(_pool("p", workers, more="    capacity: 4"), backpressure)
        with running_nginx(yaml, tmp_path) as ngx:
            def one(_: int) -> int:
                return request(ngx.url + CHAT, _chat(max_tokens=20), timeout=30)[0]

            with ThreadPoolExecutor(18) as pool:
                return Counter(pool.map(one, range(90)))


def test_limit_conn_is_a_safety_cap_not_the_shedding_rule(tmp_path: Path) -> None:
    """limit_conn is backpressure.safety_cap x the declared slots (4 x 12 = 48), so a fleet
    with every slot busy and requests waiting in the engines gets no 429 (the old 80 % rule,
    9 here, answered 429 at normal load); with safety_cap 1.0 (12) the same load is shed
    with 429, so the cap is still there."""
    normal = _busy_fleet_statuses(tmp_path / "normal", "")
    capped = _busy_fleet_statuses(tmp_path / "capped", "backpressure: {safety_cap: 1.0}")
    print(f"18 concurrent on 12 slots: default cap {dict(normal)}, cap 1.0 {dict(capped)}")
    assert normal == Counter({200: 90}), normal
    assert capped[429] > 0 and set(capped) == {200, 429}, capped


def test_post_is_retried_when_a_worker_is_dead(tmp_path: Path) -> None:
    """A crashed worker (connection refused) costs no failed POST: nginx retries on the other."""
    spec = FleetSpec.uniform(2, models=("m",), decode_ms=1)
    with run_fleet_in_thread(spec) as fleet:
        workers = [f"127.0.0.1:{w.port}" for w in fleet.workers]
        yaml = _topology(_pool("p", workers, more="    balancing: {policy: round_robin}\n    retries: {attempts: 1}"))
        with running_nginx(yaml, tmp_path) as ngx:
            fleet.workers[0].crash()
            statuses = Counter()
            served = Counter()
            for _ in range(20):
                status, headers, _ = request(ngx.url + CHAT, _chat())
                statuses[status] += 1
                served[headers.get("x-sim-worker")] += 1
    assert statuses == {200: 20}
    assert served == {fleet.workers[1].name: 20}


@contextmanager
def _resetting_worker() -> Iterator[tuple[int, list[int]]]:
    """A worker that reads the request and then resets the connection without answering
    (a fault the simulator cannot produce: the request was already sent when it fails)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()
    hits: list[int] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                with suppress(OSError):
                    conn.recv(65536)
                hits.append(1)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], hits
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_post_is_retried_after_a_reset_once_sent(tmp_path: Path) -> None:
    """A worker that drops the connection after the POST was sent: with non_idempotent nginx
    retries on the other worker, so no request fails."""
    spec = FleetSpec.uniform(1, models=("m",), decode_ms=1)
    with run_fleet_in_thread(spec) as fleet, _resetting_worker() as (bad_port, hits):
        workers = [f"127.0.0.1:{bad_port}", f"127.0.0.1:{fleet.workers[0].port}"]
        more = ("    balancing: {policy: round_robin}\n    retries: {attempts: 1}\n"
                "    outlier_detection: {enabled: false}")
        with running_nginx(_topology(_pool("p", workers, more=more)), tmp_path) as ngx:
            statuses = Counter(request(ngx.url + CHAT, _chat())[0] for _ in range(10))
    assert hits, "the resetting worker was never tried"
    assert statuses == {200: 10}


def test_sse_stream_arrives_unbuffered(tmp_path: Path) -> None:
    """An SSE answer reaches the client chunk by chunk while it is generated, not at the end."""
    spec = FleetSpec((WorkerSpec(models=("m",), decode_ms=40),))
    with run_fleet_in_thread(spec) as fleet:
        yaml = _topology(_pool("p", [f"127.0.0.1:{fleet.workers[0].port}"]))
        with running_nginx(yaml, tmp_path) as ngx:
            conn = http.client.HTTPConnection("127.0.0.1", int(ngx.url.rsplit(":", 1)[1]), timeout=10)
            conn.request("POST", CHAT, json.dumps(_chat(max_tokens=12, stream=True)),
                         {"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            arrivals: list[float] = []
            lines: list[bytes] = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                line = resp.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    arrivals.append(time.monotonic())
                    lines.append(line.strip())
            conn.close()
    assert lines[-1] == b"data: [DONE]"
    assert len(arrivals) >= 12
    # 12 tokens at 40 ms each: buffered, every chunk would arrive at once at the end.
    assert arrivals[-1] - arrivals[0] > 0.2, arrivals


KEYED = """
auth:
  api_keys:
    - {client: web, env: K_WEB}
    - {client: intern, env: K_INTERN}
routes:
  - name: gold
    pool: gold
    match: {models: [g]}
    allow_clients: [web]
"""


def test_api_keys_match_with_their_case_and_any_length(tmp_path: Path) -> None:
    """Found by review: nginx folds a map's string keys to lower case, so a key matched in any case, and two
    keys differing only in case stopped nginx starting (printing a key in its error); a 40-character key (an
    `openssl rand -hex 20`) overflowed map_hash_bucket_size. Each key now matches itself only, as Envoy's
    check does; the scheme in any case, as HTTP's."""
    upper, lower = "AbcdefghijKLMNOP12345", "abcdefghijklmnop12345"
    forty = "0123456789abcdef0123456789abcdef01234567"
    with TinyBackend("plain") as plain:
        secrets = {"web": upper, "intern": lower, "ops": forty}
        keyed = "\nauth:\n  api_keys:\n    - {client: web, env: K_WEB}\n    - {client: intern, env: K_INTERN}\n" \
                "    - {client: ops, env: K_OPS}\n"
        with running_nginx(_topology(_pool("p", [f"127.0.0.1:{plain.port}"]), keyed), tmp_path,
                           secrets=secrets) as ngx:
            seen = []
            for key in (upper, lower, forty, upper.upper(), lower.upper()):
                status, _, _ = request(ngx.url + CHAT, _chat(), {"authorization": f"Bearer {key}"})
                client = {k.lower(): v for k, v in plain.requests[-1]["headers"].items()}.get("x-confgen-client")
                seen.append((status, client if status == 200 else None))
            scheme = request(ngx.url + CHAT, _chat(), {"authorization": f"bearer {upper}"})[0]
    assert seen == [(200, "web"), (200, "intern"), (200, "ops"), (401, None), (401, None)], seen
    assert scheme == 200


def test_api_keys_401_403_and_forwarded_client(tmp_path: Path) -> None:
    """401 JSON without or with a wrong key; 403 off a route's allow list; the worker gets the
    client id (a forged copy overwritten) and never the key."""
    with TinyBackend("plain") as plain, TinyBackend("gold") as gold:
        pools = _pool("p", [f"127.0.0.1:{plain.port}"]) + "\n" + _pool("gold", [f"127.0.0.1:{gold.port}"], "[g]")
        secrets = {"web": "sk-web-1", "intern": "sk-intern-1"}
        with running_nginx(_topology(pools, KEYED), tmp_path, secrets=secrets) as ngx:
            none = request(ngx.url + CHAT, _chat())
            wrong = request(ngx.url + CHAT, _chat(), {"authorization": "Bearer sk-nope"})
            ok = request(ngx.url + CHAT, _chat(), {"authorization": "Bearer sk-intern-1",
                                                   "x-confgen-client": "web"})
            denied = request(ngx.url + CHAT, _chat("g"), {"authorization": "Bearer sk-intern-1"})
            allowed = request(ngx.url + CHAT, _chat("g"), {"authorization": "Bearer sk-web-1"})
    for status, headers, body in (none, wrong):
        assert status == 401 and headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert ok[0] == 200
    seen = {k.lower(): v for k, v in plain.requests[-1]["headers"].items()}
    assert seen["x-confgen-client"] == "intern"
    assert "authorization" not in seen
    assert denied[0] == 403 and json.loads(denied[2])["error"]["code"] == "permission_denied"
    assert allowed[0] == 200 and json.loads(allowed[2])["worker"] == "gold"


def test_body_model_and_header_routing_and_404(tmp_path: Path) -> None:
    """The body's `model` picks the pool; a header route wins first; an unknown model is 404 JSON."""
    with TinyBackend("big") as big, TinyBackend("small") as small:
        pools = (_pool("big", [f"127.0.0.1:{big.port}"], "[chat]") + "\n"
                 + _pool("small", [f"127.0.0.1:{small.port}"], "[tiny]"))
        routes = "routes:\n  - {name: tier, pool: small, match: {headers: [{name: x-tier, exact: small}]}}"
        with running_nginx(_topology(pools, routes), tmp_path) as ngx:
            by_model = request(ngx.url + CHAT, _chat("chat"))
            by_small = request(ngx.url + CHAT, _chat("tiny"))
            by_header = request(ngx.url + CHAT, _chat("chat"), {"x-tier": "small"})
            unknown = request(ngx.url + CHAT, _chat("nope"))
            models = request(ngx.url + "/v1/models")
            status = request(ngx.status_url + "/status")
    assert json.loads(by_model[2])["worker"] == "big"
    assert json.loads(by_small[2])["worker"] == "small"
    assert json.loads(by_header[2])["worker"] == "small"
    assert unknown[0] == 404
    assert json.loads(unknown[2])["error"] == {
        "message": "The model 'nope' does not exist or is not served here.",
        "type": "invalid_request_error", "code": "model_not_found"}
    assert big.requests[0]["body"] == json.dumps(_chat("chat")).encode()  # the body reached the worker whole
    assert sorted(m["id"] for m in json.loads(models[2])["data"]) == ["chat", "tiny"]
    assert status[0] == 200 and json.loads(status[2])["topology"] == "live"


def test_fallback_pool_then_canned_answer(tmp_path: Path) -> None:
    """A pool whose workers are all dead hands the request to its fallback pool; when that is
    dead too, the canned last answer is served."""
    dead = f"127.0.0.1:{free_port()}"
    with TinyBackend("small") as small:
        pools = (_pool("big", [dead], "[chat]", "    fallback: small\n    retries: {attempts: 0}") + "\n"
                 + _pool("small", [f"127.0.0.1:{small.port}"], "[chat]"))
        with running_nginx(_topology(pools), tmp_path) as ngx:
            fell_back = request(ngx.url + CHAT, _chat("chat"))
        assert fell_back[0] == 200 and json.loads(fell_back[2])["worker"] == "small"
    canned = "last_resort: {kind: completion, status: 200, message: All busy. Try again later.}"
    pools = (_pool("big", [dead], "[chat]", "    fallback: small") + "\n"
             + _pool("small", [f"127.0.0.1:{free_port()}"], "[chat]"))
    with running_nginx(_topology(pools, canned), tmp_path / "second") as ngx:
        status, headers, body = request(ngx.url + CHAT, _chat("chat"))
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(body)["choices"][0]["message"]["content"] == "All busy. Try again later."


def test_a_body_over_the_listener_limit_gets_the_same_413_as_envoy(tmp_path: Path) -> None:
    """client_max_body_size is the listener's max_request_bytes (default 2 MiB): a 3 MB prompt
    gets 413 with the OpenAI-style `request_too_large` body Envoy sends, and never reaches the
    worker; a 1.5 MB one is served."""
    with TinyBackend("a") as backend, running_nginx(_topology(_pool("p", [f"127.0.0.1:{backend.port}"])),
                                                    tmp_path) as ngx:
        status, headers, body = request(ngx.url + CHAT, _chat(prompt="x" * 3_000_000))
        assert status == 413, body[:200]
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert headers["content-type"] == "application/json"
        assert backend.requests == []
        assert request(ngx.url + CHAT, _chat(prompt="x" * 1_500_000))[0] == 200
        assert len(backend.requests) == 1
