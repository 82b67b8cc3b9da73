"""One simulated engine server: the aiohttp app, its port, its engines and its faults.

The engines are pure (`_engine`); this module feeds them arrivals stamped with the event
loop's clock, arms one timer per worker for the next step end (no per-token loop, nothing
runs while a worker is idle) and turns the engine's progress into HTTP responses.

An answer is `max_tokens` tokens long (finish reason "length"), or, without `max_tokens`, a length the
prompt seeds (finish reason "stop"). A client may say how long its answer is with the header
`x-sim-answer-tokens: N` (a positive integer): an answer shorter than `max_tokens` then stops there on
its own (finish reason "stop"), as a model's does at its end-of-sequence token, so `max_tokens` is only
the bound (benchmarks of clients that send a generous bound).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from ._engine import BLOCK_TOKENS, BatchEngine, CacheKey, EngineRequest, Histogram, LatencyModel
from ._faults import FaultState, garbage_metrics, html_metrics, truncate_metrics, validate
from ._metrics_text import HTTP_HIGHR_BUCKETS, MetricsInput, histogram_bounds, render
from ._spec import FaultSpec, SpecError, WorkerSpec

__all__ = ["SimWorker"]

_CHARS_PER_TOKEN = 4
_MESSAGE_OVERHEAD_TOKENS = 3
_SGLANG_HEALTH_TIMEOUT_S = 20.0
# How long closing a port lets in-flight handlers run: a crash is abrupt, and so is stop
# (a simulator owes its clients nothing).
_SHUTDOWN_GRACE_S = 0.05
_METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WORDS = (
    "the", "model", "server", "token", "batch", "cache", "prefix", "queue", "stream", "fleet",
    "route", "proxy", "weight", "health", "signal", "load", "fast", "slow", "prompt", "reply",
    "graph", "vector", "kernel", "tensor", "layer", "head", "block", "page", "shard", "rank",
    "node", "edge", "and", "of", "to", "in", "is", "a", "on", "for",
)  # fmt: skip
_INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(eq=False)
class _Pending:
    """A request in an engine plus what its HTTP handler waits on."""

    request: EngineRequest
    engine: BatchEngine
    words: list[str]
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class SimWorker:
    """A simulated engine server on one port, driven by the running event loop."""

    def __init__(self, spec: WorkerSpec, *, seed: int = 0) -> None:
        if spec.name is None:
            raise SpecError("SimWorker needs a named WorkerSpec (FleetSpec.named_workers)")
        self.spec = spec
        self.name: str = spec.name
        self.seed = seed
        self.port: int = spec.port
        self.up = False
        self.restarts = 0
        self.engines: list[BatchEngine] = []
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        self._fault = FaultState.start(FaultSpec("none"), 0.0)
        self._fault_changed = asyncio.Event()
        self._fault_timer: asyncio.TimerHandle | None = None
        self._schedule_timers: list[asyncio.TimerHandle] = []
        self._pending: dict[str, _Pending] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._next_id = 0
        self._started_unix = 0.0
        self._lock = asyncio.Lock()
        self._last_headers: dict[str, str] | None = None
        self._last_inference_headers: dict[str, str] | None = None
        self._reset_stats()

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind the port (learning it when 0), then apply the initial fault and schedule."""
        self._loop = asyncio.get_running_loop()
        self._fault_changed = asyncio.Event()
        self._fresh_engines()
        await self._open()
        start = self._loop.time()
        if self.spec.initial_fault is not None:
            await self.set_fault(self.spec.initial_fault)
        for item in self.spec.fault_schedule:
            handle = self._loop.call_at(start + item.at_s, self._spawn_call, lambda f=item.fault: self.set_fault(f))
            self._schedule_timers.append(handle)

    async def stop(self) -> None:
        """Close the port and drop everything in flight."""
        for handle in self._schedule_timers:
            handle.cancel()
        self._schedule_timers.clear()
        self._cancel_fault_timer()
        await self._close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def crash(self) -> None:
        """The process died: the listening socket and every connection close."""
        await self.set_fault(FaultSpec("crash"))

    async def revive(self, loading_s: float = 0.0) -> None:
        """Restart a crashed worker on the same port with fresh engines (counters at 0)."""
        fault = FaultSpec("slow_start", {"seconds": loading_s}) if loading_s > 0 else None
        await self.set_fault(fault or FaultSpec("none"))

    async def set_fault(self, fault: FaultSpec) -> None:
        """Switch fault mode (the previous one ends). Serialised: crash/revive await I/O."""
        validate(fault)
        async with self._lock:
            await self._apply_fault(fault)

    # -- faults -----------------------------------------------------------------------------

    async def _apply_fault(self, fault: FaultSpec) -> None:
        loop = self._require_loop()
        now = loop.time()
        previous = self._fault
        self._cancel_fault_timer()
        if previous.mode == "stall" and fault.mode != "stall":
            for engine in self.engines:
                engine.resume(now)
            self._kick()
        self._fault = FaultState.start(fault, now)
        self._fault_changed.set()
        self._fault_changed = asyncio.Event()
        closed_start = fault.mode == "slow_start" and bool(fault.params.get("closed", False))
        if fault.mode == "crash" or closed_start:
            if self.up:
                await self._close()
        elif not self.up:
            self.restarts += 1
            self._fresh_engines()
            await self._open()
        if fault.mode == "stall":
            for engine in self.engines:
                engine.stall(now)
        self._set_speed(self.spec.speed / float(fault.params.get("factor", 2.0)) if fault.mode == "slow"
                        else self.spec.speed)
        expires = self._fault.expires_at()
        if fault.mode == "crash" and "revive_after_s" in fault.params:
            expires = now + float(fault.params["revive_after_s"])
            loading = float(fault.params.get("loading_s", 0.0))
            after = FaultSpec("slow_start", {"seconds": loading}) if loading else FaultSpec("none")
        else:
            after = FaultSpec("none")
        if expires is not None:
            self._fault_timer = loop.call_at(expires, self._spawn_call, lambda: self.set_fault(after))

    def _set_speed(self, speed: float) -> None:
        """Steps that start from now on run at `speed` (the step in progress keeps its end)."""
        for engine in self.engines:
            if engine.model.speed != speed:
                engine.model = replace(engine.model, speed=speed)

    def _cancel_fault_timer(self) -> None:
        if self._fault_timer is not None:
            self._fault_timer.cancel()
            self._fault_timer = None

    # -- sockets ----------------------------------------------------------------------------

    async def _open(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        app.on_response_prepare.append(self._tag_response)
        app.router.add_post("/_sim/fault", self._admin_fault)
        app.router.add_get("/_sim/fault", self._admin_get_fault)
        app.router.add_get("/_sim/stats", self._admin_stats)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        if self.spec.engine != "openai":
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/health", self._health)
        if self.spec.engine == "sglang":
            app.router.add_get("/health_generate", self._health)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=_SHUTDOWN_GRACE_S)
        await runner.setup()
        site = web.TCPSite(runner, self.spec.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self.port = int(runner.addresses[0][1])
        self._runner = runner
        self._started_unix = time.time()
        self.up = True

    async def _close(self) -> None:
        runner, self._runner = self._runner, None
        self.up = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if runner is not None:
            await runner.cleanup()
        for pending in self._pending.values():
            pending.request.aborted = True
            pending.changed.set()
        self._pending.clear()

    def _fresh_engines(self) -> None:
        spec = self.spec
        model = LatencyModel(
            max_num_seqs=spec.max_num_seqs,
            speed=spec.speed,
            prefill_ms_per_1k=spec.prefill_ms_per_1k,
            decode_ms=spec.decode_ms,
            decode_growth=spec.decode_growth,
            kv_cache_tokens=spec.kv_cache_tokens,
        )
        bounds = histogram_bounds(spec.engine)
        self.engines = [
            BatchEngine(model, prefix_cache_size=spec.prefix_cache_size,
                        prefix_cache_blocks=spec.prefix_cache_mode == "blocks", histogram_bounds=bounds)
            for _ in range(spec.data_parallel)
        ]
        self._http_durations = Histogram(HTTP_HIGHR_BUCKETS)

    # -- the step timer ---------------------------------------------------------------------

    def _kick(self, now: float | None = None) -> None:
        """Advance every engine to now, wake the handlers whose requests moved, re-arm."""
        loop = self._require_loop()
        now = loop.time() if now is None else now
        for engine in self.engines:
            for request in engine.advance(now):
                pending = self._pending.get(request.request_id)
                if pending is not None:
                    pending.changed.set()
        due = [t for e in self.engines if (t := e.next_event_time()) is not None]
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if due and self.up:
            self._timer_due = min(due)
            self._timer = loop.call_at(self._timer_due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        loop = self._require_loop()
        # call_at may fire a clock-resolution early; never advance less than promised.
        self._kick(max(loop.time(), self._timer_due))

    # -- middleware: stats and the faults that act on every path ----------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path.startswith("/_sim/"):
            return await handler(request)
        started = time.monotonic()
        self._received += 1
        self._in_flight += 1
        headers = _header_dict(request)
        self._last_headers = headers
        if "authorization" in (k.lower() for k in headers):
            self._authorization_seen += 1
        status = 500
        try:
            while self._fault.mode == "hang":
                await self._fault_changed.wait()
            if self._fault.mode == "slow_start":
                status = 503
                return self._loading_response()
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self._in_flight -= 1
            self._by_status[str(status)] += 1
            route = request.match_info.route.resource
            handler_name = route.canonical if route is not None else "none"
            self._http_requests[(handler_name, request.method, f"{status // 100}xx")] += 1
            self._http_durations.observe(time.monotonic() - started)

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-sim-worker"] = self.name

    def _loading_response(self) -> web.Response:
        kind = self.spec.engine
        if kind == "llamacpp":
            body: dict[str, Any] = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        elif kind == "tgi":
            body = {"error": "unhealthy", "error_type": "healthcheck"}
        else:
            body = _openai_error("Loading model", "ServiceUnavailableError", 503)
        return web.json_response(body, status=503)

    # -- admin ----------------------------------------------------------------------------

    async def _admin_fault(self, request: web.Request) -> web.Response:
        try:
            data = await request.json()
            fault = validate(FaultSpec.from_mapping(data))
        except (json.JSONDecodeError, SpecError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        if fault.mode == "crash" or (fault.mode == "slow_start" and fault.params.get("closed")):
            # Answer first; the socket closes right after (a handler cannot await its own
            # server's shutdown).
            self._spawn(self._after_response(fault))
        else:
            await self.set_fault(fault)
        return web.json_response({"worker": self.name, "fault": fault.to_json()})

    async def _after_response(self, fault: FaultSpec) -> None:
        await asyncio.sleep(0.01)
        await self.set_fault(fault)

    async def _admin_get_fault(self, request: web.Request) -> web.Response:
        return web.json_response(self._fault.to_json())

    async def _admin_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    def stats(self) -> dict[str, Any]:
        """Counters a test or benchmark reads (engine figures are since the last start)."""
        counters = [e.counters for e in self.engines]
        return {
            "name": self.name,
            "engine": self.spec.engine,
            "url": self.url,
            "port": self.port,
            "up": self.up,
            "restarts": self.restarts,
            "fault": self._fault.to_json(),
            "received": self._received,
            "inference_received": self._inference_received,
            "completed": self._completed,
            "rejected": dict(self._failures),
            "in_flight": self._in_flight,
            "by_status": dict(self._by_status),
            "running": sum(len(e.running) for e in self.engines),
            "waiting": sum(len(e.waiting) for e in self.engines),
            "prompt_tokens": sum(c.prompt_tokens for c in counters),
            "generation_tokens": sum(c.generation_tokens for c in counters),
            "prefix_cache": {
                "lookups": sum(c.prefix_lookups for c in counters),
                "hits": sum(c.prefix_hit_requests for c in counters),
                "query_tokens": sum(c.prefix_queries_tokens for c in counters),
                "hit_tokens": sum(c.prefix_hits_tokens for c in counters),
            },
            # seconds summed over the requests the engines finished (arrival at the engine to the end,
            # to admission, to the first token, admission to the end) and their count
            "latency_s": {name: {"sum": sum(e.histograms[name].total for e in self.engines if name in e.histograms),
                                 "count": sum(e.histograms[name].count for e in self.engines if name in e.histograms)}
                          for name in ("e2e", "queue", "ttft", "inference")},
            "last_headers": self._last_headers,
            "last_inference_headers": self._last_inference_headers,
            "authorization_seen": self._authorization_seen,
        }

    def _reset_stats(self) -> None:
        self._received = 0
        self._inference_received = 0
        self._completed = 0
        self._in_flight = 0
        self._by_status: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._http_requests: Counter[tuple[str, str, str]] = Counter()
        self._http_durations = Histogram(HTTP_HIGHR_BUCKETS)
        self._last_headers = None
        self._last_inference_headers = None
        self._authorization_seen = 0

    # -- plain endpoints ----------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        owner = {"vllm": "vllm", "vllm_v0": "vllm", "sglang": "sglang"}.get(self.spec.engine, "sim")
        data = [
            {
                "id": m,
                "object": "model",
                "created": int(self._started_unix),
                "owned_by": owner,
                "root": m,
                "parent": None,
                "max_model_len": self.spec.kv_cache_tokens,
            }
            for m in self.spec.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        if self._fault.mode == "slow_health":
            await asyncio.sleep(float(self._fault.param("delay_s", 10.0)))
        kind = self.spec.engine
        if kind == "sglang":
            return await self._sglang_health()
        if kind == "llamacpp":
            return web.json_response({"status": "ok"})
        return web.Response(status=200)

    async def _sglang_health(self) -> web.Response:
        """SGLang's health runs a one-token generation: a stalled engine fails it. Like the real handler it
        looks for the answer only after `sglang_health_poll_s` (1 s), so a healthy answer takes that long."""
        pending = self._submit(prompt_text="health", prompt_tokens=1, max_tokens=1, key=None,
                               model=self.spec.models[0], finish_reason="length")  # fmt: skip
        try:
            async with asyncio.timeout(_SGLANG_HEALTH_TIMEOUT_S):
                await asyncio.sleep(self.spec.sglang_health_poll_s)
                await self._wait_finished(pending)
        except TimeoutError:
            self._abort(pending)
            return web.Response(status=503)
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        mode = self._fault.mode
        if mode == "garbage_metrics":
            return web.Response(text=garbage_metrics(self.seed), content_type="text/plain", charset="utf-8")
        if mode == "html_metrics":
            return web.Response(text=html_metrics(), content_type="text/html", charset="utf-8")
        text = render(self.spec.engine, self._metrics_input(), variant=self.spec.metrics_variant)
        if text is None:
            raise web.HTTPNotFound()
        if mode == "truncated_metrics":
            fraction = float(self._fault.param("fraction", 0.5))
            if self._fault.param("how", "cut") == "abort":
                return await self._aborted_body(request, text.encode(), fraction)
            text = truncate_metrics(text, fraction)
        return web.Response(body=text.encode(), headers={"Content-Type": _METRICS_CONTENT_TYPE})

    async def _aborted_body(self, request: web.Request, body: bytes, fraction: float) -> web.StreamResponse:
        """Promise the whole body in Content-Length, send part, drop the connection."""
        response = web.StreamResponse(headers={"Content-Type": _METRICS_CONTENT_TYPE})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[: int(len(body) * fraction)])
        if request.transport is not None:
            request.transport.close()
        return response

    def _metrics_input(self) -> MetricsInput:
        return MetricsInput(
            model_name=self.spec.models[0],
            engines=self.engines,
            started_at_unix=self._started_unix,
            prefix_caching=self.spec.prefix_cache_size > 0,
            http_requests=dict(self._http_requests),
            http_durations=self._http_durations,
            request_failures=dict(self._failures),
            requests_received=self._inference_received,
        )

    # -- inference ------------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, chat=True)

    async def _inference(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        self._inference_received += 1
        self._last_inference_headers = _header_dict(request)
        try:
            body = await _json_body(request)
            model = body.get("model") or self.spec.models[0]
            if self.spec.engine == "llamacpp":
                model = self.spec.models[0]  # llama-server ignores `model` and answers its own name
            elif model not in self.spec.models:
                raise _BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
            text, tokens = _chat_prompt(body) if chat else _completion_prompt(body)
            max_tokens = _max_tokens(body, chat)
            answer = _answer_tokens(request)
        except _BadRequest as exc:
            self._failures["validation" if exc.status == 400 else "not_found"] += 1
            return self._error(exc.status, exc.message, exc.kind, exc.param)
        burst_status = self._fault.take_error()
        if burst_status is not None:
            self._failures["error_burst"] += 1
            return self._error(burst_status, "Simulated internal error", "InternalServerError")
        if self._queue_full():
            self._failures["overloaded"] += 1
            status = int(self._fault.param("status", self.spec.effective_overload_status()))
            return self._error(status, "Model is overloaded", "overloaded")
        session = request.headers.get("x-session-id")
        key: CacheKey
        if self.spec.prefix_cache_mode == "blocks":
            key = block_hashes(text, model)
        else:
            key = f"s:{session}" if session else _prefix_key(text, self.spec.prefix_key_chars)
        finish_reason = "length"
        rng = random.Random(f"{self.seed}|{model}|{text}")
        if max_tokens is None:
            default = self.spec.default_max_tokens
            max_tokens = rng.randint(max(1, default // 4), default)
            finish_reason = "stop"
        if answer is not None and answer < max_tokens:
            max_tokens, finish_reason = answer, "stop"
        pending = self._submit(text, tokens, max_tokens, key, model, finish_reason, rng)
        stream = bool(body.get("stream", False))
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage", False)) if isinstance(options, dict) else False
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{pending.request.request_id}"
        try:
            if stream:
                return await self._stream(request, pending, ident, model, chat, include_usage)
            await self._wait_finished(pending)
            if pending.request.aborted:
                return self._error(503, "Request aborted", "ServiceUnavailableError")
            self._completed += 1
            return web.json_response(self._full_body(pending, ident, model, chat))
        finally:
            self._abort(pending)

    def _queue_full(self) -> bool:
        limit = self.spec.effective_max_queue()
        if self._fault.mode == "queue_full":
            limit = int(self._fault.param("max_queue", 0))
        if limit is None:
            return False
        return sum(len(e.waiting) for e in self.engines) >= limit

    def _submit(
        self,
        prompt_text: str,
        prompt_tokens: int,
        max_tokens: int,
        key: CacheKey,
        model: str,
        finish_reason: str,
        rng: random.Random | None = None,
    ) -> _Pending:
        loop = self._require_loop()
        self._next_id += 1
        request_id = f"{self._next_id:08x}"
        rng = rng or random.Random(f"{self.seed}|{model}|{prompt_text}")
        words = [rng.choice(_WORDS) for _ in range(max_tokens)]
        engine_request = EngineRequest(
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            arrival=loop.time(),
            cache_key=key,
            finish_reason=finish_reason,
        )
        # Data parallel: the least loaded rank takes it (lowest index on ties).
        engine = min(self.engines, key=lambda e: len(e.running) + len(e.waiting))
        pending = _Pending(engine_request, engine, words)
        self._pending[request_id] = pending
        engine.submit(engine_request, engine_request.arrival)
        self._kick()
        return pending

    async def _wait_finished(self, pending: _Pending) -> None:
        while not pending.request.finished:
            await pending.changed.wait()
            pending.changed.clear()

    def _abort(self, pending: _Pending) -> None:
        self._pending.pop(pending.request.request_id, None)
        if not pending.request.finished and self._loop is not None:
            pending.engine.abort(pending.request, self._loop.time())
            self._kick()

    def _full_body(self, pending: _Pending, ident: str, model: str, chat: bool) -> dict[str, Any]:
        r = pending.request
        text = "".join(" " + w for w in pending.words[: r.generated])
        choice: dict[str, Any] = {"index": 0, "finish_reason": r.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None, stop_reason=None)
        return {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": _usage(r),
        }

    async def _stream(
        self,
        request: web.Request,
        pending: _Pending,
        ident: str,
        model: str,
        chat: bool,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        r = pending.request

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": ident, "object": obj, "created": created, "model": model, "choices": choices,
            }  # fmt: skip
            if usage is not None:
                payload["usage"] = usage
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        sent = 0
        try:
            if chat:
                role = {"role": "assistant", "content": ""}
                await response.write(chunk([{"index": 0, "delta": role, "logprobs": None, "finish_reason": None}]))
            while True:
                await pending.changed.wait()
                pending.changed.clear()
                if r.aborted:
                    break
                out: list[bytes] = []
                while sent < r.generated:
                    last = sent == r.generated - 1 and r.finished_at is not None
                    reason = r.finish_reason if last else None
                    word = " " + pending.words[sent]
                    if chat:
                        choice = {"index": 0, "delta": {"content": word}, "logprobs": None,
                                  "finish_reason": reason}  # fmt: skip
                    else:
                        choice = {"index": 0, "text": word, "logprobs": None,
                                  "finish_reason": reason, "stop_reason": None}  # fmt: skip
                    out.append(chunk([choice]))
                    sent += 1
                if r.finished_at is not None:
                    if include_usage:
                        out.append(chunk([], _usage(r)))
                    out.append(b"data: [DONE]\n\n")
                if out:
                    await response.write(b"".join(out))
                if r.finished_at is not None:
                    self._completed += 1
                    break
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass  # client went away; the finally in _inference aborts the engine request
        return response

    def _error(self, status: int, message: str, kind: str, param: str | None = None) -> web.Response:
        if self.spec.engine == "tgi":
            body: dict[str, Any] = {"error": message, "error_type": kind.lower()}
        else:
            body = _openai_error(message, kind, status, param)
        return web.json_response(body, status=status)

    # -- helpers ------------------------------------------------------------------------------

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError(f"worker {self.name} is not started")
        return self._loop

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn_call(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self._spawn(make())


def _header_dict(request: web.Request) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in request.headers.items():
        out[key] = f"{out[key]}, {value}" if key in out else value
    return out


def _openai_error(message: str, kind: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadRequest(400, f"Invalid JSON body: {exc}", "BadRequestError") from exc
    if not isinstance(body, dict):
        raise _BadRequest(400, "The body must be a JSON object", "BadRequestError")
    return body


def _estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / _CHARS_PER_TOKEN))


def _completion_prompt(body: dict[str, Any]) -> tuple[str, int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, _estimate_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return " ".join(map(str, prompt)), len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        text = "\n".join(prompt)
        return text, _estimate_tokens(text)
    raise _BadRequest(400, "prompt must be a string, a list of strings or of token ids",
                      "BadRequestError", "prompt")  # fmt: skip


def _chat_prompt(body: dict[str, Any]) -> tuple[str, int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest(400, "messages must be a non-empty list", "BadRequestError", "messages")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise _BadRequest(400, "each message must be an object", "BadRequestError", "messages")
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role', 'user')}: {content}")
    text = "\n".join(parts)
    return text, _estimate_tokens(text) + _MESSAGE_OVERHEAD_TOKENS * len(messages)


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    value = body.get("max_tokens")
    if value is None and chat:
        value = body.get("max_completion_tokens")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _BadRequest(400, "max_tokens must be a positive integer", "BadRequestError",
                          "max_tokens")  # fmt: skip
    return value


def _answer_tokens(request: web.Request) -> int | None:
    """The answer's own length the client sent (`x-sim-answer-tokens`), None without one."""
    raw = request.headers.get("x-sim-answer-tokens")
    if raw is None:
        return None
    # at most 7 digits before int(): a longer string of digits is over the bound anyway, and int() refuses
    # one of over 4,300 digits with a ValueError (a header may carry 8 KB)
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 7) or not 1 <= int(raw) <= 1_000_000:
        raise _BadRequest(400, "x-sim-answer-tokens must be a positive integer", "BadRequestError",
                          "x-sim-answer-tokens")  # fmt: skip
    return int(raw)


def _prefix_key(text: str, chars: int) -> str:
    return "p:" + hashlib.sha256(text[:chars].encode()).hexdigest()[:32]


def block_hashes(text: str, model: str) -> tuple[str, ...]:
    """Chained hashes of the prompt's full blocks (BLOCK_TOKENS tokens of _CHARS_PER_TOKEN
    characters each), seeded with the model: block i's hash covers every block before it, so
    two prompts share block i only if they share the whole text up to its end. The trailing
    partial block is not cached (vLLM caches full blocks only)."""
    size = BLOCK_TOKENS * _CHARS_PER_TOKEN
    out: list[str] = []
    previous = hashlib.sha256(model.encode()).digest()
    for start in range(0, len(text) - size + 1, size):
        previous = hashlib.sha256(previous + text[start:start + size].encode()).digest()
        out.append(previous[:12].hex())
    return tuple(out)


def _usage(r: EngineRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.generated,
        "total_tokens": r.prompt_tokens + r.generated,
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    }
