"""The sidecar's rate limit service against a real redis-server: exact counting per fixed
window, token budgets checked with cost 0 and charged at stream end, a refused request
costing nothing, fail-open (and fail_closed) while Redis is dead, counting again when it
returns, and the gRPC round trip Envoy makes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import wrappers_pb2
from prometheus_client.registry import CollectorRegistry

from confgen.runtime import RedisProcess
from confgen.topology import parse
from sidecar.outputs.grpc import GrpcServer, GrpcSettings
from sidecar.outputs.ratelimit import RateLimitService

OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT


def _topology(redis: str) -> Any:
    text = f"""\
version: 1
name: rl
listeners: [{{name: public, port: 8080}}]
pools:
  - {{name: p, engine: vllm, models: [m1, m2], workers: ["127.0.0.1:8000"]}}
auth:
  api_keys:
    - {{client: alice, env: A}}
    - client: bob
      env: B
      rate_limit: {{scope: global, unit: total_tokens, tokens: 100, window: minute, per_model: true}}
    - client: carol
      env: C
      rate_limit: {{scope: global, requests: 2, window: minute, fail_closed: true}}
limits:
  store: {{redis: "{redis}", timeout: 200ms, check_timeout: 400ms}}
  per_key:
    - {{scope: global, requests: 5, window: minute}}
    - {{scope: global, unit: output_tokens, tokens: 50, window: hour}}
