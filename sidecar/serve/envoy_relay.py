"""Read-only views of Envoy's admin interface on the sidecar's port: `GET /envoy/ready` and
`GET /envoy/stats` (Prometheus text).

Envoy's admin interface stays on the pod's loopback (it can also stop Envoy, change runtime
values and drain listeners); the kubelet's readiness probe and Prometheus reach the sidecar's
port instead, and these two handlers forward only those two GETs. `/envoy/ready` answers 503
when Envoy cannot be asked, so an Envoy that is down is not ready.

Each answer is Envoy's whole body or an error, never a part of it: the body is read to its
end within `timeout_s` (from the request's start) and at most `body_cap` bytes; past either
bound the relay answers 502/504 JSON `{"error": ...}` (Prometheus marks the scrape failed)
rather than a 200 whose text stops mid-line. Envoy's stats for 300 clusters are ~4 MB
(measured with Envoy 1.3x, tests/sidecar_live/test_envoy_relay_live.py); the default cap
leaves room for thousands.

Bounded for whoever asks (the port is unauthenticated): requests for one path that arrive while
its fetch is under way share that fetch (Envoy's admin thread dumps its stats once, and one copy
of the body is held); at most `max_relays` answers are being sent at once (beyond: 503 with
`retry-after`), and one the client does not take within `timeout_s` is cut (its connection
closed). A client that asks and never reads holds one slot for `timeout_s`, not the body for as
long as it keeps its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from sidecar.outputs.envoy_admin import BodyTooLarge, admin_session, whole_body

__all__ = ["BODY_CAP", "add_envoy_relay"]

BODY_CAP = 64 << 20
MAX_RELAYS = 4  # answers being sent at once (Prometheus HA pairs scrape twice; the kubelet's probe)

_Answer = tuple[int, str, bytes]  # status, content type, body


class _Relay:
    """One session to Envoy's admin, the fetches under way (one per path, shared) and the answers
    being sent (at most `max_relays`)."""

    def __init__(self, admin_url: str, timeout_s: float, cap: int, max_relays: int) -> None:
        self.admin_url, self.timeout_s, self.cap, self.max_relays = admin_url, timeout_s, cap, max_relays
        self.session: aiohttp.ClientSession | None = None
        self.base = ""
        self.sending = 0
        self._flights: dict[str, asyncio.Future[_Answer]] = {}

    async def fetch(self, path: str) -> _Answer:
        """Envoy's answer for `path`, or an error answer; joined to the fetch under way, if any."""
        flight = self._flights.get(path)
        if flight is None:
            flight = self._flights[path] = asyncio.ensure_future(self._fetch(path))
            flight.add_done_callback(lambda _: self._flights.pop(path, None))
        return await asyncio.shield(flight)  # one asker going away does not cancel the others' fetch

    async def _fetch(self, path: str) -> _Answer:
        assert self.session is not None
        try:
            async with self.session.get(self.base + path) as resp:
                body = await whole_body(resp, self.cap)
                return resp.status, resp.headers.get("Content-Type", "text/plain"), body
        except BodyTooLarge:
            return _error(502, f"envoy admin answered more than {self.cap} bytes for {path}")
        except TimeoutError:
            return _error(504, f"envoy admin did not answer {path} in time")
        except aiohttp.ClientError as exc:
            return _error(503, f"envoy admin unreachable: {type(exc).__name__}")


_RELAY = web.AppKey("envoy_relay", _Relay)


def _error(status: int, message: str) -> _Answer:
    return status, "application/json", json.dumps({"error": message}).encode()


async def _forward(request: web.Request, path: str, capped: bool = True) -> web.StreamResponse:
    """Envoy's answer for `path`, sent within the deadline; `capped`: one of `max_relays` (the stats:
    megabytes each), else not counted (readiness: a few bytes, which a busy relay must not fail)."""
    relay = request.app[_RELAY]
    if not capped:
        return await _send(request, relay, await relay.fetch(path))
    if relay.sending >= relay.max_relays:
        return web.json_response({"error": f"{relay.max_relays} relays of envoy admin under way; retry"},
                                 status=503, headers={"Retry-After": "1"})
    relay.sending += 1
    try:
        return await _send(request, relay, await relay.fetch(path))
    finally:
        relay.sending -= 1


async def _send(request: web.Request, relay: _Relay, answer: _Answer) -> web.StreamResponse:
    status, kind, body = answer
    resp = web.StreamResponse(status=status, headers={"Content-Type": kind})
    resp.content_length = len(body)
    try:
        async with asyncio.timeout(relay.timeout_s):
            await resp.prepare(request)
            await resp.write(body)
            await resp.write_eof()
    except TimeoutError:  # the client does not take it: cut, not held
        if request.transport is not None:
            request.transport.abort()
    except ConnectionResetError:  # the client went away mid-answer (aiohttp's ClientConnectionResetError)
        pass
    return resp


async def _ready(request: web.Request) -> web.StreamResponse:
    return await _forward(request, "/ready", capped=False)


async def _stats(request: web.Request) -> web.StreamResponse:
    return await _forward(request, "/stats/prometheus")


def add_envoy_relay(app: web.Application, admin_url: str, timeout_s: float = 5.0, body_cap: int = BODY_CAP,
                    max_relays: int = MAX_RELAYS) -> None:
    """Add the two GET routes to `app`; the client session lives as long as the app. Each relayed
    answer is whole: read within `timeout_s` and at most `body_cap` bytes, else an error answer; sent
    within `timeout_s`, else cut; at most `max_relays` sent at once, else 503."""
    relay = app[_RELAY] = _Relay(admin_url, timeout_s, body_cap, max_relays)

    async def session(app: web.Application) -> AsyncIterator[None]:
        relay.session, relay.base = admin_session(admin_url, aiohttp.ClientTimeout(total=timeout_s))
        yield
        await relay.session.close()
        for flight in list(relay._flights.values()):
            flight.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flight

    app.cleanup_ctx.append(session)
    app.router.add_get("/envoy/ready", _ready)
    app.router.add_get("/envoy/stats", _stats)
