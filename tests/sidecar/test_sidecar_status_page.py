"""GET /, the sidecar's status page (sidecar.serve.status_page): rendered by a real headless
Chromium (Debian's, offline; fails, never skips, without it) from the real app over a real Daemon
probing the simulated fleet (tests/sidecar/serve_rig.py): the DOM has every pool and worker
with its state, the screenshot shows the state colours; the answer forbids every script; every
value is escaped."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from confgen.simulate import FleetHandle
from sidecar.fleet import EndpointKey, EndpointView, PoolView, Snapshot
from sidecar.serve.status_page import render
from tests.sidecar.serve_rig import get, pick, serving, status_fleet
from tests.support.chromium import dump_dom, screenshot
from tests.support.png import colours

# the state colours of the page's stylesheet
GREEN, BLUE, RED = (0x00, 0xD2, 0x00), (0x20, 0xA0, 0xFF), (0xFF, 0x20, 0x20)


class _Tables(HTMLParser):
    """pool -> rows of endpoint cells (text, class) from the page's pool tables; every tag seen."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: dict[str, list[list[tuple[str, str]]]] = {}
        self.tags: set[str] = set()
        self._pool: str | None = None
        self._row: list[tuple[str, str]] | None = None
        self._cell: tuple[str, list[str]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.add(tag)
        if tag == "table" and "pool-table" in (a.get("class") or ""):
            self._pool = a["data-pool"] or ""
            self.pools[self._pool] = []
        elif tag == "tr" and self._pool is not None and a.get("class") == "endpoint":
            self._row = []
            self.pools[self._pool].append(self._row)
        elif tag == "td" and self._row is not None:
            self._cell = (a.get("class") or "", [])

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell[1].append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append(("".join(self._cell[1]), self._cell[0]))
            self._cell = None
        elif tag == "tr":
            self._row = None
        elif tag == "table":
            self._pool = None


@pytest.fixture
def fleet() -> Iterator[FleetHandle]:
    with status_fleet() as handle:
        yield handle


def test_headless_chromium_renders_every_pool_and_worker_with_its_state_colour(tmp_path: Path,
                                                                               fleet: FleetHandle) -> None:
    """Chromium's DOM of GET / has one table per pool of the topology with one row per worker
    (state, weight, picker in-flight as /state says), the picker's totals; no script element
    exists. The screenshot (1280x900) shows the state cells in their colours: green (HEALTHY),
    blue (DRAINING), red (UNHEALTHY), each at least a cell's worth of pixels; which also proves
    the strict CSP let the page's own stylesheet (allowed by its hash) apply."""
    async def scenario() -> tuple[str, bytes, dict[str, Any], dict[str, str], bytes, dict[str, list[str]]]:
        async with serving(tmp_path, fleet) as served:
            for _ in range(2):
                pick(served, "a conversation that goes on " * 20)
            status, headers, body = await get(served.base + "/")
            assert status == 200, body
            _, _, state = await get(served.base + "/state")
            dom = await dump_dom(served.base + "/", tmp_path / "profile-dom")
            png = await screenshot(served.base + "/", tmp_path / "profile-shot", tmp_path / "page.png")
            return dom, png, json.loads(state), headers, body, served.pools

    dom, png, state, headers, body, pools = asyncio.run(scenario())
    assert headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp and "frame-ancestors 'none'" in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert b"<script" not in body.lower()
    page = _Tables()
    page.feed(dom)
    assert "script" not in page.tags
    assert set(page.pools) == set(pools) == {"chat", "batch"}
    for name, workers in pools.items():
        rows = {row[0][0]: row for row in page.pools[name]}
        assert sorted(rows) == sorted(workers), (name, sorted(rows))
        for ep in state["pools"][name]["endpoints"]:
            row = rows[ep["worker"]]
            assert row[2] == (ep["status"], f"s {ep['status']}"), (ep["worker"], row[2])
            assert row[4][0] == (str(ep["weight"]) if ep["weight"] is not None else "-")
            if name == "chat":
                assert row[8][0] == str(state["pools"]["chat"]["picker"]["in_flight"][row[1][0]])
    states = {ep["status"] for p in state["pools"].values() for ep in p["endpoints"]}
    assert states == {"HEALTHY", "DRAINING", "UNHEALTHY"}, states
    assert 'id="picker"' in dom and "prefix hit ratio" in dom and "sent past it (cannot keep up)" in dom
    assert "each API-key client" in dom  # the per-key limit the topology declares
    seen = colours(png)
    cell = 20 * 10  # a state cell is wider and taller than this
    assert seen[GREEN] >= 3 * cell and seen[BLUE] >= cell and seen[RED] >= cell, (
        seen[GREEN], seen[BLUE], seen[RED], seen.most_common(8))
    assert len(seen) > 20  # text and table rules, not a blank page


def test_every_value_is_escaped() -> None:
    """Reasons, errors and problems come from the fleet and from Envoy; nothing in them becomes markup."""
    hostile = '"><script>alert(1)</script><img src=x onerror=alert(2)>'
    key = EndpointKey("chat", "w1:8000", "10.0.0.1", 8000)
    ep = EndpointView(key, "UNHEALTHY", hostile, None, None, None, "error", hostile, {hostile: 1})
    pool = PoolView("chat", "vllm", 0.0, 0.0, 1, 0, False, (ep,), saturated_reason=hostile, saturated=True)
    snap = Snapshot(hostile, (pool,), {}, 3, (hostile,), (hostile,), hostile)
    picker = {"streams": 1, "unpicked": {hostile: 1}, "fallbacks": 1, "bypass_percent": 0, "hit_ratio": None,
              "prefix_blocks": {"requested": 0, "matched": 0}, "index_blocks": 0,
              "pick_seconds": {"count": 0, "sum": 0.0},
              "pools": {"chat": {"picks": {hostile: 2}, "picked": 2, "in_flight": {"10.0.0.1:8000": 0}}}}
    text = render(snap, picker, None)
    assert "<script" not in text and "<img" not in text
    assert text.count("&lt;script&gt;") >= 9, text.count("&lt;script&gt;")


def test_an_endpoint_kept_only_by_the_ejection_cap_says_so() -> None:
    key = EndpointKey("chat", "w1:8000", "10.0.0.1", 8000)
    kept = EndpointView(key, "HEALTHY", "ok", 1, None, None, "error", "refused", {}, serving=False)
    snap = Snapshot("t", (PoolView("chat", "vllm", 0.0, 0.0, 1, 0, False, (kept,)),), {}, 1, (), (), None)
    assert "kept published by the ejection cap" in render(snap, None, None)
