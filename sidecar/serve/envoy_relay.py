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
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from sidecar.outputs.envoy_admin import admin_session

__all__ = ["BODY_CAP", "add_envoy_relay"]

_SESSION = web.AppKey("envoy_relay_session", aiohttp.ClientSession)
_BASE = web.AppKey("envoy_relay_base", str)
_CAP = web.AppKey("envoy_relay_cap", int)
BODY_CAP = 64 << 20
_CHUNK = 256 << 10


class _TooLarge(Exception):
    pass


async def _whole_body(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """Every byte of `resp`'s body (to its end), or _TooLarge past `cap`."""
    if resp.content_length is not None and resp.content_length > cap:
        raise _TooLarge
    body = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK):
        body += chunk
        if len(body) > cap:
            raise _TooLarge
    return bytes(body)


async def _forward(request: web.Request, path: str) -> web.Response:
    session, cap = request.app[_SESSION], request.app[_CAP]
    try:
        async with session.get(request.app[_BASE] + path) as resp:
            body = await _whole_body(resp, cap)
            kind = resp.headers.get("Content-Type", "text/plain")
            return web.Response(status=resp.status, body=body, headers={"Content-Type": kind})
    except _TooLarge:
        return web.json_response({"error": f"envoy admin answered more than {cap} bytes for {path}"}, status=502)
    except TimeoutError:
        return web.json_response({"error": f"envoy admin did not answer {path} in time"}, status=504)
    except aiohttp.ClientError as exc:
        return web.json_response({"error": f"envoy admin unreachable: {type(exc).__name__}"}, status=503)


async def _ready(request: web.Request) -> web.Response:
    return await _forward(request, "/ready")


async def _stats(request: web.Request) -> web.Response:
    return await _forward(request, "/stats/prometheus")


def add_envoy_relay(app: web.Application, admin_url: str, timeout_s: float = 5.0, body_cap: int = BODY_CAP) -> None:
    """Add the two GET routes to `app`; the client session lives as long as the app. Each relayed
    answer is whole: read within `timeout_s` and at most `body_cap` bytes, else an error answer."""
    app[_CAP] = body_cap

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[_SESSION], app[_BASE] = admin_session(admin_url, aiohttp.ClientTimeout(total=timeout_s))
        yield
        await app[_SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_get("/envoy/ready", _ready)
    app.router.add_get("/envoy/stats", _stats)
