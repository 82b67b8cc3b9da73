"""Fault modes, switched at run time through the admin endpoint, the control channel,
the Python handle or a schedule; each one observable from outside."""

import asyncio
import socket

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from confgen.simulate import FaultSpec, Fleet, FleetSpec, ScheduledFault, WorkerSpec, run_fleet_in_thread

from ._helpers import complete, poll, scrape, session, value

FAST = {"decode_ms": 2.0, "prefill_ms_per_1k": 5.0}


async def _set_fault(s: aiohttp.ClientSession, url: str, mode: str, **params: object) -> None:
    async with s.post(url + "/_sim/fault", json={"mode": mode, **params}) as r:
        assert r.status == 200, await r.text()


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_crash_closes_the_port_and_the_control_channel_revives_it() -> None:
    """crash: connection refused (even the admin is gone); POST to the control channel revives."""
    spec = FleetSpec((WorkerSpec(name="w0", **FAST), WorkerSpec(name="w1", **FAST)))
    with run_fleet_in_thread(spec) as fleet:
        w0 = fleet.worker("w0")

        async def run() -> None:
            async with session() as s:
                assert (await complete(s, w0.url, max_tokens=1))[0] == 200
                await _set_fault(s, w0.url, "crash")

                async def gone() -> bool:
                    return _refused(w0.port)

                await poll(gone)
                with pytest.raises(aiohttp.ClientConnectorError):
                    await s.get(w0.url + "/_sim/stats")
                assert (await complete(s, fleet.worker("w1").url, max_tokens=1))[0] == 200
                async with s.post(f"{fleet.control_url}/_fleet/workers/w0/revive") as r:
                    assert r.status == 200 and (await r.json())["up"] is True
                assert (await complete(s, w0.url, max_tokens=1))[0] == 200

        asyncio.run(run())
        w0.crash()
        assert _refused(w0.port) and w0.stats()["up"] is False
        w0.revive()
        assert not _refused(w0.port)
        assert w0.stats()["restarts"] == 2


def test_crash_with_revive_after_comes_back_loading() -> None:
    """crash with revive_after_s and loading_s: refused, then 503 loading, then ready."""
    spec = FleetSpec((WorkerSpec(engine="llamacpp", **FAST),))
    with run_fleet_in_thread(spec) as fleet:
        w = fleet.workers[0]
        w.set_fault("crash", revive_after_s=0.2, loading_s=0.3)
        assert _refused(w.port)

        async def run() -> None:
            async with session() as s:

                async def loading() -> bool:
                    try:
                        async with s.get(w.url + "/health") as r:
                            return r.status == 503
                    except aiohttp.ClientConnectorError:
                        return False

                await poll(loading)

                async def ready() -> bool:
                    async with s.get(w.url + "/health") as r:
                        return r.status == 200

                await poll(ready)

        asyncio.run(run())


def test_hang_accepts_but_never_answers() -> None:
    """hang: the connection is accepted, no response comes; clearing the fault serves again."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            await _set_fault(s, url, "hang")
            assert not _refused(fleet.workers[0].port)
            with pytest.raises(TimeoutError):
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=0.3)):
                    pass
            await _set_fault(s, url, "none")
            async with s.get(url + "/health") as r:
                assert r.status == 200

    asyncio.run(run())


def test_slow_health_while_still_serving() -> None:
    """slow_health: /health takes delay_s, completions still answer at once."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            await _set_fault(s, url, "slow_health", delay_s=5)
            with pytest.raises(TimeoutError):
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=0.3)):
                    pass
            assert (await complete(s, url, max_tokens=2))[0] == 200

    asyncio.run(run())


def test_error_burst_then_recovery() -> None:
    """error_burst count=3 status=502: three inference requests fail, the fourth succeeds."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            await _set_fault(s, url, "error_burst", count=3, status=502)
            async with s.get(url + "/health") as r:
                assert r.status == 200  # the burst hits inference, not health
            statuses = [(await complete(s, url, max_tokens=1))[0] for _ in range(4)]
            assert statuses == [502, 502, 502, 200]

    asyncio.run(run())


def test_stall_keeps_running_with_a_flat_token_counter() -> None:
    """stall: running > 0, vllm:generation_tokens_total flat, /health still 200; then resumes."""
    spec = FleetSpec((WorkerSpec(decode_ms=5, prefill_ms_per_1k=0),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            task = asyncio.create_task(complete(s, url, max_tokens=100000))

            async def generating() -> bool:
                return value(await scrape(s, url), "vllm:generation_tokens_total") > 3

            await poll(generating)
            await _set_fault(s, url, "stall")
            before = await scrape(s, url)
            await asyncio.sleep(0.3)
            after = await scrape(s, url)
            assert value(after, "vllm:num_requests_running") == 1
            assert value(after, "vllm:generation_tokens_total") == value(before, "vllm:generation_tokens_total")
            async with s.get(url + "/health") as r:
                assert r.status == 200
            await _set_fault(s, url, "none")

            async def moving() -> bool:
                m = await scrape(s, url)
                return value(m, "vllm:generation_tokens_total") > value(after, "vllm:generation_tokens_total")

            await poll(moving)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("mode", "params", "content_type"),
    [
        ("garbage_metrics", {}, "text/plain"),
        ("html_metrics", {}, "text/html"),
        ("truncated_metrics", {"fraction": 0.4}, "text/plain"),
    ],
)
def test_broken_metrics_bodies(mode: str, params: dict[str, object], content_type: str) -> None:
    """garbage/html/truncated metrics: 200 with a body a Prometheus parser rejects."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            await _set_fault(s, url, mode, **params)
            async with s.get(url + "/metrics") as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith(content_type)
                body = await r.text()
            with pytest.raises(ValueError):
                list(text_string_to_metric_families(body))
            await _set_fault(s, url, "none")
            assert "vllm:num_requests_running" in await scrape(s, url)

    asyncio.run(run())


