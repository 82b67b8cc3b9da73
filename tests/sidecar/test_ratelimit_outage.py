"""The rate limit service when its store fails, against a real redis-server killed and
restarted: the local floor (never unlimited), the journal of charges (replayed when Redis
returns, kept across a sidecar restart), reservations bounded by the request's own timeout,
and estimates that match what a request can cost. Fake clocks; replays triggered explicitly."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.registry import CollectorRegistry

from confgen.runtime import RedisProcess
from confgen.topology import parse
from sidecar.outputs.ratelimit import RateLimitService
from sidecar.outputs.ratelimit.local import LocalCounter
from sidecar.outputs.ratelimit.store import Op
from tests.sidecar.test_ratelimit_service import OK, OVER, Clock, _descriptor, _flush, _request, _spent, redis_client


def _pause(redis: RedisProcess, resume: bool = False) -> None:
    """SIGSTOP/SIGCONT the test's own redis-server (by its pid): unreachable, its memory kept."""
    os.kill(redis.pid, signal.SIGCONT if resume else signal.SIGSTOP)


def _topology(redis: str, envoys: int = 3) -> Any:
    text = f"""\
version: 1
name: rl
listeners: [{{name: public, port: 8080, max_request_bytes: 4096}}]
pools:
  - name: p
    engine: vllm
    models: [m1]
    workers: ["127.0.0.1:8000"]
    max_output_tokens: 700
    timeouts: {{request: 120s}}
auth:
  api_keys:
    - {{client: alice, env: A}}
    - client: bob
      env: B
      rate_limit: {{scope: global, unit: total_tokens, tokens: 3000, window: minute}}
limits:
  store: {{redis: "{redis}", timeout: 200ms, check_timeout: 400ms, envoys: {envoys}}}
  per_key: {{scope: global, requests: 30, window: minute}}
"""
    topo, _ = parse(text.encode(), "rl.yaml")
    return topo


@pytest.fixture()
def redis() -> Iterator[RedisProcess]:
    with RedisProcess() as proc:
        yield proc


def _service(redis: RedisProcess, clock: Clock, registry: CollectorRegistry, journal: Path | None = None,
             envoys: int = 3) -> RateLimitService:
    topo = _topology(redis.address, envoys)
    return RateLimitService(lambda: topo, registry, clock.monotonic, wall=clock.time, backoff_s=0.25,
                            journal=journal, flush_interval_s=3600)


def check(rid: str, **extra: str) -> Any:
    return _request(_descriptor("client/bob/0", "bob", hits=0, request_id=rid, **extra))


def end(rid: str, usage: int | None) -> Any:
    done = _descriptor("client/bob/0", "bob", hits=0, request_id=rid, phase="done")
    if usage is None:
        return _request(done)
    return _request(_descriptor("client/bob/0", "bob", hits=usage, request_id=rid), done)


def _held(redis: RedisProcess) -> dict[str, tuple[int, int]]:
    client = redis_client(redis)
    try:
        out = {}
        for key in client.scan_iter(match="confgen:*:r"):
            for rid, value in client.hgetall(key).items():
                if rid == b"#total":
                    continue
                est, deadline = value.decode().split(":")
                out[rid.decode()] = (int(est), int(deadline))
        return out
    finally:
        client.close()


