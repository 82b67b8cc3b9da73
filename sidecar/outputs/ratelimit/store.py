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
    mode c  (check: tokens, hits 0)   refused when count >= limit; counts nothing
    mode f  (force: tokens at stream end)   always counted: the tokens were spent

so a request over one budget does not eat into the others. Returned: each key's count after
the script and whether the request was refused.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from confgen.errors import ConfgenError

__all__ = ["Mode", "Op", "RedisCounter", "StoreUnavailable"]

Mode = Literal["a", "c", "f"]

_SCRIPT = """
local n = #KEYS
local cur = {}
local over = 0
for i = 1, n do
  local c = tonumber(redis.call('GET', KEYS[i]) or '0')
  cur[i] = c
  local mode = ARGV[4*i-3]
  local add = tonumber(ARGV[4*i-2])
  local lim = tonumber(ARGV[4*i-1])
  if (mode == 'a' and c + add > lim) or (mode == 'c' and c >= lim) then over = 1 end
end
local out = {}
for i = 1, n do
  local mode = ARGV[4*i-3]
  local add = tonumber(ARGV[4*i-2])
  local v = cur[i]
  if add > 0 and (mode == 'f' or (mode == 'a' and over == 0)) then
    v = redis.call('INCRBY', KEYS[i], add)
    if v == add then redis.call('EXPIRE', KEYS[i], tonumber(ARGV[4*i])) end
  end
  out[i] = v
end
out[n + 1] = over
return out
"""


class StoreUnavailable(ConfgenError):
    """Redis did not answer in time or refused (translated at the edge; the service fails open)."""


@dataclass(frozen=True, slots=True)
class Op:
    key: str
    mode: Mode
    cost: int
    limit: int
    ttl_s: int


class RedisCounter:
    """An async Redis client with a bound on every call, and the decision script."""

    def __init__(self, host: str, port: int, timeout_s: float, max_connections: int = 64) -> None:
        self.address = f"{host}:{port}"
        self.timeout_s = timeout_s
        # No retries inside the client (redis-py's default retries 3 times with backoff, which
        # would multiply the bound); the service's own backoff decides when to try again.
        self._redis = aioredis.Redis(
            host=host, port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), max_connections=max_connections,
            health_check_interval=0, client_name="confgen-sidecar-ratelimit",
        )
        self._script = self._redis.register_script(_SCRIPT)

    async def decide(self, ops: list[Op]) -> tuple[list[int], bool]:
        """(count of each key after the decision, refused) for one request's descriptors."""
        args: list[str | int] = []
        for op in ops:
            args += [op.mode, op.cost, op.limit, op.ttl_s]
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._script(keys=[op.key for op in ops], args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        values = [int(v) for v in raw]
        return values[:-1], bool(values[-1])

    async def close(self) -> None:
        await self._redis.aclose()
