"""Envoy's rate limit service (envoy.service.ratelimit.v3), counting the topology's global budgets in Redis.

Envoy's global rate limit filter sends, per request, one descriptor per budget that applies
(confgen.limits documents their entries); this service looks the budget up in the current
topology (a descriptor naming no budget is not limited), counts in Redis with one atomic
script (store.py) and answers OK or OVER_LIMIT with each budget's limit, remaining amount
and time to reset (Envoy turns them into x-ratelimit-* headers).

Costs: a request budget costs 1 per request; a token budget is checked with cost 0 when the
request arrives (refused once the window's tokens are spent) and charged the response's
usage when the stream ends (Envoy's apply_on_stream_done, fire-and-forget).

Failure: every Redis call is bounded (limits.store.timeout). When Redis is down or slow the
request is admitted uncounted (refused for fail_closed budgets), the store is marked down
and left alone for a short backoff so that a dead store costs nothing per request; the
first call after it counts again. Envoy's own timeout (check_timeout) and fail-open cover a
sidecar that does not answer at all.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import duration_pb2
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import CollectorRegistry

from confgen.limits import (
    ANY_MODEL,
    BODY_BYTES_KEY,
    BYTES_PER_TOKEN,
    CLIENT_KEY,
    ESTIMATE_OUTPUT_TOKENS,
    LIMIT_KEY,
    MAX_OUTPUT_KEY,
    MODEL_KEY,
    PHASE_DONE,
    PHASE_KEY,
    REQUEST_ID_KEY,
    RESERVATION_HOLD_S,
    Budget,
    budgets,
    domain,
)
from confgen.model import LimitStore, Topology, split_address
from sidecar.fleet import Snapshot
from sidecar.logs import log_event
from sidecar.outputs.ratelimit.store import Decision, Op, RedisCounter, StoreUnavailable

__all__ = ["METRIC_NAMES", "RateLimitService"]

METRIC_NAMES = (
    "confgen_sidecar_ratelimit_decisions_total",
    "confgen_sidecar_ratelimit_store_up",
    "confgen_sidecar_ratelimit_store_failures_total",
    "confgen_sidecar_ratelimit_store_seconds",
)

_log = logging.getLogger("sidecar.ratelimit")
_UNITS = {1: rls_pb2.RateLimitResponse.RateLimit.SECOND, 60: rls_pb2.RateLimitResponse.RateLimit.MINUTE,
          3600: rls_pb2.RateLimitResponse.RateLimit.HOUR, 86400: rls_pb2.RateLimitResponse.RateLimit.DAY}
_OK = rls_pb2.RateLimitResponse.OK
_OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
_UINT32_MAX = 2**32 - 1
_MAX_DESCRIPTORS = 64  # a request carries one per budget that applies; more is not Envoy
_MAX_ESTIMATE = 10**9  # Envoy's own bound on a hits_addend


@dataclass(frozen=True, slots=True)
class _Table:
    """The current topology's budgets, resolved once per topology."""

    topo: Topology
    domain: str
    budgets: dict[str, Budget]
    clients: frozenset[str]
    models: frozenset[str]
    store: LimitStore | None