def test_a_dead_store_falls_back_to_the_floor_per_key_never_unlimited(redis: RedisProcess) -> None:
    """30 requests a minute over 3 Envoys: 10 on this sidecar's floor while Redis is dead, the
    rest refused, every floor decision counted per budget and client."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> list[int]:
        service = _service(redis, clock, registry)
        await service.start()
        try:
            redis.kill()
            return [(await service.ShouldRateLimit(_request(_descriptor("per_key/0", "alice")), None)).overall_code
                    for _ in range(50)]
        finally:
            await service.close()

    codes = asyncio.run(run())
    assert codes == [OK] * 10 + [OVER] * 40
    sample = registry.get_sample_value
    assert sample("confgen_sidecar_ratelimit_fail_open_total",
                  {"budget": "per_key/0", "client": "alice", "code": "ok"}) == 10
    assert sample("confgen_sidecar_ratelimit_fail_open_total",
                  {"budget": "per_key/0", "client": "alice", "code": "over_limit"}) == 40


def test_charges_the_store_missed_are_replayed_when_it_returns(redis: RedisProcess) -> None:
    """Reservations made while Redis answered, answers ending while it is dead (with usage, and
    without: the estimate), a request admitted on the floor: once Redis is back and the journal
    replayed, the counter is every token spent and no reservation is left."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> dict[str, Any]:
        service = _service(redis, clock, registry)
        await service.start()
        out: dict[str, Any] = {}
        try:
            for rid in ("a", "b"):
                assert (await service.ShouldRateLimit(check(rid, max_output="50", body_bytes="40"), None)
                        ).overall_code == OK
            redis.kill()
            await service.ShouldRateLimit(end("a", 37), None)  # usage 37
            await service.ShouldRateLimit(end("b", None), None)  # no usage: its estimate, 50 + 40/4
            # admitted on the floor (3000 / 3): its estimate is held here, then charged at its end
            assert (await service.ShouldRateLimit(check("c", max_output="20", body_bytes="0"), None)
                    ).overall_code == OK
            await service.ShouldRateLimit(end("c", None), None)
            await service.settled()
            out["journal"] = registry.get_sample_value("confgen_sidecar_ratelimit_journal_entries")
            await asyncio.to_thread(redis.restart)
            # the store restarted empty: put back what it held before (reservations a and b were
            # in the killed process); a real outage without a restart keeps them
            clock.mono += 0.3
            out["replayed"] = await service.flush()
            out["spent"] = await _spent(redis)
        finally:
            await service.close()
        return out

    out = asyncio.run(run())
    assert out["journal"] == 3
    assert out["replayed"] == 3
    # a: 37 (its usage); b: the estimate's charge needed b's reservation, lost with the killed
    # store's memory, so nothing (see the next test for an outage without a restart); c: 20
    assert out["spent"] == 37 + 20
    assert _held(redis) == {}


def test_an_unreachable_store_that_comes_back_gets_every_charge(redis: RedisProcess, tmp_path: Path) -> None:
    """The store paused (SIGSTOP: unreachable, its memory kept) while answers end, and the
    sidecar restarted in between: the journal on disk is replayed by the new process and
    the counter equals the tokens spent, reservations settled."""
    _flush(redis)
    clock = Clock()
    path = tmp_path / "journal.sqlite"

    async def first() -> None:
        service = _service(redis, clock, CollectorRegistry(), journal=path)
        await service.start()
        try:
            for rid in ("a", "b"):
                await service.ShouldRateLimit(check(rid, max_output="50", body_bytes="40"), None)
            _pause(redis)
            await service.ShouldRateLimit(end("a", 37), None)
            await service.ShouldRateLimit(end("b", None), None)  # the estimate: 60
            await service.settled()
        finally:
            await service.close()

    async def second() -> tuple[int, int]:
        registry = CollectorRegistry()
        service = _service(redis, clock, registry, journal=path)
        await service.start()
        try:
            kept = int(registry.get_sample_value("confgen_sidecar_ratelimit_journal_entries") or 0)
            return kept, await service.flush()
        finally:
            await service.close()

    asyncio.run(first())
    assert path.exists()
    _pause(redis, resume=True)
    kept, replayed = asyncio.run(second())
    assert (kept, replayed) == (2, 2)
    assert asyncio.run(_spent(redis)) == 37 + 60
    assert _held(redis) == {}


