"""EdsPublisher's write discipline (sidecar.outputs.files.publisher): debounce, no-op skips, and never an
empty endpoint list. Envoy's admin is a closed loopback port here (stats unanswered, as
when Envoy is down), so only the file side is under test; the live tests confirm writes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from confgen.endpoints import Endpoint
from confgen.envoy import layout, parse_eds, render_eds
from confgen.runtime import free_port
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.files.publisher import EdsPublisher, read_published

POOL = "chat"


def eps(*weights: int) -> list[Endpoint]:
    return [Endpoint("10.0.0.1", 8000 + i, weight=w, worker=f"10.0.0.1:{8000 + i}") for i, w in enumerate(weights)]


async def wait_for(predicate: Callable[[], bool]) -> float:
    """Poll `predicate` every 10 ms for at most 10 s; the loop time when it held."""
    loop = asyncio.get_running_loop()
    for _ in range(1000):
        if predicate():
            return loop.time()
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 10 s")


async def with_publisher(tmp: Path, debounce_s: float, body: Callable[[EdsPublisher], Awaitable[None]]) -> None:
    async with EnvoyAdmin(f"http://127.0.0.1:{free_port()}", timeout_s=0.5) as admin:
        publisher = EdsPublisher(tmp, admin, debounce_s=debounce_s, confirm_timeout_s=0.0)
        try:
            await body(publisher)
        finally:
            await publisher.close()


def on_disk(tmp: Path) -> bytes:
    return (tmp / layout.eds_path(POOL)).read_bytes()


def test_writes_are_debounced_and_the_newest_content_wins(tmp_path: Path) -> None:
    """The first offer is written at once; offers within the debounce collapse into one
    write of the newest endpoints, no sooner than debounce_s after the previous write."""
    debounce = 0.3

    async def body(publisher: EdsPublisher) -> None:
        offered = time.monotonic()  # no later than the first write: a bound that holds under any load
        publisher.offer(POOL, eps(5))
        await wait_for(lambda: publisher.publishes[POOL] == 1)
        for w in (6, 7, 8):
            publisher.offer(POOL, eps(w))
        second = await wait_for(lambda: publisher.publishes[POOL] == 2)
        assert second - offered >= debounce - 0.02  # without the debounce it comes at once
        assert on_disk(tmp_path) == render_eds(POOL, eps(8))
        await publisher.close(grace_s=10.0)  # the flusher has returned: no write is still to come
        assert publisher.publishes[POOL] == 2  # 6 and 7 were never written

    asyncio.run(with_publisher(tmp_path, debounce, body))


def test_an_offer_made_as_the_flusher_returns_is_written(tmp_path: Path) -> None:
    """The window that made the test above fail 1 run in ~5: the pool's flusher has returned
    but its done callback (which unlists it) has not run yet. An offer made then used to find
    the flusher listed, start none, and wait for the next offer; it is written now. The
    window is reached deterministically: one loop iteration at a time until the task is done."""

    async def body(publisher: EdsPublisher) -> None:
        publisher.offer(POOL, eps(5))
        flusher = publisher._flushers[POOL]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        for _ in range(10_000_000):  # one iteration at a time: the done callback is still queued when done()
            if flusher.done() or loop.time() > deadline:
                break
            await asyncio.sleep(0)
        assert flusher.done() and publisher._flushers.get(POOL) is flusher  # inside the window
        assert publisher.publishes[POOL] == 1
        publisher.offer(POOL, eps(6))
        await wait_for(lambda: publisher.publishes[POOL] == 2)
        assert on_disk(tmp_path) == render_eds(POOL, eps(6))

    asyncio.run(with_publisher(tmp_path, 0.0, body))


def test_unchanged_endpoints_are_not_rewritten(tmp_path: Path) -> None:
    """Offering what is on disk writes nothing (a rename would wake Envoy's watch), also
    after a restart that adopted the file."""

    async def body(publisher: EdsPublisher) -> None:
        publisher.offer(POOL, eps(5, 3))
        await wait_for(lambda: publisher.publishes[POOL] == 1)
        inode = (tmp_path / layout.eds_path(POOL)).stat().st_ino
        publisher.offer(POOL, list(reversed(eps(5, 3))))  # same set, other order
        await publisher.close(grace_s=10.0)  # any write the offer started has finished
        assert publisher.publishes[POOL] == 1
        assert (tmp_path / layout.eds_path(POOL)).stat().st_ino == inode

    asyncio.run(with_publisher(tmp_path, 0.0, body))

    async def restarted(publisher: EdsPublisher) -> None:
        found = read_published(tmp_path, POOL)
        assert found is not None and found[1] == sorted(eps(5, 3))
        assert publisher.adopt(POOL) == found[1]
        publisher.offer(POOL, eps(5, 3))
        await publisher.close(grace_s=10.0)  # any write the offer started has finished
        assert publisher.publishes[POOL] == 0

    asyncio.run(with_publisher(tmp_path, 0.0, restarted))


def test_an_empty_endpoint_list_is_never_published(tmp_path: Path) -> None:
    """`endpoints: []` would make Envoy drop every host: an empty offer keeps the file as
    it is (and writes nothing when there is none yet)."""

    async def body(publisher: EdsPublisher) -> None:
        publisher.offer(POOL, [])
        await asyncio.sleep(0.05)
        assert not (tmp_path / layout.eds_path(POOL)).exists()
        publisher.offer(POOL, eps(4))
        await wait_for(lambda: publisher.publishes[POOL] == 1)
        publisher.offer(POOL, [])
        await asyncio.sleep(0.05)
        assert publisher.publishes[POOL] == 1
        _, kept = parse_eds(on_disk(tmp_path))
        assert kept == eps(4)
        assert json.loads(on_disk(tmp_path))["resources"][0]["endpoints"]

    asyncio.run(with_publisher(tmp_path, 0.0, body))