"""
    topo, _ = parse(text.encode(), "rl.yaml")
    return topo


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisProcess]:
    with RedisProcess() as proc:
        yield proc


class Clock:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = 1_700_000_080.0  # 40 s into a minute (1_700_000_040 is a minute)

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall


def _descriptor(limit: str, client: str | None = None, model: str | None = None,
                hits: int | None = None, **extra: str) -> Any:
    entries = [ratelimit_pb2.RateLimitDescriptor.Entry(key="confgen_limit", value=limit)]
    if client is not None:
        entries.append(ratelimit_pb2.RateLimitDescriptor.Entry(key="client", value=client))
    if model is not None:
        entries.append(ratelimit_pb2.RateLimitDescriptor.Entry(key="model", value=model))
    entries += [ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in extra.items()]
    d = ratelimit_pb2.RateLimitDescriptor(entries=entries)
    if hits is not None:
        d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits))
    return d


def _request(*descriptors: Any, domain: str = "confgen.rl") -> Any:
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=list(descriptors))


def _service(redis: RedisProcess, clock: Clock, registry: CollectorRegistry) -> RateLimitService:
    topo = _topology(redis.address)
    # the journal's replays are triggered by the tests (flush), never by the loop's timer
    return RateLimitService(lambda: topo, registry, clock.monotonic, wall=clock.time, backoff_s=0.25,
                            flush_interval_s=3600)


def _flush(redis: RedisProcess) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", redis.port), timeout=2) as sock:
        sock.sendall(b"FLUSHALL\r\n")
        assert sock.recv(16).startswith(b"+OK")


def test_requests_are_counted_exactly_per_window_and_a_refusal_costs_nothing(redis: RedisProcess) -> None:
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> list[Any]:
        service = _service(redis, clock, registry)
        await service.start()
        try:
            answers = []
            for _ in range(7):  # per_key/0: 5 requests a minute, with the token check beside it
                answers.append(await service.ShouldRateLimit(
                    _request(_descriptor("per_key/0", "alice"), _descriptor("per_key/1", "alice", hits=0)), None))
            clock.wall += 20  # the next minute: a new window
            answers.append(await service.ShouldRateLimit(_request(_descriptor("per_key/0", "alice")), None))
            return answers
        finally:
            await service.close()

    answers = asyncio.run(run())
    assert [a.overall_code for a in answers[:7]] == [OK] * 5 + [OVER] * 2
    first, fifth, refused = answers[0].statuses[0], answers[4].statuses[0], answers[5].statuses[0]
    assert first.current_limit.requests_per_unit == 5
    assert first.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.MINUTE
    assert (first.limit_remaining, fifth.limit_remaining) == (4, 0)
    assert first.duration_until_reset.seconds == 20
    assert refused.code == OVER and answers[5].statuses[1].code == OK  # only the budget that is spent
    assert answers[7].overall_code == OK and answers[7].statuses[0].limit_remaining == 4
    assert registry.get_sample_value("confgen_sidecar_ratelimit_decisions_total",
                                     {"code": "over_limit", "store": "counted"}) == 2


def test_token_budgets_check_with_cost_0_and_charge_at_stream_end(redis: RedisProcess) -> None:
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> list[int]:
        service = _service(redis, clock, registry)
        await service.start()
        codes = []
        try:
            check = _request(_descriptor("client/bob/0", "bob", "m1", hits=0))
            codes.append((await service.ShouldRateLimit(check, None)).overall_code)
            # charged at stream end: 60 then 45 tokens, both counted (spent; Envoy ignores this answer)
            for spent in (60, 45):
                charge = _request(_descriptor("client/bob/0", "bob", "m1", hits=spent))
                codes.append((await service.ShouldRateLimit(charge, None)).overall_code)
            codes.append((await service.ShouldRateLimit(check, None)).overall_code)  # 105 >= 100: refused
            other_model = _request(_descriptor("client/bob/0", "bob", "m2", hits=0))
            codes.append((await service.ShouldRateLimit(other_model, None)).overall_code)  # per_model
            unknown_model = _request(_descriptor("client/bob/0", "bob", "not-served", hits=0))
            codes.append((await service.ShouldRateLimit(unknown_model, None)).overall_code)  # counted as '*'
        finally:
            await service.close()
        return codes

    assert asyncio.run(run()) == [OK, OK, OK, OVER, OK, OK]


def test_a_charge_past_envoys_bound_is_counted_at_the_bound_and_the_store_stays_up(redis: RedisProcess) -> None:
    """Found by review: a direct caller's stream-end charge of 1e17 tokens (a hits_addend Envoy never sends:
    it stops at 1e9) overflowed Redis's INCRBY; the service took the script error for a store outage, ran
    on its local floor and journalled the charge, whose every replay failed alike. Now it counts 1e9."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> list[Any]:
        service = _service(redis, clock, registry)
        await service.start()
        try:
            out = []
            for _ in range(3):
                out.append(await service.ShouldRateLimit(_request(_descriptor("client/bob/0", "bob", "m1",
                                                                              hits=10**17)), None))
            out.append(await service.ShouldRateLimit(_request(_descriptor("client/bob/0", "bob", "m1", hits=0)),
                                                     None))
            return out
        finally:
            await service.close()

    answers = asyncio.run(run())
    assert answers[-1].overall_code == OVER  # counted: bob's 100 tokens are spent
    assert registry.get_sample_value("confgen_sidecar_ratelimit_decisions_total",
                                     {"code": "over_limit", "store": "counted"}) == 1
    assert not registry.get_sample_value("confgen_sidecar_ratelimit_store_failures_total")