def test_reservations_hold_for_the_request_timeout_and_match_the_worst_case(redis: RedisProcess) -> None:
    """The route's hold (its pool's request timeout) + 30 s, not the window; without max_tokens the
    route's max output is reserved (the descriptor's default, rendered from max_output_tokens);
    a body without content-length reserves the listener's largest body."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> None:
        service = _service(redis, clock, registry)
        await service.start()
        try:
            await service.ShouldRateLimit(check("timed", max_output="700", body_bytes="400", hold_s="120"), None)
            await service.ShouldRateLimit(check("chunked", max_output="10", hold_s="120"), None)
        finally:
            await service.close()

    asyncio.run(run())
    held = _held(redis)
    now = int(clock.wall)
    assert held["timed"] == (700 + 100, now + 120 + 30)
    assert held["chunked"] == (10 + 4096 // 4, now + 150)


def test_local_counter_mirrors_the_script() -> None:
    """The floor's modes: a admits within the limit, r reserves and refuses past spent + reserved,
    f charges and releases, d charges a reservation still held, and windows expire."""
    local = LocalCounter()
    now = 100.0

    def op(mode: str, cost: int = 0, rid: str = "", est: int = 0) -> Op:
        return Op("k", mode, cost, 10, 60, rid, est, "k:r", 30)  # type: ignore[arg-type]

    assert [local.decide([op("a", 4)], now).refused for _ in range(3)] == [False, False, True]  # 8 of 10
    local = LocalCounter()
    assert not local.decide([op("r", rid="x", est=6)], now).refused
    assert not local.decide([op("r", rid="y", est=6)], now).refused  # 0 + 6 < 10
    assert local.decide([op("r", rid="z", est=6)], now).refused  # 0 + 12 >= 10
    local.decide([op("f", 2, rid="x")], now)  # usage 2, x released
    assert local.decide([op("d", rid="y")], now).counts == [8]  # y had no usage: its estimate
    assert local.decide([op("r", rid="z", est=1)], now).refused is False  # 8 < 10
    assert local.decide([op("c")], now + 61).counts == [0]  # the window expired


def test_a_reservation_past_its_hold_leaves_the_running_total(redis: RedisProcess) -> None:
    """The total held beside a budget drops a reservation once its hold (+30 s) has passed: the
    budget it blocked admits again, and the hash keeps only what is still in flight."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> list[int]:
        service = _service(redis, clock, registry)
        await service.start()
        try:
            codes = [(await service.ShouldRateLimit(check("stuck", max_output="2990", body_bytes="40", hold_s="1"),
                                                    None)).overall_code]
            codes.append((await service.ShouldRateLimit(check("next", max_output="5", body_bytes="0", hold_s="1"),
                                                        None)).overall_code)  # 3000 held of 3000
            clock.wall += 32  # past the stuck one's hold (1 s + 30 s)
            codes.append((await service.ShouldRateLimit(check("later", max_output="5", body_bytes="0",
                                                              hold_s="60"), None)).overall_code)
            return codes
        finally:
            await service.close()

    assert asyncio.run(run()) == [OK, OVER, OK]
    assert _held(redis) == {"later": (5, (1_700_000_080 + 32) + 90)}
    client = redis_client(redis)
    try:
        key = next(iter(client.scan_iter(match="confgen:*:r")))
        assert int(client.hget(key, "#total")) == 5
        assert client.zcard(key + b":z") == 1
    finally:
        client.close()


def test_replayed_charges_count_per_key_and_fold_what_the_topology_no_longer_names(redis: RedisProcess) -> None:
    """Charges the journal kept count in the per-key tokens charged when they are replayed, under
    the topology of that moment: a client it no longer names is folded into "(other)", and a budget
    it no longer has into "(other)" for budget, client and unit, so the series stay bounded. Dave's
    charge reached the paused Redis and timed out, Redis ran it once resumed: the replay finds its
    mark and counts what that call added (once); bob's never left (the store was in its backoff)."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    def text(keys: str) -> Any:
        topo, _ = parse(f"""\
version: 1
name: rl
listeners: [{{name: public, port: 8080}}]
pools: [{{name: p, engine: vllm, models: [m1], workers: ["127.0.0.1:8000"]}}]
auth:
  api_keys:
{keys}
limits:
  store: {{redis: "{redis.address}", timeout: 200ms, check_timeout: 400ms}}
  per_key: {{scope: global, unit: output_tokens, tokens: 1000, window: hour}}
