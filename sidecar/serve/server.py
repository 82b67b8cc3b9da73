"""The sidecar's own HTTP server: metrics, probes of the sidecar itself, state, drain calls.

    GET  /           the status page for humans: read-only HTML, no script (sidecar.serve.status_page)
    GET  /metrics    Prometheus text from the registry passed in, without the `_created` series
                     prometheus_client adds to every Counter and Histogram (sidecar.serve.metrics.
                     without_created: per registry, no process-wide switch)
    GET  /healthz    200 while the process serves (liveness)
    GET  /readyz     200 once the first probe cycle is done and the proxy got a whole config;
                     its body also lists `problems` (an update the proxy refused, a write
                     failing, a gRPC service's own as "name: ...") and says when the running
                     config is stale (a reload refused), neither of which makes it 503 (see _readyz)
    GET  /state      JSON: per pool, per endpoint: status, reason, weight, last sample; the
                     picker's figures when it runs (`picker`, and per pool `pools.<p>.picker`)
                     (strict JSON, see finite(): no Infinity or NaN)
    GET  /v1/models  the models with healthy capacity now (the proxies ask for it; sidecar.serve.models)
    POST /drain    {"pool": P, "worker": HOST:PORT}   planned drain (published DRAINING)
    POST /undrain  {"pool": P, "worker": HOST:PORT}   end it
                   (Content-Type: application/json; pool/worker may also be query
                   parameters; no Origin header; a bearer token beyond loopback:
                   sidecar.serve.guard)
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from sidecar.daemon import Daemon
from sidecar.fleet import Snapshot, XdsView
from sidecar.logs import LogBudget
from sidecar.outputs.xds.cache import SHORT
from sidecar.serve.bounds import errors_as_json
from sidecar.serve.guard import GUARD, MAX_BODY, MutationGuard, guarded, json_object
from sidecar.serve.metrics import without_created
from sidecar.serve.models import models_answer
from sidecar.serve.picker_view import picker_status
from sidecar.serve.status_page import HEADERS as PAGE_HEADERS
from sidecar.serve.status_page import render as render_page

__all__ = ["build_app", "finite", "state_json", "strict_json"]

_DAEMON = web.AppKey("daemon", Daemon)
_REGISTRY = web.AppKey("registry", CollectorRegistry)


def _xds_json(view: XdsView) -> dict[str, Any]:
    return {
        "listen": view.listen,
        "versions": dict(view.versions),
        "resources": dict(view.resources),
        "nacks_total": view.nacks_total,
        "transport": view.transport,
        "counted_envoys": view.counted,
        "refused": dict(view.refused),
        "logs_suppressed": view.logs_suppressed,
        "nodes": {
            node.node: {
                "cluster": node.cluster,
                "protocol": node.protocol,
                "streams": node.streams,
                "acked": {SHORT.get(t, t): v for t, v in sorted(node.acked.items())},
                "nacked": {SHORT.get(t, t): {"version": n.version, "error": n.message}
                           for t, n in sorted(node.nacked.items())},
                "nacks": {SHORT.get(t, t): c for t, c in sorted(node.nacks.items())},
            }
            for node in view.nodes
        },
    }


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced, so that it encodes as strict JSON (RFC 8259
    has no Infinity or NaN; JavaScript's JSON.parse refuses them): +inf and -inf become the
    strings "+Inf" and "-Inf" (Prometheus's spelling: a histogram's last bucket bound is "+Inf"),
    NaN becomes null (no value). Tuples become lists; mappings keep their keys."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return value
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def strict_json(body: Any, status: int = 200) -> web.Response:
    """A JSON answer that any strict parser reads (finite(); encoding refuses what slips past)."""
    text = json.dumps(finite(body), allow_nan=False)
    return web.Response(text=text, status=status, content_type="application/json")


def state_json(snap: Snapshot, picker: dict[str, Any] | None = None) -> dict[str, Any]:
    """/state's body (before finite()); `picker` is sidecar.serve.picker_view's status or None."""
    picker_pools = picker["pools"] if picker is not None else {}
    return {
        "xds": _xds_json(snap.xds) if snap.xds is not None else None,
        "topology": snap.topology,
        "cycles": snap.cycles,
        "ready": not snap.not_ready,
        "not_ready": list(snap.not_ready),
        "problems": list(snap.problems),
        "reloads": dict(snap.reloads),
        "last_reload_error": snap.last_reload_error,
        "picker": {k: v for k, v in picker.items() if k != "pools"} if picker is not None else None,
        "pools": {
            pool.name: {
                "engine": pool.engine,
                "saturation": pool.saturation,
                "queue_depth": pool.queue_depth,
                "publishes": pool.publishes,
                "rejections": pool.rejections,
                "rejected": pool.rejected,
                "inflight_limit": pool.inflight_limit,
                "saturated": pool.saturated,
                "saturated_reason": pool.saturated_reason,
                "shedding": pool.shedding,
                "sheddable_share": pool.sheddable_share,
                "picker": picker_pools.get(pool.name),
                "endpoints": [
                    {
                        "worker": ep.key.worker,
                        "address": ep.key.address,
                        "port": ep.key.port,
                        "status": ep.status,
                        "reason": ep.reason,
                        "weight": ep.weight,
                        "sample": dataclasses.asdict(ep.sample) if ep.sample is not None else None,
                        "probe_latency_s": ep.probe_latency_s,
                        "last_outcome": ep.last_outcome,
                        "last_error": ep.last_error,
                        "errors": dict(ep.errors),
                    }
                    for ep in pool.endpoints
                ],
            }
            for pool in snap.pools
        },
    }


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(without_created(request.app[_REGISTRY]))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def _readyz(request: web.Request) -> web.Response:
    """Ready or not, and why; `stale` says why the running config is older than the topology.

    Neither a stale config nor a refused update, a failing write or a service's problem
    (`problems`) makes the sidecar unready: every replica reads the same topology and writes
    the same content, so failing readiness would take them all out of service at once, while
    each proxy goes on serving its last good config. They show in the body, /state and the metrics (alerts).
    """
    daemon = request.app[_DAEMON]
    reasons = daemon.not_ready()
    body = {"ready": not reasons, "not_ready": reasons, "problems": daemon.problems(), "stale": daemon.stale()}
    return strict_json(body, status=503 if reasons else 200)


async def _state(request: web.Request) -> web.Response:
    return strict_json(state_json(request.app[_DAEMON].view(), picker_status(request.app[_REGISTRY])))


async def _page(request: web.Request) -> web.Response:
    daemon = request.app[_DAEMON]
    text = render_page(daemon.view(), picker_status(request.app[_REGISTRY]), daemon.topology)
    return web.Response(text=text, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS)


async def _set_drain(request: web.Request, drained: bool) -> web.Response:
    body = await json_object(request)
    if isinstance(body, web.Response):
        return body
    pool = body.get("pool", request.query.get("pool", ""))
    worker = body.get("worker", request.query.get("worker", ""))
    daemon = request.app[_DAEMON]
    if not isinstance(pool, str) or not isinstance(worker, str) or not pool or not worker:
        return web.json_response({"error": "pool and worker are required (JSON body or query parameters)"},
                                 status=400)
    if not drained and daemon.drained_by_topology(pool, worker):
        # it would stay DRAINING: say so rather than answer "drained": false
        return web.json_response({"error": f"the topology drains {worker!r} in pool {pool!r} (drain: true): "
                                           "remove that there to undrain it"}, status=409)
    if not daemon.set_drain(pool, worker, drained):
        return web.json_response({"error": f"no worker {worker!r} in pool {pool!r}"}, status=404)
    await daemon.republish()
    return web.json_response({"pool": pool, "worker": worker, "drained": drained})


async def _drain(request: web.Request) -> web.Response:
    return await _set_drain(request, True)


async def _undrain(request: web.Request) -> web.Response:
    return await _set_drain(request, False)


async def _models(request: web.Request) -> web.Response:
    daemon = request.app[_DAEMON]
    return web.Response(text=models_answer(daemon.topology, daemon.view()), content_type="application/json")


def build_app(daemon: Daemon, registry: CollectorRegistry, *, guard: MutationGuard,
              clock: Callable[[], float] = time.monotonic) -> web.Application:
    """The sidecar's routes; `guard` decides who may POST (sidecar.serve.guard); every error answered as JSON
    (sidecar.serve.bounds)."""
    app = web.Application(client_max_size=MAX_BODY, middlewares=[errors_as_json(LogBudget(clock))])
    app[_DAEMON] = daemon
    app[_REGISTRY] = registry
    app[GUARD] = guard
    app.router.add_get("/", _page)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/state", _state)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/drain", guarded(_drain))
    app.router.add_post("/undrain", guarded(_undrain))
    return app