def test_reservations_hold_a_token_budget_to_one_request_over(redis: RedisProcess) -> None:
    """Requests in flight reserve their estimate (max output + body bytes / 4 for a total budget):
    a request is admitted only while spent + reserved < budget; its charge releases it."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    def check(rid: str, max_output: str = "30", body: str = "40") -> Any:
        return _request(_descriptor("client/bob/0", "bob", "m1", hits=0, request_id=rid, max_output=max_output,
                                    body_bytes=body))

    def charge(rid: str, tokens: int) -> Any:
        return _request(_descriptor("client/bob/0", "bob", "m1", hits=tokens, request_id=rid))

    async def run() -> list[Any]:
        service = _service(redis, clock, registry)
        await service.start()
        try:
            out = []
            # budget 100; each estimate 30 + 40/4 = 40: two in flight reserve 80, a third still fits (80 < 100)
            for rid in ("a", "b", "c"):
                out.append(await service.ShouldRateLimit(check(rid), None))
            out.append(await service.ShouldRateLimit(check("d"), None))  # 120 reserved: refused
            out.append(await service.ShouldRateLimit(charge("a", 12), None))  # a spent 12: 12 + 80 reserved
            out.append(await service.ShouldRateLimit(check("e"), None))  # 92 < 100: admitted
            out.append(await service.ShouldRateLimit(check("f", max_output="17.0", body="x"), None))
            return out
        finally:
            await service.close()

    answers = asyncio.run(run())
    assert [a.overall_code for a in answers[:4]] == [OK, OK, OK, OVER]
    assert answers[2].statuses[0].limit_remaining == 0  # 120 reserved of 100
    assert answers[5].overall_code == OK
    assert answers[6].overall_code == OVER  # 12 + 120 reserved
    client = redis_client(redis)
    try:
        keys = [k for k in client.scan_iter(match="confgen:*:r")]
        assert len(keys) == 1
        held = {k.decode(): v.decode().split(":") for k, v in client.hgetall(keys[0]).items() if k != b"#total"}
        assert int(client.hget(keys[0], "#total")) == 120  # the running total beside them
        assert {rid: int(est) for rid, (est, _) in held.items()} == {"b": 40, "c": 40, "e": 40}
        # no hold_s in the descriptor: the hold of a route without a request timeout, plus the margin
        assert all(int(deadline) == 1_700_000_080 + 600 + 30 for _, deadline in held.values())
        assert 0 < client.ttl(keys[0]) <= 630  # a reservation whose answer never comes expires with its hold
    finally:
        client.close()


def test_the_end_of_an_answer_settles_its_reservation_and_a_refused_request_costs_nothing(
        redis: RedisProcess) -> None:
    """At stream end: the usage charge releases the reservation and the done marker then finds
    nothing; an answer without usage is charged its estimate by the done marker; a request
    that was refused (no reservation) is charged nothing, even with an estimate at hand."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()
    budget = "client/bob/0"

    def check(rid: str) -> Any:
        return _request(_descriptor(budget, "bob", "m1", hits=0, request_id=rid, max_output="20", body_bytes="0"))

    def end(rid: str, usage: int | None) -> Any:
        done = _descriptor(budget, "bob", "m1", hits=0, request_id=rid, phase="done")
        if usage is None:  # Envoy dropped the charge: no usage in metadata
            return _request(done)
        return _request(_descriptor(budget, "bob", "m1", hits=usage, request_id=rid), done)

    async def run() -> list[int]:
        service = _service(redis, clock, registry)
        await service.start()
        spent = []
        try:
            await service.ShouldRateLimit(check("a"), None)
            await service.ShouldRateLimit(end("a", 7), None)  # usage 7: charged 7, settled
            spent.append(await _spent(redis))
            await service.ShouldRateLimit(check("b"), None)
            await service.ShouldRateLimit(end("b", None), None)  # no usage: the estimate, 20
            spent.append(await _spent(redis))
            await service.ShouldRateLimit(end("never-checked", None), None)  # refused/unknown: nothing
            spent.append(await _spent(redis))
        finally:
            await service.close()
        return spent

    assert asyncio.run(run()) == [7, 27, 27]
    client = redis_client(redis)
    try:
        # nothing held: no reservation left, the running total back to 0
        assert [{f: v for f, v in client.hgetall(k).items() if f != b"#total" or v != b"0"}
                for k in client.scan_iter(match="confgen:*:r")] in ([], [{}])
    finally:
        client.close()


async def _spent(redis: RedisProcess, match: str = "confgen:*") -> int:
    client = redis_client(redis)
    try:
        return sum(int(client.get(k) or 0) for k in client.scan_iter(match=match)
                   if not k.endswith((b":r", b":r:z")))
    finally:
        client.close()


