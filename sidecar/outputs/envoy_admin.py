"""Envoy's admin API as the sidecar uses it: stats (to confirm writes), runtime (in-flight limits).

An aiohttp client with one session and a timeout on every call; None or False answers mean
Envoy could not be asked. Used by the file publisher and its limiter, and built by `main`.
Envoy's admin is reached at `unix:/path/to/envoy-admin.sock` (its Unix socket, the default: only
Envoy's user can connect) or at an `http://host:port` URL (`admin_session`). Its JSON answers are
read to at most `JSON_CAP` bytes and parsed with the nesting an answer of Envoy's has; anything else
(larger, deeper, not JSON) is an answer that could not be had (None), never an exception.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import aiohttp

from confgen.errors import ConfgenError

__all__ = ["UNIX_PREFIX", "BodyTooLarge", "EnvoyAdmin", "admin_session", "whole_body"]

UNIX_PREFIX = "unix:"
JSON_CAP = 16 << 20  # a filtered /stats or /runtime answer is kilobytes
_SOCKET_BASE = "http://envoy-admin"  # the URL's host names nothing when the connector is a Unix socket


def admin_session(admin: str, timeout: aiohttp.ClientTimeout) -> tuple[aiohttp.ClientSession, str]:
    """A session that reaches Envoy's admin at `admin` (`unix:PATH` or `http://host:port`), and the
    base URL its paths go after. Call from a running event loop (aiohttp's rule)."""
    if admin.startswith(UNIX_PREFIX):
        connector = aiohttp.UnixConnector(path=admin.removeprefix(UNIX_PREFIX))
        return aiohttp.ClientSession(connector=connector, timeout=timeout), _SOCKET_BASE
    return aiohttp.ClientSession(timeout=timeout), admin.rstrip("/")


class BodyTooLarge(ConfgenError):
    """An admin answer longer than the reader's cap."""


async def whole_body(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """Every byte of `resp`'s body (to its end), or BodyTooLarge past `cap` (never more than that read)."""
    if resp.content_length is not None and resp.content_length > cap:
        raise BodyTooLarge
    body = bytearray()
    async for chunk in resp.content.iter_chunked(256 << 10):
        body += chunk
        if len(body) > cap:
            raise BodyTooLarge
    return bytes(body)


class _NotJson(Exception):
    pass


async def _json(resp: aiohttp.ClientResponse) -> Any:
    """The answer's JSON, or _NotJson: past JSON_CAP bytes, nested past Python's recursion limit, or not
    JSON at all."""
    try:
        return json.loads(await whole_body(resp, JSON_CAP))
    except (BodyTooLarge, ValueError, RecursionError) as exc:  # ValueError: JSON's and UTF-8's errors too
        raise _NotJson from exc


class EnvoyAdmin:
    """Reads Envoy's admin stats; None answers mean Envoy could not be asked."""

    def __init__(self, admin: str, timeout_s: float = 1.0) -> None:
        self.admin = admin  # unix:PATH or http://host:port
        self.base_url = ""
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._session, self.base_url = admin_session(self.admin, self._timeout)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def stats(self, pattern: str) -> dict[str, int | str] | None:
        """Stats whose name matches the regex `pattern` (anchored by the caller)."""
        if self._session is None:
            raise RuntimeError("EnvoyAdmin used outside its async context")
        url = f"{self.base_url}/stats"
        try:
            async with self._session.get(url, params={"filter": pattern, "format": "json"}) as resp:
                if resp.status != 200:
                    return None
                body: Any = await _json(resp)
        except (aiohttp.ClientError, TimeoutError, _NotJson):
            return None
        out: dict[str, int | str] = {}
        for item in body.get("stats", []) if isinstance(body, dict) else []:
            if isinstance(item, dict) and "name" in item and "value" in item:
                value = item["value"]
                out[str(item["name"])] = value if isinstance(value, int) else str(value)
        return out

    async def runtime(self) -> dict[str, str] | None:
        """Every runtime key Envoy knows and its final value (GET /runtime)."""
        if self._session is None:
            raise RuntimeError("EnvoyAdmin used outside its async context")
        try:
            async with self._session.get(f"{self.base_url}/runtime") as resp:
                if resp.status != 200:
                    return None
                body: Any = await _json(resp)
        except (aiohttp.ClientError, TimeoutError, _NotJson):
            return None
        entries = body.get("entries", {}) if isinstance(body, dict) else {}
        if not isinstance(entries, dict):
            return None
        return {str(key): str(entry.get("final_value", "")) for key, entry in entries.items()
                if isinstance(entry, dict)}

    async def set_runtime(self, values: Mapping[str, str]) -> bool:
        """Set keys in Envoy's admin runtime layer (POST /runtime_modify); False when refused."""
        if self._session is None:
            raise RuntimeError("EnvoyAdmin used outside its async context")
        try:
            async with self._session.post(f"{self.base_url}/runtime_modify", params=dict(values)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
