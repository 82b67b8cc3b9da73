"""Counting in Redis: fixed windows, one atomic Lua script per decision.

Why fixed windows (as envoyproxy/ratelimit counts): one counter per (budget, client, model,
window) that every sidecar of the fleet increments, expiring with its window; the answer's
`x-ratelimit-reset` is exact; a budget admits exactly its amount per window whatever the
number of Envoys. A sliding or GCRA limiter would smooth the burst at a window's edge (up to
twice the amount across the boundary) at the cost of more state per key; LLM budgets are
quotas per minute/hour/day, where users expect the fixed calendar window.

The script decides every descriptor of one request at once, atomically:

    mode a  (admit: requests)   refused when count + cost > limit; counted only if the whole
                                request is admitted (a refused request costs nothing anywhere)
    mode c  (check: tokens, hits 0, no request id)   refused when count >= limit
    mode r  (reserve: tokens, hits 0, with the request's id)   refused when count + the
                                tokens reserved by requests in flight >= limit; else the
                                request's estimate is reserved under its id until its answer
    mode f  (charge: tokens at stream end, the answer's usage)   counted (the tokens were
                                spent), the request's reservation released
    (modes f and d with a charge id: applied once; a replay of a call that timed out after
    Redis ran it finds the id's mark, kept CHARGE_MARK_S, and changes nothing)
    mode d  (done: tokens at stream end, after mode f in the same call)   the reservation
                                still there means the answer had no usage (a stream without
                                include_usage, an error, a cancel): its estimate is counted
                                and released. No reservation: nothing (a refused request, or
                                mode f already settled it).

Reservations make a token budget hold to T + one request: a request is admitted only while
the tokens spent plus those reserved by the requests in flight stay under the budget, and its
estimate (max_tokens, plus the body's length / 4 for prompt tokens) bounds what it spends. A
request refused by any budget reserves nothing, so its end charges nothing. Reservations live
in a hash per budget (and client, model), not per window (a request admitted in one window
may end in the next), as request id -> "estimate:deadline", with their running total (field
"#total") and a sorted set of deadlines beside it (<hash>:z); one past its deadline (its answer
never came) is dropped from the total when the budget is next checked. A check costs O(log n)
in the reservations held, not a scan of them. (The keys are passed in ARGV, fine for one
Redis, not for Redis Cluster.) Returned: each counter after the script, the tokens reserved
beside it, whether the request was refused, what each op added to its counter, and for a
charge whose id was applied already what that earlier call added (its mark keeps it): the
service's per-key tokens charged count each charge once, also when the call that applied it
timed out and the journal's replay finds it done.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from confgen.errors import ConfgenError

__all__ = ["Credentials", "Decision", "Mode", "Op", "RedisCounter", "StoreRefused", "StoreUnavailable"]


@dataclass(frozen=True)
class Credentials:
    """What the sidecar authenticates to Redis with (AUTH [username] password); repr hides the password."""

    username: str | None
    password: str = field(repr=False)

Mode = Literal["a", "c", "r", "f", "d"]

_SCRIPT = """
local now = tonumber(ARGV[1])
local n = #KEYS
local function held_in(rkey)
  -- the running total of the reservations held, after dropping those past their deadline
  -- (the deadlines' sorted set finds them: O(log n) a check, not a scan of every reservation)
  local zkey = rkey .. ':z'
  local expired = redis.call('ZRANGEBYSCORE', zkey, '-inf', '(' .. now, 'LIMIT', 0, 256)
  for _, rid in ipairs(expired) do
    local had = redis.call('HGET', rkey, rid)
    if had then
      local est = string.match(had, '^(%d+):')
      if est then redis.call('HINCRBY', rkey, '#total', -tonumber(est)) end
      redis.call('HDEL', rkey, rid)
    end
    redis.call('ZREM', zkey, rid)
  end
  return math.max(0, tonumber(redis.call('HGET', rkey, '#total') or '0'))
end
local function release(rkey, rid)
  -- drop a reservation; its estimate and deadline, or nil when it was not held
  local had = redis.call('HGET', rkey, rid)
  if not had then return nil, nil end
  redis.call('HDEL', rkey, rid)
  redis.call('ZREM', rkey .. ':z', rid)
  local e, deadline = string.match(had, '^(%d+):(%d+)$')
  if e == nil then return nil, nil end
  redis.call('HINCRBY', rkey, '#total', -tonumber(e))
  return tonumber(e), tonumber(deadline)
end
local cur, held, added, earlier = {}, {}, {}, {}
local over = 0
for i = 1, n do
  local b = 1 + 9 * (i - 1)
  local mode, add, lim, rkey = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), ARGV[b + 7]
  local c = tonumber(redis.call('GET', KEYS[i]) or '0')
  local h = 0
  if mode == 'r' then h = held_in(rkey) end
  cur[i], held[i] = c, h
  if (mode == 'a' and c + add > lim) or (mode == 'c' and c >= lim) or (mode == 'r' and c + h >= lim) then
    over = 1
  end