def _table(topo: Topology) -> _Table:
    clients = frozenset(k.client for k in topo.auth.api_keys) if topo.auth is not None else frozenset()
    models = frozenset(name for pool in topo.pools for name in pool.served_names) | {ANY_MODEL}
    return _Table(topo, domain(topo), {b.id: b for b in budgets(topo)}, clients, models, topo.limits.store)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "confgen_sidecar_ratelimit_decisions_total",
            "Rate limit service answers, by code (ok, over_limit) and whether the store counted them "
            "(counted, fail_open, fail_closed)", ["code", "store"], registry=registry)
        self.store_up = Gauge(
            "confgen_sidecar_ratelimit_store_up",
            "1 while the last call to the rate limit store (Redis) succeeded; 0 while global limits go uncounted",
            registry=registry)
        self.store_failures = Counter(
            "confgen_sidecar_ratelimit_store_failures_total",
            "Calls to the rate limit store that failed or timed out", registry=registry)
        self.latency = Histogram(
            "confgen_sidecar_ratelimit_store_seconds", "Time of one decision script in the store",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25), registry=registry)
        self.store_up.set(1)


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """The servicer and its lifecycle (a sidecar.outputs.service.Service)."""

    name = "ratelimit"

    def __init__(self, topology: Callable[[], Topology], registry: CollectorRegistry,
                 clock: Callable[[], float], wall: Callable[[], float] = time.time,
                 backoff_s: float = 0.25) -> None:
        self._topology = topology
        self._clock = clock  # monotonic: the backoff
        self._wall = wall  # the windows: every sidecar of the fleet must agree on them (NTP)
        self._backoff_s = backoff_s
        self._metrics = _Metrics(registry)
        self._current: _Table | None = None
        self._counter: RedisCounter | None = None
        self._counter_for: LimitStore | None = None
        self._down_until = 0.0
        self._up = True  # the last store call succeeded (logged on each change)
        self._retired: list[RedisCounter] = []

    # -- Service lifecycle ---------------------------------------------------------------
    def add_to(self, server: grpc.aio.Server) -> None:
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(self, server)

    def update(self, fleet: Snapshot) -> None:
        """Budgets do not depend on the fleet's health; the topology is read per request."""

    def problems(self) -> list[str]:
        """Nothing: with its store down the service still answers (fail open, or 429 for
        fail_closed budgets). A readiness failure there would take every proxy out of service
        at once for a shared Redis; the store's state is a metric and an alert instead."""
        return []

    async def start(self) -> None:
        self._table_now()  # connects lazily: a store that is down at start is not an error

    async def close(self) -> None:
        for counter in [*self._retired, *([self._counter] if self._counter else [])]:
            await counter.close()
        self._retired.clear()
        self._counter = None

    # -- the table and the store follow topology reloads ----------------------------------
    def _table_now(self) -> _Table:
        topo = self._topology()
        if self._current is None or self._current.topo is not topo:
            self._current = _table(topo)
            store = self._current.store
            if store != self._counter_for:
                if self._counter is not None:
                    self._retired.append(self._counter)
                self._counter = None
                if store is not None:
                    address = split_address(store.redis)
                    assert address is not None  # the topology's pattern and checks
                    self._counter = RedisCounter(address[0], address[1], store.timeout.seconds)
                self._counter_for = store
                log_event(_log, logging.INFO, "ratelimit.store", redis=store.redis if store else None,
                          budgets=len(self._current.budgets))
        return self._current

    # -- the RPC ---------------------------------------------------------------------------
    async def ShouldRateLimit(self, request: Any, context: Any) -> Any:
        table = self._table_now()
        if request.domain != table.domain or len(request.descriptors) > _MAX_DESCRIPTORS:
            return rls_pb2.RateLimitResponse(overall_code=_OK)
        now = self._wall()
        plan: list[tuple[Budget, int] | None] = []  # per descriptor: its budget and op index
        ops: list[Op] = []
        for descriptor in request.descriptors:
            found = self._op(table, descriptor, request.hits_addend, now)
            if found is None:
                plan.append(None)
                continue
            plan.append((found[0], len(ops)))
            ops.append(found[1])
        if not ops:
            return rls_pb2.RateLimitResponse(overall_code=_OK, statuses=[_status(None) for _ in plan])
        counts = await self._decide(ops)
        if counts is None:  # store unreachable: fail open, except fail_closed budgets
            closed = any(entry is not None and entry[0].limit.fail_closed for entry in plan)
            self._metrics.decisions.labels("over_limit" if closed else "ok",
                                           "fail_closed" if closed else "fail_open").inc()
            return rls_pb2.RateLimitResponse(
                overall_code=_OVER if closed else _OK,
                statuses=[_status(None) if entry is None else
                          _status(entry[0], code=_OVER if entry[0].limit.fail_closed else _OK, now=now)
                          for entry in plan])
        statuses = []
        for entry in plan:
            if entry is None:
                statuses.append(_status(None))
                continue
            budget, index = entry
            op, count, held = ops[index], counts.counts[index], counts.reserved[index]
            over = (op.mode == "a" and count + op.cost > op.limit and counts.refused) or \
                (op.mode == "c" and count >= op.limit) or \
                (op.mode == "r" and count + held - (0 if counts.refused else op.estimate) >= op.limit)
            statuses.append(_status(budget, code=_OVER if over else _OK, count=count + held, now=now))
        self._metrics.decisions.labels("over_limit" if counts.refused else "ok", "counted").inc()
        if not counts.refused:
            return rls_pb2.RateLimitResponse(overall_code=_OK, statuses=statuses)
        # retry-after: when the last refusing window resets (Envoy's 429 keeps it)
        wait = max((s.duration_until_reset.seconds for s in statuses if s.code == _OVER), default=1)
        return rls_pb2.RateLimitResponse(overall_code=_OVER, statuses=statuses, response_headers_to_add=[
            base_pb2.HeaderValue(key="retry-after", value=str(wait))])

    def _op(self, table: _Table, descriptor: Any, request_addend: int, now: float) -> tuple[Budget, Op] | None:
        entries = {e.key: e.value for e in descriptor.entries}
        budget = table.budgets.get(entries.get(LIMIT_KEY, ""))
        if budget is None:
            return None
        client = ""
        if budget.per_client:
            client = entries.get(CLIENT_KEY, "")
            allowed = budget.clients if budget.clients is not None else table.clients
            if client not in allowed or client in budget.except_clients:
                return None  # Envoy sends only authenticated clients; anything else is not ours to count
        model = ""
        if budget.limit.per_model:
            model = entries.get(MODEL_KEY, ANY_MODEL)
            model = model if model in table.models else ANY_MODEL
        # per-descriptor hits_addend wins (0 = check only); else the request's, where 0 means 1
        cost = int(descriptor.hits_addend.value) if descriptor.HasField("hits_addend") else request_addend or 1
        window = budget.window_seconds
        start = int(now // window)
        ttl = max(1, math.ceil((start + 1) * window - now)) + 1
        base = f"confgen:{table.domain}:{budget.id}:{client}:{model}"
        key = f"{base}:{window}:{start}"
        if not budget.tokens:
            return budget, Op(key, "a", cost, budget.amount, ttl)
        request_id = entries.get(REQUEST_ID_KEY, "")[:128]
        reservations = f"{base}:r"
        if cost > 0:  # the answer's tokens, at stream end: counted, the reservation released
            return budget, Op(key, "f", cost, budget.amount, ttl, request_id, reservations=reservations)
        if entries.get(PHASE_KEY) == PHASE_DONE:  # the answer ended: settles a reservation still held
            return budget, Op(key, "d", 0, budget.amount, ttl, request_id, reservations=reservations)
        if not request_id:
            return budget, Op(key, "c", 0, budget.amount, ttl)
        return budget, Op(key, "r", 0, budget.amount, ttl, request_id, _estimate(budget, entries), reservations,
                          max(window, RESERVATION_HOLD_S))

    async def _decide(self, ops: list[Op]) -> Decision | None:
        counter = self._counter
        if counter is None or self._clock() < self._down_until:
            if counter is None:
                self._metrics.store_up.set(0)
            return None
        started = self._clock()
        try:
            result = await counter.decide(ops, self._wall())
        except StoreUnavailable as exc:
            self._metrics.store_failures.inc()
            if self._up:
                log_event(_log, logging.WARNING, "ratelimit.store_down", redis=counter.address, error=str(exc),
                          backoff_s=self._backoff_s)
            self._up = False
            self._metrics.store_up.set(0)
            self._down_until = self._clock() + self._backoff_s
            return None
        self._metrics.latency.observe(self._clock() - started)
        if not self._up:
            log_event(_log, logging.INFO, "ratelimit.store_up", redis=counter.address)
        self._up = True
        self._metrics.store_up.set(1)
        self._down_until = 0.0
        return result


def _number(text: str | None) -> int | None:
    """A descriptor entry's non-negative integer (Envoy writes a JSON number: 17 or 17.0)."""
    if text is None or len(text) > 20:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if 0 <= value <= _MAX_ESTIMATE else None


def _estimate(budget: Budget, entries: dict[str, str]) -> int:
    """The tokens a request is expected to spend at most, reserved until its answer ends."""
    output = _number(entries.get(MAX_OUTPUT_KEY))
    output = ESTIMATE_OUTPUT_TOKENS if output is None else output
    body = _number(entries.get(BODY_BYTES_KEY)) or 0
    prompt = -(-body // BYTES_PER_TOKEN)
    unit = budget.limit.unit
    estimate = output if unit == "output_tokens" else prompt if unit == "input_tokens" else output + prompt
    return max(1, min(estimate, _MAX_ESTIMATE))


def _status(budget: Budget | None, code: int = _OK, count: int = 0, now: float = 0.0) -> Any:
    if budget is None:
        return rls_pb2.RateLimitResponse.DescriptorStatus(code=_OK)
    window = budget.window_seconds
    reset = max(1, math.ceil((int(now // window) + 1) * window - now))
    return rls_pb2.RateLimitResponse.DescriptorStatus(
        code=code,
        current_limit=rls_pb2.RateLimitResponse.RateLimit(
            name=budget.id, requests_per_unit=min(budget.amount, _UINT32_MAX), unit=_UNITS[window]),
        limit_remaining=min(max(0, budget.amount - count), _UINT32_MAX),
        duration_until_reset=duration_pb2.Duration(seconds=reset),
    )
