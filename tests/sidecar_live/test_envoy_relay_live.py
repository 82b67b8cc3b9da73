"""The sidecar's Envoy relay (sidecar.serve.envoy_relay) in front of a real Envoy with a
realistic stats volume: 300 static clusters, ~4 MB of Prometheus text. What the relay answers
is Envoy's whole exposition (Debian's promtool parses it to its end, never skipped) or an
error, never a truncated 200: over the byte cap a 502, past the deadline a 504 (a stalling
admin is a loopback socket that sends half a body: a fault a real Envoy does not make on
demand)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from confgen.runtime import EnvoyProcess, free_port
from sidecar.serve.envoy_relay import _RELAY, add_envoy_relay
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
    it has the families of Envoy's own answers just before and just after it (an Envoy that has just
    started still adds a few: its workers' watchdog stats) and every cluster's series; /envoy/ready too."""
    async def scenario() -> tuple[bytes, tuple[int, str, bytes], bytes, tuple[int, str, bytes]]:
        async with relay(envoy.admin_url) as base:
            return ((await get(f"{envoy.admin_url}/stats/prometheus"))[2], await get(f"{base}/envoy/stats"),
                    (await get(f"{envoy.admin_url}/stats/prometheus"))[2], await get(f"{base}/envoy/ready"))

    before, (status, kind, body), after, ready = asyncio.run(scenario())
    assert status == 200 and kind.startswith("text/plain"), (status, kind, body[:200])
    assert len(body) > 1 << 20, len(body)  # a realistic volume: far over one socket read
    ok, why = promtool_parses(body)
    assert ok, why
    assert body.endswith(b"\n")
    relayed = {f for f, _ in families(body.decode())}
    assert {f for f, _ in families(before.decode())} <= relayed <= {f for f, _ in families(after.decode())}
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


def _ask_and_never_read(port: int) -> socket.socket:
    """A client that asks for the stats and reads nothing (a receive buffer of 4 KiB: the kernel does
    not absorb the answer for it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /envoy/stats HTTP/1.1\r\nHost: relay\r\n\r\n")
    return sock


def test_clients_that_never_read_hold_a_slot_for_the_deadline_and_no_more(envoy: EnvoyProcess) -> None:
    """Found by review: 24 clients that asked for the stats and never read held 1.5 GB of the sidecar for
    as long as they kept their connections. Now at most `max_relays` answers are sent at once (the
    rest: 503 with retry-after), and an answer not taken within the deadline is cut: its slot is free
    again while the clients still hold their connections, unread."""
    async def scenario() -> tuple[list[int], list[int], float]:
        loop = asyncio.get_running_loop()
        async with relay(envoy.admin_url, timeout_s=1.0, max_relays=2) as base:
            port = int(base.rsplit(":", 1)[1])
            held = [await asyncio.to_thread(_ask_and_never_read, port) for _ in range(2)]
            try:
                busy = []
                for _ in range(50):  # until both slots are seen taken (the two asks reach the relay)
                    status, _, _ = await get(f"{base}/envoy/stats")
                    busy.append(status)
                    if status == 503:
                        break
                taken = loop.time()
                freed = []
                while loop.time() - taken < 10.0:  # the held answers cut at their deadline: slots free
                    status, _, _ = await get(f"{base}/envoy/stats")
                    freed.append(status)
                    if status == 200:
                        break
                    await asyncio.sleep(0.1)
                return busy, freed, loop.time() - taken
            finally:
                for sock in held:
                    sock.close()

    busy, freed, took = asyncio.run(scenario())
    assert busy[-1] == 503 and set(busy[:-1]) <= {200}, busy
    assert freed[-1] == 200 and set(freed[:-1]) <= {503} and took < 5.0, (freed, took)


def test_asks_that_arrive_during_a_fetch_share_it() -> None:
    """Envoy's admin thread dumps its stats once for the asks that arrive while a dump is under way
    (an admin that answers when told: the fault a real Envoy does not make on demand)."""
    async def scenario() -> tuple[list[int], int]:
        hits = 0
        release = asyncio.Event()

        async def stats(request: web.Request) -> web.Response:
            nonlocal hits
            hits += 1
            await release.wait()
            return web.Response(text="# TYPE a counter\na 1\n")

        admin = web.Application()
        admin.router.add_get("/stats/prometheus", stats)
        runner = web.AppRunner(admin, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            app = web.Application()
            add_envoy_relay(app, f"http://127.0.0.1:{port}", max_relays=8)
            relay_runner = web.AppRunner(app, access_log=None)
            await relay_runner.setup()
            relay_port = free_port()
            await web.TCPSite(relay_runner, "127.0.0.1", relay_port).start()
            try:
                asks = [asyncio.ensure_future(get(f"http://127.0.0.1:{relay_port}/envoy/stats")) for _ in range(5)]
                for _ in range(1000):  # every ask in the relay, waiting on the one fetch
                    if app[_RELAY].sending == 5:
                        break
                    await asyncio.sleep(0.005)
                release.set()
                answers = await asyncio.gather(*asks)
                return [status for status, _, _ in answers], hits
            finally:
                await relay_runner.cleanup()
        finally:
            await runner.cleanup()

    statuses, hits = asyncio.run(scenario())
    assert statuses == [200] * 5 and hits == 1


def test_a_client_that_goes_away_mid_answer_frees_its_slot_without_an_error(
        envoy: EnvoyProcess, caplog: pytest.LogCaptureFixture) -> None:
    """A scraper that resets its connection while ~4 MB are being sent: the relay's slot is free again and
    nothing is logged as an error (the reset is the client's, not a fault of the relay)."""
    import struct

    async def scenario() -> tuple[int, int]:
        app = web.Application()
        add_envoy_relay(app, envoy.admin_url, max_relays=1)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /envoy/stats HTTP/1.1\r\nHost: relay\r\n\r\n")
            await writer.drain()
            await reader.readexactly(1024)  # the answer is under way
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            writer.close()
            for _ in range(200):  # the handler sees the reset and returns
                if app[_RELAY].sending == 0:
                    break
                await asyncio.sleep(0.01)
            status, _, _ = await get(f"http://127.0.0.1:{port}/envoy/stats")
            return app[_RELAY].sending, status
        finally:
            await runner.cleanup()

    with caplog.at_level("ERROR"):
        sending, status = asyncio.run(scenario())
    assert sending == 0 and status == 200
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.records