end
local out = {}
for i = 1, n do
  local b = 1 + 9 * (i - 1)
  local mode, add, ttl, rid = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 4]), ARGV[b + 5]
  local est, rkey, hold, cid = tonumber(ARGV[b + 6]), ARGV[b + 7], tonumber(ARGV[b + 8]), ARGV[b + 9]
  local mark = nil  -- a charge's id mark (only charges carry an id)
  earlier[i] = 0
  if cid ~= '' and (mode == 'f' or mode == 'd') then
    mark = 'confgen-charged:' .. rkey .. ':' .. cid
    if not redis.call('SET', mark, '=0', 'NX', 'EX', CHARGE_MARK_S) then
      -- this charge was applied already (a call that timed out after Redis ran it, then replayed):
      -- the mark holds what that call added
      earlier[i] = tonumber(string.match(redis.call('GET', mark) or '', '^=(%d+)$') or '0')
      mode, add = 'x', 0
    end
  end
  if mode == 'd' and rid ~= '' then
    local e, deadline = release(rkey, rid)
    if e ~= nil and deadline >= now then add = e end
  end
  local v = cur[i]
  added[i] = 0
  if add > 0 and (mode == 'f' or mode == 'd' or (mode == 'a' and over == 0)) then
    v = redis.call('INCRBY', KEYS[i], add)
    if v == add then redis.call('EXPIRE', KEYS[i], ttl) end
    added[i] = add
    if mark then redis.call('SET', mark, '=' .. add, 'EX', CHARGE_MARK_S) end
  end
  if mode == 'r' and over == 0 and est > 0 then
    local before = release(rkey, rid)  -- the same request checked again: one reservation
    if before ~= nil then held[i] = held[i] - before end
    redis.call('HSET', rkey, rid, est .. ':' .. (now + hold))
    redis.call('ZADD', rkey .. ':z', now + hold, rid)
    redis.call('HINCRBY', rkey, '#total', est)
    if redis.call('TTL', rkey) < hold then  -- the longest hold keeps the hash (never shortened)
      redis.call('EXPIRE', rkey, hold)
      redis.call('EXPIRE', rkey .. ':z', hold)
    end
    held[i] = held[i] + est
  elseif mode == 'f' and rid ~= '' then
    release(rkey, rid)
  end
  out[2 * i - 1] = v
  out[2 * i] = held[i]
end
out[2 * n + 1] = over
for i = 1, n do
  out[2 * n + 1 + i] = added[i]
  out[3 * n + 1 + i] = earlier[i]
