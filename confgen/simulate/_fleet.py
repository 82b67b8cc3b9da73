"""A fleet of simulated workers in one event loop, its control channel, and a thread runner.

The control channel is a separate port: a crashed worker's own admin endpoint is gone
with its socket, so reviving it has to go through something that is still listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

from aiohttp import web

from ._server import SimWorker
from ._spec import FaultSpec, FleetSpec, SpecError

__all__ = ["Fleet", "FleetHandle", "WorkerHandle", "run_fleet_in_thread"]

_T = TypeVar("_T")
_THREAD_CALL_TIMEOUT_S = 30.0


class Fleet:
    """All workers of a FleetSpec plus the control channel, on the running event loop."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.workers = [SimWorker(w, seed=spec.seed) for w in spec.named_workers()]
        self._by_name = {w.name: w for w in self.workers}
        self._control: web.AppRunner | None = None
        self.control_port = spec.control_port

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def control_url(self) -> str:
        return f"http://{self.spec.control_host}:{self.control_port}"

    def worker(self, name: str) -> SimWorker:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no worker named {name!r}; have {sorted(self._by_name)}") from None

    async def start(self) -> None:
        """Bind every worker's port and the control port; undo all of it if one fails."""
        started: list[SimWorker] = []
        try:
            for worker in self.workers:
                await worker.start()
                started.append(worker)
            await self._start_control()
        except BaseException:
            for worker in started:
                await worker.stop()
            raise

    async def stop(self) -> None:
        if self._control is not None:
            await self._control.cleanup()
            self._control = None
        await asyncio.gather(*(w.stop() for w in self.workers))

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- control channel ----------------------------------------------------------------

    async def _start_control(self) -> None:
        app = web.Application()
        app.router.add_get("/_fleet/workers", self._list)
        app.router.add_get("/_fleet/workers/{name}/stats", self._stats)
        app.router.add_post("/_fleet/workers/{name}/fault", self._fault)
        app.router.add_post("/_fleet/workers/{name}/crash", self._crash)
        app.router.add_post("/_fleet/workers/{name}/revive", self._revive)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.05)
        await runner.setup()
        site = web.TCPSite(runner, self.spec.control_host, self.control_port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self.control_port = int(runner.addresses[0][1])
        self._control = runner

    def _named(self, request: web.Request) -> SimWorker:
        try:
            return self.worker(request.match_info["name"])
        except KeyError as exc:
            raise web.HTTPNotFound(text=str(exc)) from exc

    async def _list(self, request: web.Request) -> web.Response:
        listing = [
            {"name": w.name, "engine": w.spec.engine, "url": w.url, "up": w.up,
             "fault": w.stats()["fault"]}
            for w in self.workers
        ]  # fmt: skip
        return web.json_response(listing)

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self._named(request).stats())

    async def _fault(self, request: web.Request) -> web.Response:
        worker = self._named(request)
        try:
            fault = FaultSpec.from_mapping(await request.json())
            await worker.set_fault(fault)
        except (ValueError, SpecError) as exc:  # JSONDecodeError is a ValueError
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(worker.stats())

    async def _crash(self, request: web.Request) -> web.Response:
        worker = self._named(request)
        await worker.crash()
        return web.json_response(worker.stats())

    async def _revive(self, request: web.Request) -> web.Response:
        worker = self._named(request)
        loading_s = 0.0
        if request.can_read_body:
            try:
                body = await request.json()
                loading_s = float(body.get("loading_s", 0.0)) if isinstance(body, dict) else 0.0
            except (ValueError, TypeError) as exc:
                return web.json_response({"error": str(exc)}, status=400)
        await worker.revive(loading_s)
        return web.json_response(worker.stats())


@dataclass(frozen=True)
class WorkerHandle:
    """Thread-safe view of one worker of a fleet running in a background thread."""

    name: str
    url: str
    port: int
    _worker: SimWorker
    _call: Callable[[Callable[[], Coroutine[Any, Any, Any]]], Any]

    def set_fault(self, mode: str, **params: Any) -> None:
        fault = FaultSpec.from_mapping({"mode": mode, **params})
        self._call(lambda: self._worker.set_fault(fault))

    def crash(self) -> None:
        self._call(self._worker.crash)

    def revive(self, loading_s: float = 0.0) -> None:
        self._call(lambda: self._worker.revive(loading_s))

    def stats(self) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            return self._worker.stats()

        result: dict[str, Any] = self._call(read)
        return result


@dataclass(frozen=True)
class FleetHandle:
    """What `run_fleet_in_thread` yields: urls, worker handles, the control channel."""

    fleet: Fleet
    workers: tuple[WorkerHandle, ...]
    control_url: str
    loop: asyncio.AbstractEventLoop

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def worker(self, name: str) -> WorkerHandle:
        for handle in self.workers:
            if handle.name == name:
                return handle
        raise KeyError(f"no worker named {name!r}")

    def call(self, make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Run a coroutine on the fleet's loop and wait for its result (bounded)."""
        return _run_on(self.loop, make)


def _run_on(loop: asyncio.AbstractEventLoop, make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    async def wrapped() -> _T:
        return await make()

    future = asyncio.run_coroutine_threadsafe(wrapped(), loop)
    return future.result(timeout=_THREAD_CALL_TIMEOUT_S)


@contextlib.contextmanager
def run_fleet_in_thread(spec: FleetSpec) -> Iterator[FleetHandle]:
    """Run a fleet on its own event loop in a daemon thread, for sync tests and benchmarks.

    The ports are bound when this yields; leaving the block stops the fleet and the thread.
    """
    loop = asyncio.new_event_loop()
    fleet = Fleet(spec)
    started = threading.Event()
    failure: list[BaseException] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def boot() -> None:
            await fleet.start()

        try:
            loop.run_until_complete(boot())
        except BaseException as exc:  # noqa: BLE001 - handed over, raised in the caller's thread
            failure.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="sim-fleet", daemon=True)
    thread.start()
    if not started.wait(timeout=_THREAD_CALL_TIMEOUT_S):
        raise TimeoutError("the simulated fleet did not start in time")
    if failure:
        thread.join(timeout=_THREAD_CALL_TIMEOUT_S)
        loop.close()
        raise failure[0]

    def call(make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        return _run_on(loop, make)

    handles = tuple(WorkerHandle(w.name, w.url, w.port, w, call) for w in fleet.workers)
    try:
        yield FleetHandle(fleet, handles, fleet.control_url, loop)
    finally:
        try:
            _run_on(loop, fleet.stop)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=_THREAD_CALL_TIMEOUT_S)
            if not thread.is_alive():
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()