def redis_client(redis: RedisProcess) -> Any:
    import redis as redis_sync

    return redis_sync.Redis(host="127.0.0.1", port=redis.port, socket_timeout=2)


def test_what_is_not_a_budget_of_this_topology_is_not_counted(redis: RedisProcess) -> None:
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> list[Any]:
        service = _service(redis, clock, registry)
        await service.start()
        try:
            return [
                await service.ShouldRateLimit(_request(_descriptor("per_key/0", "alice"), domain="other"), None),
                await service.ShouldRateLimit(_request(_descriptor("nope/0", "alice")), None),
                # bob has his own limits: limits.per_key does not apply to him
                await service.ShouldRateLimit(_request(_descriptor("per_key/0", "bob")), None),
                await service.ShouldRateLimit(_request(_descriptor("per_key/0", "mallory")), None),
            ]
        finally:
            await service.close()

    for answer in asyncio.run(run()):
        assert answer.overall_code == OK
        assert all(not s.HasField("current_limit") for s in answer.statuses)


def test_dead_store_fails_open_except_fail_closed_then_counting_resumes(redis: RedisProcess) -> None:
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> dict[str, Any]:
        service = _service(redis, clock, registry)
        await service.start()
        out: dict[str, Any] = {}
        try:
            alice = _request(_descriptor("per_key/0", "alice"))
            carol = _request(_descriptor("client/carol/0", "carol"))
            out["before"] = (await service.ShouldRateLimit(alice, None)).overall_code
            redis.kill()
            out["down"] = [(await service.ShouldRateLimit(alice, None)).overall_code for _ in range(10)]
            out["carol_down"] = (await service.ShouldRateLimit(carol, None)).overall_code
            out["up_metric_down"] = registry.get_sample_value("confgen_sidecar_ratelimit_store_up")
            out["failures"] = registry.get_sample_value("confgen_sidecar_ratelimit_store_failures_total")
            await asyncio.to_thread(redis.restart)
            clock.mono += 0.3  # past the backoff
            await service.settled()
            out["replayed"] = await service.flush()  # the floor's two admissions, into the new (empty) store
            out["after"] = [(await service.ShouldRateLimit(alice, None)).overall_code for _ in range(6)]
            out["up_metric_after"] = registry.get_sample_value("confgen_sidecar_ratelimit_store_up")
        finally:
            await service.close()
        return out

    out = asyncio.run(run())
    assert out["before"] == OK
    # the local floor: 5 a minute over kubernetes.replicas (2) Envoys = 2 on this sidecar, never unlimited
    assert out["down"] == [OK] * 2 + [OVER] * 8
    assert out["carol_down"] == OVER  # fail_closed
    assert out["up_metric_down"] == 0
    assert out["failures"] == 1  # the backoff spared the store the other calls
    assert out["replayed"] == 2
    assert out["after"] == [OK] * 3 + [OVER] * 3  # a fresh store, told of the floor's 2, counts again at once
    assert out["up_metric_after"] == 1
    assert registry.get_sample_value("confgen_sidecar_ratelimit_decisions_total",
                                     {"code": "ok", "store": "floor"}) == 2
    assert registry.get_sample_value("confgen_sidecar_ratelimit_fail_open_total",
                                     {"budget": "per_key/0", "client": "alice", "code": "over_limit"}) == 8