""".encode(), "rl.yaml")
        return topo

    before = text("    - {client: alice, env: A}\n    - {client: dave, env: D}\n"
                  "    - {client: bob, env: B, rate_limit: {scope: global, unit: total_tokens, tokens: 3000, "
                  "window: minute}}")
    after = text("    - {client: alice, env: A}\n    - {client: bob, env: B}")
    current = [before]

    def charge(budget: str, client: str, rid: str, usage: int) -> Any:
        return _request(_descriptor(budget, client, hits=usage, request_id=rid),
                        _descriptor(budget, client, hits=0, request_id=rid, phase="done"))

    async def run() -> int:
        service = RateLimitService(lambda: current[0], registry, clock.monotonic, wall=clock.time, backoff_s=0.25,
                                   flush_interval_s=3600)
        await service.start()
        try:
            assert (await service.ShouldRateLimit(_request(_descriptor("per_key/0", "dave", hits=0, request_id="d")),
                                                  None)).overall_code == OK
            assert (await service.ShouldRateLimit(
                _request(_descriptor("client/bob/0", "bob", hits=0, request_id="b")), None)).overall_code == OK
            _pause(redis)
            await service.ShouldRateLimit(charge("per_key/0", "dave", "d", 9), None)  # journaled
            await service.ShouldRateLimit(charge("client/bob/0", "bob", "b", 13), None)
            await service.settled()
            assert registry.get_sample_value("confgen_sidecar_ratelimit_tokens_charged_total",
                                             {"budget": "per_key/0", "client": "dave", "unit": "output_tokens"}) is None
            current[0] = after  # dave removed; bob without a budget of his own
            _pause(redis, resume=True)
            clock.mono += 0.3
            return await service.flush()
        finally:
            await service.close()

    assert asyncio.run(run()) == 2
    sample = registry.get_sample_value
    charged = "confgen_sidecar_ratelimit_tokens_charged_total"
    assert sample(charged, {"budget": "per_key/0", "client": "(other)", "unit": "output_tokens"}) == 9
    assert sample(charged, {"budget": "(other)", "client": "(other)", "unit": "(other)"}) == 13
    assert {s.labels["client"] for m in registry.collect() for s in m.samples if m.name.endswith("tokens_charged")
            } == {"(other)"}
    assert asyncio.run(_spent(redis)) == 9 + 13


def _client_pause(redis: RedisProcess, ms: int | None) -> None:
    client = redis_client(redis)
    try:
        if ms is None:
            client.execute_command("CLIENT", "UNPAUSE")
        else:
            client.execute_command("CLIENT", "PAUSE", ms, "WRITE")  # scripts wait, CLIENT UNPAUSE does not
    finally:
        client.close()


def test_a_charge_cancelled_while_redis_is_slow_is_journaled_and_applied_once(redis: RedisProcess) -> None:
    """A charge whose call Envoy gives up on (its check_timeout cancels the handler, as grpc.aio does at
    a deadline: injected, no real Envoy cancels at that instant) while Redis holds the script (CLIENT
    PAUSE WRITE, until UNPAUSE) is journaled, not lost, and applied once."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> dict[str, Any]:
        service = _service(redis, clock, registry)
        await service.start()
        out: dict[str, Any] = {}
        try:
            assert (await service.ShouldRateLimit(check("a", max_output="50", body_bytes="40"), None)
                    ).overall_code == OK
            await asyncio.to_thread(_client_pause, redis, 10_000)
            call = asyncio.create_task(service.ShouldRateLimit(end("a", 37), None))
            gauge = "confgen_sidecar_ratelimit_store_calls_in_flight"
            turns = 0  # the loop's turns, not time: until the charge's script is on its way to Redis, then 10 more
            for turns in range(1000):
                if registry.get_sample_value(gauge) and turns >= 10:
                    break
                await asyncio.sleep(0)
            assert registry.get_sample_value(gauge) == 1, turns
            call.cancel()  # Envoy's deadline passed: grpc.aio cancels the handler
            with pytest.raises(asyncio.CancelledError):
                await call
            await service.settled()
            out["journal"] = registry.get_sample_value("confgen_sidecar_ratelimit_journal_entries")
            await asyncio.to_thread(_client_pause, redis, None)
            clock.mono += 0.3
            out["replayed"] = await service.flush()
            out["replayed_again"] = await service.flush()
            out["spent"] = await _spent(redis)
        finally:
            await service.close()
        return out

    out = asyncio.run(run())
    assert out["journal"] == 1  # kept, though the call never answered
    assert out["replayed"] == 1 and out["replayed_again"] == 0
    assert out["spent"] == 37  # once: the usage, whether or not Redis ran the cancelled call's script


def test_close_ends_the_journal_flusher_even_when_its_wake_and_the_cancel_land_together(
        redis: RedisProcess, tmp_path: Path) -> None:
    """The flusher waits for its wake with a timeout; `close` cancels it. Set the wake and cancel in
    the same loop iteration: on Python 3.11 `asyncio.wait_for` returned the wake's result there and
    swallowed the cancel, the loop went on and `close` never returned (a sidecar SIGKILLed on SIGTERM in
    CI). The flusher must end, and `close` return, at once."""
    async def run() -> None:
        service = _service(redis, Clock(), CollectorRegistry(), journal=tmp_path / "journal.db")
        await service.start()
        for _ in range(3):  # the flusher is waiting for its wake
            await asyncio.sleep(0)
        flusher = service._flusher
        assert flusher is not None
        service._wake.set()
        flusher.cancel()  # as close() does, in the same iteration as the wake
        done, _ = await asyncio.wait({flusher}, timeout=5)
        assert flusher in done and flusher.cancelled()
        await service.close()

    asyncio.run(run())


