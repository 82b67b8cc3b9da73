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
store is marked down and left alone for a short backoff, so that a dead store costs nothing
per request; the first call after it counts again. Meanwhile:

- a request is decided on this sidecar's local floor (local.py): each budget cut to
  amount / limits.store.envoys per window, counted per key in memory (fail_closed budgets
  refuse instead); every such decision is counted per budget and client
  (confgen_sidecar_ratelimit_fail_open_total), never unlimited;
- a charge that cannot reach Redis (an answer's usage or estimate at stream end, a request
  the floor admitted) is kept in the journal (journal.py, on disk) and replayed when Redis
  answers again, so no admitted token goes uncharged.

Envoy's own timeout (check_timeout) and fail-open cover a sidecar that does not answer at all.

Per-key figures: every answer is counted per budget and client it carried
(confgen_sidecar_ratelimit_key_decisions_total), and every token charge the store applied, at
an answer's end or replayed from the journal, per budget, client and unit
(confgen_sidecar_ratelimit_tokens_charged_total; the script returns what each op added). Their
client label, as the floor's, is a client the topology names, "" for a listener-wide budget, or
OTHER: the series are bounded by the topology, not by what a descriptor carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import duration_pb2, wrappers_pb2
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import CollectorRegistry

from confgen.limits import (
    ANY_MODEL,
    BODY_BYTES_KEY,
    BYTES_PER_TOKEN,
    CLIENT_KEY,
    DEFAULT_MAX_OUTPUT_TOKENS,
    HOLD_KEY,
    LIMIT_KEY,
    MAX_OUTPUT_KEY,
    MODEL_KEY,
    PHASE_DONE,
    PHASE_KEY,
    REQUEST_ID_KEY,
    RESERVATION_HOLD_S,
    RESERVATION_MARGIN_S,
    Budget,
    budgets,
    domain,
    envoys,
    floor_amount,
)
from confgen.model import LimitStore, Topology, split_address
from sidecar.fleet import Cycle, Snapshot
from sidecar.logs import log_event
from sidecar.outputs.contract import BudgetAnswer, Descriptor, OutputStatus
from sidecar.outputs.ratelimit.journal import Journal
from sidecar.outputs.ratelimit.local import LocalCounter
from sidecar.outputs.ratelimit.store import Credentials, Decision, Op, RedisCounter, StoreRefused, StoreUnavailable

__all__ = ["METRIC_NAMES", "RateLimitService", "rate_limit_headers"]

METRIC_NAMES = (
    "confgen_sidecar_ratelimit_decisions_total",
    "confgen_sidecar_ratelimit_key_decisions_total",
    "confgen_sidecar_ratelimit_tokens_charged_total",
    "confgen_sidecar_ratelimit_store_up",
    "confgen_sidecar_ratelimit_store_failures_total",
    "confgen_sidecar_ratelimit_store_seconds",
    "confgen_sidecar_ratelimit_fail_open_total",
    "confgen_sidecar_ratelimit_journal_entries",
    "confgen_sidecar_ratelimit_charges_replayed_total",
    "confgen_sidecar_ratelimit_charges_dropped_total",
)

_log = logging.getLogger("sidecar.ratelimit")
_UNITS = {1: rls_pb2.RateLimitResponse.RateLimit.SECOND, 60: rls_pb2.RateLimitResponse.RateLimit.MINUTE,
          3600: rls_pb2.RateLimitResponse.RateLimit.HOUR, 86400: rls_pb2.RateLimitResponse.RateLimit.DAY}
_OK = rls_pb2.RateLimitResponse.OK
_OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
_UINT32_MAX = 2**32 - 1
_MAX_DESCRIPTORS = 64  # a request carries one per budget that applies; more is not Envoy
_MAX_ESTIMATE = 10**9  # Envoy's own bound on a hits_addend
_MAX_HOLD_S = 86400
_MAX_PENDING_APPENDS = 10_000  # journal writes queued for its thread; past it a charge is dropped (counted)
OTHER = "(other)"  # the per-key label of a client (or budget) the topology does not name: never a client name
_PER_KEY = ('budget: a budget id of the topology; client: an API-key client the topology names (auth.api_keys), '
            '"" for a budget of all the listener\'s requests, "(other)" for any other value, so that the series '
            'stay bounded by the topology whatever a client sends')