def test_per_key_figures_count_each_budgets_answers_and_the_tokens_charged(redis: RedisProcess) -> None:
    """Per budget and client: every answer by its code (a request refused by one budget counts
    over_limit on each budget it carried), and the tokens each answer's end charged the store,
    by unit (usage, or the estimate when no usage came; a charge replayed with the same id counts
    once). A client the topology does not name adds no series: the labels stay bounded."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    def check(rid: str) -> Any:
        return _request(_descriptor("client/bob/0", "bob", "m1", hits=0, request_id=rid, max_output="20",
                                    body_bytes="0"))

    def end(rid: str, usage: int | None) -> Any:
        done = _descriptor("client/bob/0", "bob", "m1", hits=0, request_id=rid, phase="done")
        return _request(done) if usage is None else _request(
            _descriptor("client/bob/0", "bob", "m1", hits=usage, request_id=rid), done)

    async def run() -> None:
        service = _service(redis, clock, registry)
        await service.start()
        try:
            for _ in range(6):  # per_key/0: 5 a minute, the output-token budget beside it
                await service.ShouldRateLimit(
                    _request(_descriptor("per_key/0", "alice"), _descriptor("per_key/1", "alice", hits=0)), None)
            await service.ShouldRateLimit(check("a"), None)
            await service.ShouldRateLimit(end("a", 7), None)  # usage 7
            await service.ShouldRateLimit(end("a", 7), None)  # the same charge again (a replay): applied once
            await service.ShouldRateLimit(check("b"), None)
            await service.ShouldRateLimit(end("b", None), None)  # no usage: the estimate, 20
            await service.ShouldRateLimit(_request(_descriptor("per_key/1", "alice", hits=11)), None)  # no id
            for forged in ("mallory", "x" * 200, ""):  # not a client of the topology: not counted, no series
                await service.ShouldRateLimit(_request(_descriptor("per_key/0", forged)), None)
        finally:
            await service.close()

    asyncio.run(run())
    sample = registry.get_sample_value
    decisions = "confgen_sidecar_ratelimit_key_decisions_total"
    assert sample(decisions, {"budget": "per_key/0", "client": "alice", "code": "ok"}) == 5
    assert sample(decisions, {"budget": "per_key/0", "client": "alice", "code": "over_limit"}) == 1
    # per_key/1 did not refuse the sixth, per_key/0 did: the answer's code on both
    assert sample(decisions, {"budget": "per_key/1", "client": "alice", "code": "ok"}) == 5
    assert sample(decisions, {"budget": "per_key/1", "client": "alice", "code": "over_limit"}) == 1
    assert sample(decisions, {"budget": "client/bob/0", "client": "bob", "code": "ok"}) == 2
    charged = "confgen_sidecar_ratelimit_tokens_charged_total"
    assert sample(charged, {"budget": "client/bob/0", "client": "bob", "unit": "total_tokens"}) == 7 + 20
    assert sample(charged, {"budget": "per_key/1", "client": "alice", "unit": "output_tokens"}) == 11
    assert asyncio.run(_spent(redis)) == 5 + 7 + 20 + 11  # what the store holds: the same charges
    series = {(m.name, tuple(sorted(s.labels.items()))) for m in registry.collect() for s in m.samples
              if "budget" in s.labels}
    clients = {dict(labels)["client"] for _, labels in series}
    assert clients == {"alice", "bob"}, series
    # the answers' own counter keeps its labels and counts answers, not budgets (an end's charge is no answer)
    assert sample("confgen_sidecar_ratelimit_decisions_total", {"code": "ok", "store": "counted"}) == 5 + 2


def test_grpc_round_trip_on_the_sidecars_server(redis: RedisProcess) -> None:
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> list[int]:
        service = _service(redis, clock, registry)
        await service.start()
        server = GrpcServer(GrpcSettings("127.0.0.1", 0))
        server.add(service.add_to, service.name)
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rls_pb2_grpc.RateLimitServiceStub(channel)
                request = _request(_descriptor("client/carol/0", "carol"))
                return [(await stub.ShouldRateLimit(request, timeout=5)).overall_code for _ in range(3)]
        finally:
            await server.stop(0)
            await service.close()

    assert asyncio.run(run()) == [OK, OK, OVER]


def test_plaintext_grpc_beyond_loopback_is_refused() -> None:
    from sidecar.config import ConfigError

    with pytest.raises(ConfigError, match="loopback"):
        GrpcServer(GrpcSettings("0.0.0.0", 0))