def test_a_charge_redis_refuses_is_dropped_and_the_journal_replays_past_it(redis: RedisProcess) -> None:
    """Redis back, but one journaled charge touches a key something else rewrote with another type
    (WRONGTYPE: refused again on every try): that entry is dropped and counted, the charges after it
    are applied, and the store is not taken for down. Before, the replay stopped at it for good and
    every later charge piled up behind it until the journal was full."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> dict[str, Any]:
        service = _service(redis, clock, registry)
        await service.start()
        out: dict[str, Any] = {}
        try:
            alice = _request(_descriptor("per_key/0", "alice"))
            assert (await service.ShouldRateLimit(alice, None)).overall_code == OK  # alice's key exists
            assert (await service.ShouldRateLimit(check("a", max_output="50", body_bytes="40"), None)
                    ).overall_code == OK
            _pause(redis)
            assert (await service.ShouldRateLimit(alice, None)).overall_code == OK  # the floor: journaled
            await service.ShouldRateLimit(end("a", 37), None)  # journaled after alice's
            await service.settled()
            _pause(redis, resume=True)
            client = redis_client(redis)
            try:
                keys = [k for k in client.scan_iter(match="confgen:*") if b":alice:" in k]
                assert len(keys) == 1, keys
                client.delete(keys[0])
                client.rpush(keys[0], b"not a counter")
            finally:
                client.close()
            clock.mono += 0.3  # past the backoff the pause caused
            out["replayed"] = await service.flush()
            out["left"] = registry.get_sample_value("confgen_sidecar_ratelimit_journal_entries")
            out["dropped"] = registry.get_sample_value("confgen_sidecar_ratelimit_charges_dropped_total")
            out["spent"] = await _spent(redis, "confgen:*:bob:*")  # bob's token counter (alice's key is a list now)
            # alice's next request is refused by Redis (her key): decided on the floor, and the store is not
            # taken for down: bob's next check is counted by Redis, not decided on the floor for a backoff
            before = registry.get_sample_value("confgen_sidecar_ratelimit_decisions_total",
                                               {"code": "ok", "store": "counted"}) or 0
            assert (await service.ShouldRateLimit(alice, None)).overall_code == OK
            await service.ShouldRateLimit(check("b", max_output="50", body_bytes="40"), None)
            out["counted"] = (registry.get_sample_value("confgen_sidecar_ratelimit_decisions_total",
                                                        {"code": "ok", "store": "counted"}) or 0) - before
        finally:
            await service.close()
        return out

    out = asyncio.run(run())
    assert out == {"replayed": 1, "left": 0, "dropped": 1, "spent": 37, "counted": 1}, out


def test_store_up_follows_redis_back_without_any_request(redis: RedisProcess) -> None:
    """Found by review: `store_up` went back to 1 only on a live request, so one slow call in a quiet period
    kept it 0 (and ConfgenRateLimitStoreDown paging) until traffic returned. The journal's flusher asks Redis
    (PING) while it is taken for down: up again with no request, and down again while it does not answer."""
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> list[float | None]:
        topo = _topology(redis.address)
        service = RateLimitService(lambda: topo, registry, clock.monotonic, wall=clock.time, backoff_s=0.25,
                                   flush_interval_s=0.02)
        up = lambda: registry.get_sample_value("confgen_sidecar_ratelimit_store_up")  # noqa: E731
        seen: list[float | None] = []

        async def until(value: float) -> None:
            async with asyncio.timeout(10):
                while up() != value:
                    clock.mono += 0.3  # past each backoff: the flusher's next look may ask
                    await asyncio.sleep(0.02)

        await service.start()
        try:
            _pause(redis)
            await service.ShouldRateLimit(_request(_descriptor("per_key/0", "alice")), None)  # times out: down
            seen.append(up())
            _pause(redis, resume=True)
            await until(1.0)  # no request since
            seen.append(up())
            _pause(redis)
            await until(0.0)
            seen.append(up())
            _pause(redis, resume=True)
            await until(1.0)
            seen.append(up())
        finally:
            _pause(redis, resume=True)
            await service.close()
        return seen

    assert asyncio.run(run()) == [0.0, 1.0, 0.0, 1.0]