@dataclass(frozen=True, slots=True)
class _Table:
    """The current topology's budgets, resolved once per topology."""

    topo: Topology
    domain: str
    budgets: dict[str, Budget]
    clients: frozenset[str]
    models: frozenset[str]
    store: LimitStore | None
    envoys: int  # the local floor: each budget / this, per window, while the store is away
    max_body: int  # the largest request body a listener accepts (a chunked body's estimate)


def _table(topo: Topology) -> _Table:
    clients = frozenset(k.client for k in topo.auth.api_keys) if topo.auth is not None else frozenset()
    models = frozenset(name for pool in topo.pools for name in pool.served_names) | {ANY_MODEL}
    max_body = max((lst.max_request_bytes for lst in topo.listeners), default=0)
    return _Table(topo, domain(topo), {b.id: b for b in budgets(topo)}, clients, models, topo.limits.store,
                  envoys(topo), max_body)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "confgen_sidecar_ratelimit_decisions_total",
            "Rate limit service answers, by code (ok, over_limit) and whether the store counted them "
            "(counted, floor, fail_closed)", ["code", "store"], registry=registry)
        self.key_decisions = Counter(
            "confgen_sidecar_ratelimit_key_decisions_total",
            "Rate limit answers per budget and client, by code: the answer's (ok, over_limit; a request refused "
            "by one of its budgets counts over_limit on each budget it carried), counted in the store, on the "
            "local floor or fail_closed alike. " + _PER_KEY, ["budget", "client", "code"], registry=registry)
        self.tokens_charged = Counter(
            "confgen_sidecar_ratelimit_tokens_charged_total",
            "Tokens the store was charged per token budget, client and unit (input_tokens, output_tokens, "
            "total_tokens): each answer's usage, or its estimate, at its end, and the charges the journal kept "
            "when they are replayed; each charge once (a replay that finds its charge applied by a call that timed "
            "out counts what that call added). " + _PER_KEY
            + '; a replayed charge of a budget the topology no longer has: budget, client and unit "(other)"',
            ["budget", "client", "unit"], registry=registry)
        self.store_up = Gauge(
            "confgen_sidecar_ratelimit_store_up",
            "1 while the last call to the rate limit store (Redis) succeeded; 0 while global limits go uncounted",
            registry=registry)
        self.store_failures = Counter(
            "confgen_sidecar_ratelimit_store_failures_total",
            "Calls to the rate limit store that failed or timed out", registry=registry)
        self.store_in_flight = Gauge(
            "confgen_sidecar_ratelimit_store_calls_in_flight",
            "Decision scripts sent to the rate limit store and not answered yet (rising: a slow store)",
            registry=registry)
        self.latency = Histogram(
            "confgen_sidecar_ratelimit_store_seconds", "Time of one decision script in the store",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25), registry=registry)
        self.fail_open = Counter(
            "confgen_sidecar_ratelimit_fail_open_total",
            "Decisions made on the sidecar's local floor (the store unreachable or slow), by budget, client "
            "and code (ok, over_limit). " + _PER_KEY, ["budget", "client", "code"], registry=registry)
        self.journal = Gauge(
            "confgen_sidecar_ratelimit_journal_entries",
            "Charges kept on disk for the store, waiting for it to answer", registry=registry)
        self.replayed = Counter(
            "confgen_sidecar_ratelimit_charges_replayed_total",
            "Journal entries applied to the store once it answered again", registry=registry)
        self.dropped = Counter(
            "confgen_sidecar_ratelimit_charges_dropped_total",
            "Charges that could reach neither the store nor the journal (full, or its file failing), or that "
            "Redis refused on replay",
            registry=registry)
        self.store_up.set(1)


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """The servicer and its lifecycle (a sidecar.outputs.contract.Output)."""

    name = "ratelimit"

    def __init__(self, topology: Callable[[], Topology], registry: CollectorRegistry,
                 clock: Callable[[], float], wall: Callable[[], float] = time.time,
                 backoff_s: float = 0.25, journal: Path | None = None, flush_interval_s: float = 1.0,
                 journal_entries: int = 20_000) -> None:
        self._topology = topology
        self._clock = clock  # monotonic: the backoff
        self._wall = wall  # the windows: every sidecar of the fleet must agree on them (NTP)
        self._backoff_s = backoff_s
        self._flush_interval_s = flush_interval_s  # journal: how often a replay is tried while it holds charges
        self._metrics = _Metrics(registry)
        self._local = LocalCounter()
        self._journal = Journal(journal, journal_entries)
        self._pending_appends = 0
        self._appends: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        self._current: _Table | None = None
        self._counter: RedisCounter | None = None
        self._counter_for: LimitStore | None = None
        self._down_until = 0.0
        self._up = True  # the last store call succeeded (logged on each change)
        self._answered_at = -math.inf  # the last store call that answered (the flusher PINGs when none lately)
        self._refusal_logged_at = -math.inf  # the last "Redis refused a call" log (at most one a minute)
        self._retired: list[RedisCounter] = []

    # -- the output's lifecycle --------------------------------------------------------------
    def add_to(self, server: grpc.aio.Server) -> None:
        """Its servicer on the sidecar's gRPC server."""
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(self, server)

    async def apply(self, cycle: Cycle) -> None:
        """Nothing: budgets do not depend on the fleet's health; the topology is read per request."""

    def update(self, fleet: Snapshot) -> None:
        """Nothing, as for `apply`."""

    def forget(self, pool: str) -> None:
        """Nothing: budgets are the current topology's, read per request."""

    def status(self) -> OutputStatus:
        """No problem: with its store down the service still answers (fail open, or 429 for
        fail_closed budgets). A readiness failure there would take every proxy out of service
        at once for a shared Redis; the store's state is a metric and an alert instead. Nothing
        refused for overload: its 429s are budgets spent (confgen_ratelimit_*)."""
        return OutputStatus()

    async def start(self) -> None:
        self._table_now()  # connects lazily: a store that is down at start is not an error
        try:
            kept = await self._journal.open()
        except (sqlite3.Error, OSError) as exc:  # unreadable: charges are kept in memory instead
            log_event(_log, logging.ERROR, "ratelimit.journal_unusable", path=str(self._journal.path), error=str(exc))
            await self._journal.close()
            self._journal = Journal(None, self._journal.max_entries)
            kept = await self._journal.open()
        self._metrics.journal.set(kept)
        if kept:
            log_event(_log, logging.INFO, "ratelimit.journal_kept", entries=kept, path=str(self._journal.path))
            self._wake.set()
        self._flusher = asyncio.create_task(self._flush_loop(), name="ratelimit-journal-flush")

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self._appends:
            await asyncio.gather(*self._appends, return_exceptions=True)
        await self._journal.close()
        for counter in [*self._retired, *([self._counter] if self._counter else [])]:
            await counter.close()
        self._retired.clear()
        self._counter = None

    # -- the journal: charges the store could not take, replayed when it answers ---------------
    def _keep(self, at: float, ops: list[Op]) -> None:
        """Journal ops that happened at `at` without blocking the caller (bounded queue)."""
        if not ops:
            return
        if self._pending_appends >= _MAX_PENDING_APPENDS:
            self._metrics.dropped.inc()
            return
        self._pending_appends += 1
        task = asyncio.create_task(self._append(at, ops))
        self._appends.add(task)
        task.add_done_callback(self._appends.discard)

    async def _append(self, at: float, ops: list[Op]) -> None:
        try:
            kept = await self._journal.append(at, ops)
        except (sqlite3.Error, OSError) as exc:
            kept = False
            log_event(_log, logging.ERROR, "ratelimit.journal_write_failed", error=str(exc))
        finally:
            self._pending_appends -= 1
        if not kept:
            self._metrics.dropped.inc()
        self._metrics.journal.set(self._journal.size)

    async def settled(self) -> None:
        """Wait for the journal writes queued so far (tests; close)."""
        if self._appends:
            await asyncio.gather(*list(self._appends), return_exceptions=True)

    async def flush(self) -> int:
        """Replay the journal into the store, oldest first; the entries applied. Stops at the
        first store failure (the rest stay for the next try); an entry Redis refuses (it is up, and would
        refuse it again) is dropped and counted, and the replay goes on."""
        async with self._flush_lock:
            counter = self._counter
            table = self._table_now()
            applied = refused = 0
            while counter is not None and self._journal.size:
                batch = await self._journal.oldest()
                done: list[int] = []
                try:
                    for row_id, at, ops in batch:
                        if ops:
                            late = max(0, int(self._wall() - at))
                            try:
                                result = await counter.decide(
                                    [replace(op, ttl_s=max(1, op.ttl_s - late)) for op in ops], at)
                            except StoreRefused as exc:  # Redis is up and will refuse it again: dropped
                                self._store_answered(counter)
                                refused += 1
                                self._metrics.dropped.inc()
                                log_event(_log, logging.ERROR, "ratelimit.journal_entry_refused", error=str(exc),
                                          keys=[op.key for op in ops][:4],
                                          note="Redis refused this charge; dropped, the entries after it replayed")
                            else:
                                self._store_answered(counter)
                                self._count_charges(table, ops, result, replayed=True)
                        done.append(row_id)
                except StoreUnavailable as exc:
                    self._store_failed(counter, exc)
                    await self._journal.remove(done)
                    applied += len(done)
                    break
                await self._journal.remove(done)
                applied += len(done)
                if not batch:
                    break
            applied -= refused
            if applied or refused:
                self._metrics.replayed.inc(applied)
                log_event(_log, logging.INFO, "ratelimit.journal_replayed", entries=applied, refused=refused,
                          left=self._journal.size)
            self._metrics.journal.set(self._journal.size)
            return applied

    async def _flush_loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the inner result when the
            # wake and a cancel land in one loop iteration, swallowing the cancel, and `close` then
            # waited for this loop forever (a sidecar killed on SIGTERM after 10 s, seen in CI)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._flush_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if self._clock() < self._down_until:
                continue
            quiet = self._clock() - self._answered_at >= self._flush_interval_s
            if (not self._up or quiet) and (counter := self._counter) is not None:
                # no request may come to tell the store is back (a quiet hour after one slow call), or gone:
                # asked here when no call answered lately, so store_up (and its alert) follows the store, not
                # the traffic
                try:
                    await counter.ping()
                except StoreUnavailable as exc:
                    self._store_failed(counter, exc)
                    continue
                self._store_answered(counter)
            if self._journal.size:
                try:
                    await self.flush()
                except (sqlite3.Error, OSError) as exc:
                    log_event(_log, logging.ERROR, "ratelimit.journal_read_failed", error=str(exc))

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
                    self._counter = _counter(store)
                self._counter_for = store
                log_event(_log, logging.INFO, "ratelimit.store",
                          redis=self._counter.address if self._counter is not None else None,
                          budgets=len(self._current.budgets))
        return self._current

    # -- in process: the endpoint picker's check (sidecar.outputs.contract.BudgetCheck) -------
    async def check(self, descriptors: Sequence[Descriptor]) -> BudgetAnswer:
        """The decision Envoy's filter would get for these descriptors, without its gRPC call: the
        same counting, floor and metrics; the answer's headers as Envoy would write them."""
        request = rls_pb2.RateLimitRequest(domain=self._table_now().domain)
        for d in descriptors:
            out = request.descriptors.add()
            for key, value in d.entries:
                out.entries.add(key=key, value=value)
            if d.hits is not None:  # present even at 0: a token budget's check costs nothing
                out.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=d.hits))
        answer = await self.ShouldRateLimit(request, None)
        headers = rate_limit_headers(answer.statuses)
        if answer.overall_code != _OVER:
            return BudgetAnswer(True, headers)
        extra = tuple((h.key, h.value) for h in answer.response_headers_to_add)
        return BudgetAnswer(False, (*headers, *extra))

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
        if all(op.mode in ("f", "d") for op in ops):  # an answer's end: charged now, or journaled
            ops = self._settle_local(ops, now)
            try:
                charged = await self._decide(ops)
            except asyncio.CancelledError:
                # Envoy gave up on the call (its check_timeout) while the store was slow: whether or not
                # the script reached Redis, the charge is journaled; its id's mark makes the replay of one
                # Redis ran a no-op (a charge without a request id could be counted twice: over, never under)
                self._keep(now, ops)
                raise
            if charged is None:
                self._keep(now, ops)
            else:
                self._count_charges(table, ops, charged)
            return rls_pb2.RateLimitResponse(overall_code=_OK, statuses=[_status(None) for _ in plan])
        counts = await self._decide(ops)
        if counts is None:  # store unreachable: the local floor, except fail_closed budgets
            closed = any(entry is not None and entry[0].limit.fail_closed for entry in plan)
            if closed:
                self._metrics.decisions.labels("over_limit", "fail_closed").inc()
                self._count_keys(table, plan, ops, "over_limit")
                return rls_pb2.RateLimitResponse(
                    overall_code=_OVER,
                    statuses=[_status(None) if entry is None else
                              _status(entry[0], code=_OVER if entry[0].limit.fail_closed else _OK, now=now)
                              for entry in plan])
            return self._on_floor(table, plan, ops, now)
        return self._answer(table, plan, ops, counts, now, "counted")

    def _settle_local(self, ops: list[Op], now: float) -> list[Op]:
        """An answer's end ops for the store: a reservation this sidecar's floor held (the
        request was admitted while the store was away) is released here, and its estimate
        charged to the store when no usage charged it (mode d becomes a plain charge)."""
        out = []
        for op in ops:
            if op.request_id and self._local.holds(op.reservations, op.request_id, now):
                estimate = self._local.release(op.reservations, op.request_id, now) or 0
                if op.mode == "d":
                    self._local.decide([replace(op, mode="f", cost=estimate, request_id="")], now)
                    op = replace(op, mode="f", cost=estimate, request_id="")
                else:
                    self._local.decide([replace(op, request_id="")], now)
            out.append(op)
        return out

    def _on_floor(self, table: _Table, plan: list[tuple[Budget, int] | None], ops: list[Op], now: float) -> Any:
        """The decision on this sidecar's share of each budget (the store is away)."""
        budget_of = {index: entry[0] for entry in plan if entry is not None for index in (entry[1],)}
        floors = [floor_amount(budget_of[i], table.envoys) for i in range(len(ops))]
        counts = self._local.decide([replace(op, limit=f) for op, f in zip(ops, floors, strict=True)], now)
        code = "over_limit" if counts.refused else "ok"
        for index, op in enumerate(ops):
            budget = budget_of[index]
            self._metrics.fail_open.labels(budget.id, _client_label(table, budget, op), code).inc()
        if not counts.refused:  # the store counts them too once it answers
            self._keep(now, [Op(op.key, "f", op.cost, op.limit, op.ttl_s) for op in ops if op.mode == "a"])
        # the answer's remaining amounts are this sidecar's share's
        shifted = Decision([c + budget_of[i].amount - floors[i] for i, c in enumerate(counts.counts)],
                           counts.reserved, counts.refused)
        return self._answer(table, plan, [replace(op, limit=budget_of[i].amount) for i, op in enumerate(ops)],
                            shifted, now, "floor")

    def _count_keys(self, table: _Table, plan: list[tuple[Budget, int] | None], ops: list[Op], code: str) -> None:
        """One answer, per budget and client it carried (confgen_sidecar_ratelimit_key_decisions_total)."""
        for entry in plan:
            if entry is not None:
                budget, index = entry
                self._metrics.key_decisions.labels(budget.id, _client_label(table, budget, ops[index]), code).inc()

    def _count_charges(self, table: _Table, ops: list[Op], applied: Decision, replayed: bool = False) -> None:
        """The tokens each op of a call added to the store (confgen_sidecar_ratelimit_tokens_charged_total);
        a requests budget's charge (a request admitted on the floor, replayed) is not tokens. `replayed`:
        the journal's ops, never counted here before (their call failed), so a charge the store had
        applied already (that call timed out after Redis ran it) counts what that call added."""
        earlier = applied.earlier if replayed else []
        for index, (op, now_added) in enumerate(zip(ops, applied.added, strict=False)):
            added = now_added + (earlier[index] if index < len(earlier) else 0)
            if added <= 0:
                continue
            parts = op.key.split(":", 4)  # confgen, domain, budget id, client, model:window:start
            budget = table.budgets.get(parts[2]) if len(parts) == 5 and parts[1] == table.domain else None
            if budget is None:  # a replayed charge of an older topology's budget
                if op.reservations:  # only token ops carry a reservations hash
                    self._metrics.tokens_charged.labels(OTHER, OTHER, OTHER).inc(added)
            elif budget.tokens:
                self._metrics.tokens_charged.labels(budget.id, _client_label(table, budget, op),
                                                    budget.limit.unit).inc(added)

    def _answer(self, table: _Table, plan: list[tuple[Budget, int] | None], ops: list[Op], counts: Decision,
                now: float, store: str) -> Any:
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
        code = "over_limit" if counts.refused else "ok"
        self._metrics.decisions.labels(code, store).inc()
        self._count_keys(table, plan, ops, code)
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
        # per-descriptor hits_addend wins (0 = check only); else the request's, where 0 means 1; at most
        # Envoy's own bound (a direct caller's 1e17 would overflow Redis's INCRBY and stall the journal)
        cost = int(descriptor.hits_addend.value) if descriptor.HasField("hits_addend") else request_addend or 1
        cost = min(cost, _MAX_ESTIMATE)
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
            return budget, Op(key, "f", cost, budget.amount, ttl, request_id, reservations=reservations,
                              charge_id=f"{request_id}:f" if request_id else "")
        if entries.get(PHASE_KEY) == PHASE_DONE:  # the answer ended: settles a reservation still held
            return budget, Op(key, "d", 0, budget.amount, ttl, request_id, reservations=reservations,
                              charge_id=f"{request_id}:d" if request_id else "")
        if not request_id:
            return budget, Op(key, "c", 0, budget.amount, ttl)
        hold = _number(entries.get(HOLD_KEY))
        hold = min(hold, _MAX_HOLD_S) if hold else RESERVATION_HOLD_S
        return budget, Op(key, "r", 0, budget.amount, ttl, request_id, _estimate(budget, entries, table.max_body),
                          reservations, hold + RESERVATION_MARGIN_S)

    async def _decide(self, ops: list[Op]) -> Decision | None:
        counter = self._counter
        if counter is None or self._clock() < self._down_until:
            if counter is None:
                self._metrics.store_up.set(0)
            return None
        started = self._clock()
        self._metrics.store_in_flight.inc()
        try:
            result = await counter.decide(ops, self._wall())
        except StoreRefused as exc:  # this call only: the store is up for the others, no backoff
            self._store_refused(counter, exc)
            return None
        except StoreUnavailable as exc:
            self._store_failed(counter, exc)
            return None
        finally:
            self._metrics.store_in_flight.dec()
        self._metrics.latency.observe(self._clock() - started)
        self._store_answered(counter)
        return result

    def _store_answered(self, counter: RedisCounter) -> None:
        """The store answered a call (a decision, a replay or the flusher's PING): up again."""
        self._answered_at = self._clock()
        if not self._up:
            log_event(_log, logging.INFO, "ratelimit.store_up", redis=counter.address)
        self._up = True
        self._metrics.store_up.set(1)
        self._down_until = 0.0
        if self._journal.size:
            self._wake.set()  # the store answers: replay what it missed

    def _store_refused(self, counter: RedisCounter, exc: StoreRefused) -> None:
        """Redis refused one call (e.g. a budget's key written by something else with another type): that
        request falls back to the floor and its charge to the journal, which drops it on replay; logged at
        most once a minute (every request of the budget is refused alike)."""
        self._metrics.store_failures.inc()
        now = self._clock()
        if now >= self._refusal_logged_at + 60.0:
            self._refusal_logged_at = now
            log_event(_log, logging.ERROR, "ratelimit.store_refused", redis=counter.address, error=str(exc),
                      note="the request is decided on the local floor; its charge is journaled and dropped if "
                      "Redis refuses it again")

    def _store_failed(self, counter: RedisCounter, exc: StoreUnavailable) -> None:
        self._metrics.store_failures.inc()
        if self._up:
            log_event(_log, logging.WARNING, "ratelimit.store_down", redis=counter.address, error=str(exc),
                      backoff_s=self._backoff_s)
        self._up = False
        self._metrics.store_up.set(0)
        self._down_until = self._clock() + self._backoff_s


