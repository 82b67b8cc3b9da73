"""A charge whose call Envoy gives up on (its timeout cancels the handler) while Redis is slow is
journaled, not lost, and applied once. Real redis-server, paused with CLIENT PAUSE WRITE (it holds
the decision script until UNPAUSE); the cancellation is what grpc.aio does when the
caller's deadline passes, injected here because no real Envoy can be made to cancel at that instant."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.registry import CollectorRegistry

from confgen.runtime import RedisProcess
from tests.sidecar.test_ratelimit_outage import _service, check, end
from tests.sidecar.test_ratelimit_service import OK, Clock, _flush, _spent, redis_client


@pytest.fixture()
def redis() -> Iterator[RedisProcess]:
    with RedisProcess() as proc:
        yield proc


def _pause(redis: RedisProcess, ms: int | None) -> None:
    client = redis_client(redis)
    try:
        if ms is None:
            client.execute_command("CLIENT", "UNPAUSE")
        else:
            client.execute_command("CLIENT", "PAUSE", ms, "WRITE")  # scripts wait, CLIENT UNPAUSE does not
    finally:
        client.close()


def test_a_charge_cancelled_while_redis_is_slow_is_journaled_and_applied_once(redis: RedisProcess) -> None:
    _flush(redis)
    clock, registry = Clock(), CollectorRegistry()

    async def run() -> dict[str, Any]:
        service = _service(redis, clock, registry)
        await service.start()
        out: dict[str, Any] = {}
        try:
            assert (await service.ShouldRateLimit(check("a", max_output="50", body_bytes="40"), None)
                    ).overall_code == OK
            await asyncio.to_thread(_pause, redis, 10_000)
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
            await asyncio.to_thread(_pause, redis, None)
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
