"""Client-side helpers shared by the simulator's HTTP tests (bounded waits only)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT = aiohttp.ClientTimeout(total=10)


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=TIMEOUT)


async def scrape(s: aiohttp.ClientSession, url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    async with s.get(url + "/metrics", headers={"Accept": "text/plain;version=0.0.4"}) as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


async def poll(check: Callable[[], Awaitable[bool]], *, timeout_s: float = 5.0, every_s: float = 0.02) -> None:
    """Wait until `check()` is true; fail after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(every_s)


async def complete(s: aiohttp.ClientSession, url: str, **body: Any) -> tuple[int, dict[str, Any], str]:
    """POST /v1/completions; returns (status, json body, x-sim-worker)."""
    body.setdefault("prompt", "hello world")
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, json.loads(await r.text()), r.headers.get("x-sim-worker", "")


async def sse_events(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> list[str]:
    """The `data:` payloads of a streamed response, in order."""
    async with s.post(url + path, json={**body, "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.text()
    assert raw.endswith("\n\n")
    events = [block for block in raw.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]