def test_truncated_metrics_abort_drops_the_connection_mid_body() -> None:
    """truncated_metrics how=abort: Content-Length promised, connection closed early."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            await _set_fault(s, url, "truncated_metrics", how="abort")
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.get(url + "/metrics") as r:
                    await r.read()

    asyncio.run(run())


def test_slow_start_503_loading_then_ready() -> None:
    """slow_start: llama.cpp's 503 "Loading model" body, then 200 {"status":"ok"}."""
    spec = FleetSpec((WorkerSpec(engine="llamacpp", initial_fault=FaultSpec("slow_start", {"seconds": 0.4}), **FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            async with s.get(url + "/health") as r:
                assert r.status == 503
                assert await r.json() == {
                    "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}
                }
            assert (await complete(s, url, max_tokens=1))[0] == 503

            async def ready() -> bool:
                async with s.get(url + "/health") as r:
                    return r.status == 200 and await r.json() == {"status": "ok"}

            await poll(ready)

    asyncio.run(run())


def test_slow_start_closed_keeps_the_port_shut_until_loaded() -> None:
    """slow_start closed=true (vLLM listens only once loaded): refused, then 200."""
    spec = FleetSpec((WorkerSpec(**FAST),))
    with run_fleet_in_thread(spec) as fleet:
        w = fleet.workers[0]
        w.set_fault("slow_start", seconds=0.3, closed=True)
        assert _refused(w.port)

        async def run() -> None:
            async with session() as s:

                async def ready() -> bool:
                    try:
                        async with s.get(w.url + "/health") as r:
                            return r.status == 200
                    except aiohttp.ClientConnectorError:
                        return False

                await poll(ready)

        asyncio.run(run())


def test_tgi_health_body_while_loading() -> None:
    """TGI's unhealthy body: 503 {"error":"unhealthy","error_type":"healthcheck"}."""
    spec = FleetSpec((WorkerSpec(engine="tgi", initial_fault=FaultSpec("slow_start", {"seconds": 5}), **FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s, s.get(fleet.urls[0] + "/health") as r:
            assert r.status == 503
            assert await r.json() == {"error": "unhealthy", "error_type": "healthcheck"}

    asyncio.run(run())


def test_queue_full_rejects_with_503() -> None:
    """queue_full: a vLLM-kind worker answers 503 while its queue is at the limit."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            await _set_fault(s, url, "queue_full", max_queue=0)
            assert (await complete(s, url, max_tokens=1))[0] == 503
            await _set_fault(s, url, "queue_full", max_queue=0, status=429)
            assert (await complete(s, url, max_tokens=1))[0] == 429

    asyncio.run(run())


def test_fault_schedule_and_duration() -> None:
    """A scheduled fault switches on by itself and ends after duration_s."""
    burst = FaultSpec("error_burst", {"count": 1000, "status": 500, "duration_s": 0.3})
    spec = FleetSpec((WorkerSpec(fault_schedule=(ScheduledFault(0.1, burst),), **FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]

            async def failing() -> bool:
                return (await complete(s, url, max_tokens=1))[0] == 500

            await poll(failing)

            async def healthy() -> bool:
                return (await complete(s, url, max_tokens=1))[0] == 200

            await poll(healthy)
            async with s.get(url + "/_sim/fault") as r:
                assert (await r.json())["mode"] == "none"

    asyncio.run(run())


def test_bad_fault_requests_are_refused() -> None:
    """Unknown modes and ill-typed parameters: 400, the current fault unchanged."""
    spec = FleetSpec((WorkerSpec(**FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            url = fleet.urls[0]
            for body in ({"mode": "explode"}, {"mode": "error_burst", "count": "many"}, {"nomode": 1}):
                async with s.post(url + "/_sim/fault", json=body) as r:
                    assert r.status == 400
            async with s.get(url + "/_sim/fault") as r:
                assert (await r.json())["mode"] == "none"

    asyncio.run(run())


def test_slow_multiplies_step_time_and_ends_with_the_fault() -> None:
    """slow: every engine step from now on takes `factor` times longer (speed / factor), and
    the worker's own speed comes back when the fault is switched off; factor 0 is refused."""
    spec = FleetSpec((WorkerSpec(name="w0", speed=1.5, **FAST),))

    async def run() -> None:
        async with Fleet(spec) as fleet, session() as s:
            worker = fleet.worker("w0")
            url = worker.url
            step = worker.engines[0].model.decode_step_seconds(1)
            await _set_fault(s, url, "slow", factor=2)
            assert worker.engines[0].model.speed == pytest.approx(0.75)
            assert worker.engines[0].model.decode_step_seconds(1) == pytest.approx(2 * step)
            assert (await complete(s, url, max_tokens=3))[0] == 200
            await _set_fault(s, url, "none")
            assert worker.engines[0].model.speed == pytest.approx(1.5)
            async with s.post(url + "/_sim/fault", json={"mode": "slow", "factor": 0}) as r:
                assert r.status == 400

    asyncio.run(run())
