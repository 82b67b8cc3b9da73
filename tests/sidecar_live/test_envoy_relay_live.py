"""The sidecar's Envoy relay (sidecar.serve.envoy_relay) in front of a real Envoy with a
realistic stats volume: 300 static clusters, ~4 MB of Prometheus text. What the relay answers
is Envoy's whole exposition (Debian's promtool parses it to its end, never skipped) or an
error, never a truncated 200: over the byte cap a 502, past the deadline a 504 (a stalling
admin is a loopback socket that sends half a body: a fault a real Envoy does not make on
demand)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from confgen.runtime import EnvoyProcess, free_port
from sidecar.serve.envoy_relay import add_envoy_relay
from tests.observability.promtools import promtool_parses
from tests.support.exposition import families

CLUSTERS = 300


def bootstrap(clusters: int) -> dict[str, Any]:
    """Envoy with its admin on a free loopback port and `clusters` static clusters."""
    def cluster(i: int) -> dict[str, Any]:
        endpoint = {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9}}}}
        return {"name": f"pool-{i:03d}", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": f"pool-{i:03d}", "endpoints": [{"lb_endpoints": [endpoint]}]}}

    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {"clusters": [cluster(i) for i in range(clusters)]}}


@pytest.fixture(scope="module")
def envoy() -> Iterator[EnvoyProcess]:
    with EnvoyProcess(bootstrap(CLUSTERS)) as proc:
        yield proc


@asynccontextmanager
async def relay(admin_url: str, **options: Any) -> AsyncIterator[str]:
    """The relay's routes alone on a free loopback port; yields its base URL."""
    app = web.Application()
    add_envoy_relay(app, admin_url, **options)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def get(url: str) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session, session.get(url) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


def test_the_relayed_stats_of_300_clusters_are_envoys_whole_exposition(envoy: EnvoyProcess) -> None:
    """~4 MB of Envoy stats come through /envoy/stats whole: promtool parses the text to its end,
    it has the same families as Envoy's own answer and every cluster's series; /envoy/ready too."""
    async def scenario() -> tuple[tuple[int, str, bytes], tuple[int, str, bytes], tuple[int, str, bytes]]:
        async with relay(envoy.admin_url) as base:
            return (await get(f"{base}/envoy/stats"), await get(f"{envoy.admin_url}/stats/prometheus"),
                    await get(f"{base}/envoy/ready"))

    (status, kind, body), (_, _, direct), ready = asyncio.run(scenario())
    assert status == 200 and kind.startswith("text/plain"), (status, kind, body[:200])
    assert len(body) > 1 << 20, len(body)  # a realistic volume: far over one socket read
    ok, why = promtool_parses(body)
    assert ok, why
    assert body.endswith(b"\n")
    assert [f for f, _ in families(body.decode())] == [f for f, _ in families(direct.decode())]
    text = body.decode()
    assert all(f'envoy_cluster_name="pool-{i:03d}"' in text for i in range(CLUSTERS))
    assert ready[0] == 200 and ready[2].strip() == b"LIVE"


def test_over_the_cap_the_relay_answers_an_error_never_a_truncated_200(envoy: EnvoyProcess) -> None:
    async def scenario() -> tuple[int, str, bytes]:
        async with relay(envoy.admin_url, body_cap=256 << 10) as base:
            return await get(f"{base}/envoy/stats")

    status, kind, body = asyncio.run(scenario())
    assert status == 502 and kind.startswith("application/json"), (status, kind)
    assert "more than 262144 bytes" in json.loads(body)["error"]


def test_an_admin_that_stalls_mid_body_gets_a_504_within_the_deadline() -> None:
    """A stalling admin (headers and half the body, then nothing) is answered 504 at the deadline."""
    async def scenario() -> tuple[int, bytes, float]:
        async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n# TYPE a")
                await writer.drain()
                await reader.read()  # stalls until the relay gives up and closes its end
            finally:
                writer.close()

        server = await asyncio.start_server(half, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        try:
            async with relay(f"http://127.0.0.1:{port}", timeout_s=0.5) as base:
                started = loop.time()
                status, _, body = await get(f"{base}/envoy/stats")
                return status, body, loop.time() - started
        finally:
            server.close()
            await server.wait_closed()

    status, body, took = asyncio.run(scenario())
    assert status == 504 and "in time" in json.loads(body)["error"], (status, body)
    assert 0.4 <= took < 5.0, took


def test_an_admin_that_is_down_makes_envoy_not_ready() -> None:
    async def scenario() -> tuple[int, bytes]:
        async with relay(f"http://127.0.0.1:{free_port()}") as base:
            status, _, body = await get(f"{base}/envoy/ready")
            return status, body

    status, body = asyncio.run(scenario())
    assert status == 503 and "unreachable" in json.loads(body)["error"]