end
return out
"""


CHARGE_MARK_S = 300  # how long a charge's id is remembered: a replay later than this may count it twice
_SCRIPT = _SCRIPT.replace("CHARGE_MARK_S", str(CHARGE_MARK_S))


class StoreUnavailable(ConfgenError):
    """Redis did not answer in time or refused (translated at the edge; the service fails open)."""


class StoreRefused(StoreUnavailable):
    """Redis answered and refused this call for what it touches (a key of another type, a count out of
    range): the store is up, and the same call would be refused again (a journal entry is dropped, not
    retried for ever)."""


# An error reply Redis gives for the call itself ("ERR ...", "WRONGTYPE ..."); the others (OOM, BUSY,
# READONLY, LOADING, MASTERDOWN, NOREPLICAS, ...) are the server's state and pass
_REFUSAL = ("ERR ", "WRONGTYPE ")


@dataclass(frozen=True, slots=True)
class Op:
    key: str
    mode: Mode
    cost: int
    limit: int
    ttl_s: int
    request_id: str = ""  # modes r, f, d: the request the reservation belongs to
    estimate: int = 0  # mode r: the tokens reserved until the answer's usage replaces them
    reservations: str = ""  # modes r, f, d: the hash of the budget's reservations
    hold_s: int = 0  # mode r: how long a reservation may wait for its answer
    charge_id: str = ""  # modes f, d: applied at most once (a replayed charge Redis already ran is skipped)


@dataclass(frozen=True, slots=True)
class Decision:
    counts: list[int]  # each counter after the script
    reserved: list[int]  # tokens reserved beside each counter by requests in flight
    refused: bool
    added: list[int] = field(default_factory=list)  # what each op added to its counter
    earlier: list[int] = field(default_factory=list)  # a charge applied already: what its earlier call added


class RedisCounter:
    """An async Redis client with a bound on every call, and the decision script.

    `RedisCounter(host, port, timeout)`: one Redis. `RedisCounter.via_sentinel(addresses, master,
    timeout)`: the primary the Sentinels name (redis-py's SentinelConnectionPool asks them on every new
    connection; a connection to a primary that failed is dropped by its error, so the call after the
    service's backoff connects to the primary the Sentinels promoted). The script runs on the primary
    only: a replica would refuse its writes."""

    def __init__(self, host: str, port: int, timeout_s: float, max_connections: int = 64,
                 credentials: Credentials | None = None) -> None:
        # No retries inside the client (redis-py's default retries 3 times with backoff, which
        # would multiply the bound); the service's own backoff decides when to try again.
        options = _client_options(timeout_s, max_connections, credentials)
        self._setup(aioredis.Redis(host=host, port=port, **options), f"{host}:{port}", timeout_s)

    def _setup(self, client: aioredis.Redis, address: str, timeout_s: float,
               sentinel: Sentinel | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._redis = client
        self._sentinel = sentinel
        self._script = self._redis.register_script(_SCRIPT)

    @classmethod
    def via_sentinel(cls, addresses: list[tuple[str, int]], master: str, timeout_s: float,
                     max_connections: int = 64, credentials: Credentials | None = None) -> RedisCounter:
        """The primary of `master` as the Sentinels at `addresses` see it (each asked within `timeout_s`);
        `credentials` are sent to the primary, not to the Sentinels."""
        # redis-py types these from 8.2 on and not before: called untyped, mypy passes on either
        untyped_sentinel: Any = Sentinel
        untyped_retry: Any = Retry
        sentinel: Sentinel = untyped_sentinel(addresses, sentinel_kwargs={
            "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "retry": untyped_retry(NoBackoff(), 0)})
        client = sentinel.master_for(master, **_client_options(timeout_s, max_connections, credentials))
        counter = cls.__new__(cls)
        names = ",".join(f"{h}:{p}" for h, p in addresses)
        counter._setup(client, f"sentinel {master}@{names}", timeout_s, sentinel)
        return counter

    async def decide(self, ops: list[Op], now: float) -> Decision:
        """The decision on one request's descriptors (see the module's docstring); `now`: the
        wall clock (reservation deadlines)."""
        args: list[str | int] = [int(now)]
        for op in ops:
            args += [op.mode, op.cost, op.limit, op.ttl_s, op.request_id, op.estimate, op.reservations, op.hold_s,
                     op.charge_id]
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._script(keys=[op.key for op in ops], args=args)
        except ResponseError as exc:
            kind = StoreRefused if str(exc).startswith(_REFUSAL) else StoreUnavailable
            raise kind(f"{type(exc).__name__}: {exc}") from exc
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        values = [int(v) for v in raw]
        n = len(ops)
        return Decision(values[0:2 * n:2], values[1:2 * n:2], bool(values[2 * n]), values[2 * n + 1:3 * n + 1],
                        values[3 * n + 1:])

    async def ping(self) -> None:
        """One PING within the bound; StoreUnavailable when Redis does not answer it."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._redis.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._redis.aclose()
        if self._sentinel is not None:
            for client in self._sentinel.sentinels:
                await client.aclose()


def _client_options(timeout_s: float, max_connections: int, credentials: Credentials | None) -> dict[str, Any]:
    auth = {"username": credentials.username, "password": credentials.password} if credentials else {}
    return {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0),
            "max_connections": max_connections, "health_check_interval": 0,
            "client_name": "confgen-sidecar-ratelimit", **auth}
