"""The global limits' Redis with a password (limits.store.password_env, username): a real redis-server with
`requirepass` (and an ACL user) counts the sidecar's decisions when it sends the right credentials, and
refuses it without them or with wrong ones: the store is then down and the fail-closed budget refuses, as
for any store outage. A Redis without a password lets every local process reset the budgets."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client.registry import CollectorRegistry

from confgen.errors import TopologyError
from confgen.runtime import RedisProcess
from confgen.topology import parse
from sidecar.outputs.ratelimit import RateLimitService

PASSWORD = "s3cret-for-the-counters"
ACL_PASSWORD = "another-s3cret-acl"
OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT


def _topology(redis: str, store_extra: str) -> Any:
    text = f"""\
version: 1
name: rl
listeners: [{{name: public, port: 8080}}]
pools:
  - {{name: p, engine: vllm, models: [m1], workers: ["127.0.0.1:8000"]}}
auth:
  api_keys:
    - client: carol
      env: C
      rate_limit: {{scope: global, requests: 2, window: minute, fail_closed: true}}
limits:
  store: {{redis: "{redis}", timeout: 200ms, check_timeout: 400ms{store_extra}}}
"""
    topo, _ = parse(text.encode(), "rl.yaml")
    return topo


def _command(port: int, *lines: bytes) -> list[bytes]:
    """Raw RESP inline commands on one connection; each answer's first line."""
    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        reader = sock.makefile("rb")
        for line in lines:
            sock.sendall(line + b"\r\n")
            answers.append(reader.readline().rstrip())
    return answers


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisProcess]:
    with RedisProcess(password=PASSWORD) as proc:
        auth = b"AUTH " + PASSWORD.encode()
        acl = b"ACL SETUSER confgen on >" + ACL_PASSWORD.encode() + b" ~* +@all"
        assert _command(proc.port, auth, acl) == [b"+OK", b"+OK"]
        yield proc


def _decide(topo: Any, count: int) -> tuple[list[int], float | None]:
    """`count` checks of carol's fail-closed budget; their codes and the store_up gauge after."""
    registry = CollectorRegistry()
    request = rls_pb2.RateLimitRequest(domain="confgen.rl", descriptors=[ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="confgen_limit", value="client/carol/0"),
                 ratelimit_pb2.RateLimitDescriptor.Entry(key="client", value="carol")])])

    async def run() -> list[int]:
        # a fixed wall clock: every check in one window (1_700_000_040 starts a minute)
        service = RateLimitService(lambda: topo, registry, time.monotonic, wall=lambda: 1_700_000_080.0,
                                   flush_interval_s=3600)
        await service.start()
        try:
            return [(await service.ShouldRateLimit(request, None)).overall_code for _ in range(count)]
        finally:
            await service.close()

    codes = asyncio.run(run())
    return codes, registry.get_sample_value("confgen_sidecar_ratelimit_store_up")


def _flush(redis: RedisProcess) -> None:
    assert _command(redis.port, b"AUTH " + PASSWORD.encode(), b"FLUSHALL") == [b"+OK", b"+OK"]


def test_the_right_password_counts_and_none_or_a_wrong_one_is_a_store_outage(
        redis: RedisProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    _flush(redis)
    topo = _topology(redis.address, ", password_env: RL_REDIS_PASSWORD")
    monkeypatch.setenv("RL_REDIS_PASSWORD", PASSWORD)
    assert _decide(topo, 3) == ([OK, OK, OVER], 1.0)  # 2 a minute, counted in Redis
    assert _command(redis.port, b"AUTH " + PASSWORD.encode(), b"DBSIZE")[1] != b":0"
    # without it (or wrong): Redis refuses every call; the fail-closed budget refuses
    monkeypatch.setenv("RL_REDIS_PASSWORD", "wrong-password")
    assert _decide(topo, 1) == ([OVER], 0.0)
    monkeypatch.delenv("RL_REDIS_PASSWORD")
    assert _decide(topo, 1) == ([OVER], 0.0)
    assert _decide(_topology(redis.address, ""), 1) == ([OVER], 0.0)  # no password_env at all


def test_an_acl_user_with_its_password(redis: RedisProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    _flush(redis)
    monkeypatch.setenv("RL_ACL", ACL_PASSWORD)
    assert _decide(_topology(redis.address, ", username: confgen, password_env: RL_ACL"), 3) == ([OK, OK, OVER], 1.0)
    # the default user's password is not this user's
    assert _decide(_topology(redis.address, ", password_env: RL_ACL"), 1) == ([OVER], 0.0)


def test_a_username_needs_its_password_and_the_rendered_redis_has_none_but_default() -> None:
    with pytest.raises(TopologyError, match=r"limits\.store\.username.*password_env"):
        _topology("127.0.0.1:6379", ", username: confgen")
