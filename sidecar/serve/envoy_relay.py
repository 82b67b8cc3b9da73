"""Read-only views of Envoy's admin interface on the sidecar's port: `GET /envoy/ready` and
`GET /envoy/stats` (Prometheus text).

Envoy's admin interface stays on the pod's loopback (it can also stop Envoy, change runtime
values and drain listeners); the kubelet's readiness probe and Prometheus reach the sidecar's
port instead, and these two handlers forward only those two GETs. `/envoy/ready` answers 503
when Envoy cannot be asked, so an Envoy that is down is not ready.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

__all__ = ["add_envoy_relay"]

_SESSION = web.AppKey("envoy_relay_session", aiohttp.ClientSession)
_BASE = web.AppKey("envoy_relay_base", str)
_BODY_CAP = 64 << 20  # Envoy's stats for thousands of clusters stay well under this


async def _forward(request: web.Request, path: str) -> web.Response:
    session = request.app[_SESSION]
    try:
        async with session.get(request.app[_BASE] + path) as resp:
            body = await resp.content.read(_BODY_CAP)
            kind = resp.headers.get("Content-Type", "text/plain")
            return web.Response(status=resp.status, body=body, headers={"Content-Type": kind})
    except (aiohttp.ClientError, TimeoutError) as exc:
        return web.Response(status=503, text=f"envoy admin unreachable: {type(exc).__name__}\n")


async def _ready(request: web.Request) -> web.Response:
    return await _forward(request, "/ready")


async def _stats(request: web.Request) -> web.Response:
    return await _forward(request, "/stats/prometheus")


def add_envoy_relay(app: web.Application, admin_url: str, timeout_s: float = 5.0) -> None:
    """Add the two GET routes to `app`; the client session lives as long as the app."""
    app[_BASE] = admin_url.rstrip("/")

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[_SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        yield
        await app[_SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_get("/envoy/ready", _ready)
    app.router.add_get("/envoy/stats", _stats)