def _credentials(store: LimitStore, environ: Mapping[str, str]) -> Credentials | None:
    """What the sidecar authenticates to Redis with: limits.store.password_env's value (and username).
    The variable unset or empty: None, logged (Redis then refuses every call: the store is down, the
    local floor decides, `ratelimit.store_down` says NOAUTH)."""
    if store.password_env is None:
        return None
    password = environ.get(store.password_env, "")
    if not password:
        log_event(_log, logging.ERROR, "ratelimit.store_password_missing", variable=store.password_env,
                  note="limits.store.password_env names a variable that is not set or empty")
        return None
    return Credentials(store.username, password)


def _counter(store: LimitStore) -> RedisCounter:
    """The store's client: one Redis, or the primary its Sentinels name (limits.store.sentinel)."""
    credentials = _credentials(store, os.environ)
    if store.sentinel is not None:
        addresses = [split_address(a) for a in store.sentinel.addresses]
        return RedisCounter.via_sentinel([a for a in addresses if a is not None], store.sentinel.master,
                                         store.timeout.seconds, credentials=credentials)
    address = split_address(store.redis or "")
    assert address is not None  # the topology's pattern and checks
    return RedisCounter(address[0], address[1], store.timeout.seconds, credentials=credentials)


def _number(text: str | None) -> int | None:
    """A descriptor entry's non-negative integer (Envoy writes a JSON number: 17 or 17.0)."""
    if text is None or len(text) > 20:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if 0 <= value <= _MAX_ESTIMATE else None


def _client_label(table: _Table, budget: Budget, op: Op) -> str:
    """The per-key metrics' client of an op (its key: confgen:<domain>:<budget id>:<client>:...): "" for
    a shared budget, a client of the topology, else OTHER (bounded whatever the descriptor said)."""
    if not budget.per_client:
        return ""
    client = op.key.split(f":{budget.id}:", 1)[1].split(":", 1)[0]
    return client if client in table.clients else OTHER


def _estimate(budget: Budget, entries: dict[str, str], max_body: int) -> int:
    """The tokens a request can spend at most, reserved until its answer ends: its max output
    (the route's pool's max_output_tokens when it named none), and its body's prompt tokens (a
    body of unknown length, chunked: the largest one the listener accepts)."""
    output = _number(entries.get(MAX_OUTPUT_KEY))
    output = DEFAULT_MAX_OUTPUT_TOKENS if output is None else output
    body = _number(entries.get(BODY_BYTES_KEY))
    body = max_body if body is None else body
    prompt = -(-body // BYTES_PER_TOKEN)
    unit = budget.limit.unit
    estimate = output if unit == "output_tokens" else prompt if unit == "input_tokens" else output + prompt
    return max(1, min(estimate, _MAX_ESTIMATE))


_WINDOWS = {unit: seconds for seconds, unit in _UNITS.items()}


def rate_limit_headers(statuses: Sequence[Any]) -> tuple[tuple[str, str], ...]:
    """x-ratelimit-limit, -remaining and -reset (IETF draft 03) of an answer's statuses, as Envoy's rate
    limit filter writes them: the status with the least remaining names the limit and the reset, and
    every limit follows as a quota policy (`, <amount>;w=<window s>;name="<budget>"`)."""
    limited = [s for s in statuses if s.HasField("current_limit")]
    if not limited:
        return ()
    low = min(limited, key=lambda s: s.limit_remaining)  # the first of the least, as Envoy
    policy = "".join(f', {s.current_limit.requests_per_unit};w={_WINDOWS[s.current_limit.unit]}'
                     + (f';name="{s.current_limit.name}"' if s.current_limit.name else "")
                     for s in limited if s.current_limit.unit in _WINDOWS)
    return (("x-ratelimit-limit", f"{low.current_limit.requests_per_unit}{policy}"),
            ("x-ratelimit-remaining", str(low.limit_remaining)),
            ("x-ratelimit-reset", str(low.duration_until_reset.seconds)))


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
