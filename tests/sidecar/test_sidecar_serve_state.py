"""GET /state is strict JSON (no Infinity, no NaN) and carries the endpoint picker's figures,
over a real Daemon probing the simulated fleet (tests/sidecar/serve_rig.py)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from confgen.simulate import FleetHandle
from sidecar.serve.picker_view import picker_status
from sidecar.serve.server import finite
from tests.sidecar.serve_rig import get, pick, serving, status_fleet


def _refuse(token: str) -> NoReturn:
    raise ValueError(f"not JSON: {token}")


def strict(body: bytes) -> Any:
    """What a strict parser (JavaScript's JSON.parse) accepts: no Infinity, -Infinity or NaN."""
    return json.loads(body, parse_constant=_refuse)


@pytest.fixture
def fleet() -> Iterator[FleetHandle]:
    with status_fleet() as handle:
        yield handle


def test_state_is_strict_json_and_shows_the_pickers_figures_per_pool(tmp_path: Path, fleet: FleetHandle) -> None:
    """The engines' TTFT/TPOT histograms end in a +Inf bucket: /state writes its bound as "+Inf"
    (Prometheus's spelling), the whole answer parses strictly; the picker's section has what its
    metrics count: picks by reason per pool, streams, fallbacks, the prefix hit ratio, in-flight
    per endpoint and index blocks; /readyz is strict too."""
    async def scenario() -> tuple[bytes, bytes, dict[str, list[str]], list[str]]:
        async with serving(tmp_path, fleet) as served:
            prompt = "the same long system prompt of an agent, turn after turn " * 20
            chosen = [pick(served, prompt) for _ in range(3)]
            served.picker.metrics.unpicked.labels(reason="no_body").inc()
            _, _, state = await get(served.base + "/state")
            _, _, ready = await get(served.base + "/readyz")
            return state, ready, served.pools, chosen

    state_body, ready_body, pools, chosen = asyncio.run(scenario())
    assert b"Infinity" not in state_body and b"NaN" not in state_body
    state = strict(state_body)
    strict(ready_body)
    assert set(state["pools"]) == set(pools) == {"chat", "batch"}
    ttft = [ep["sample"]["ttft"] for p in state["pools"].values() for ep in p["endpoints"]
            if ep["sample"] and ep["sample"]["ttft"]]
    assert ttft and all(h["buckets"][-1][0] == "+Inf" for h in ttft), ttft
    picker = state["picker"]
    assert picker["streams"] == 0  # no ext_proc stream here: picks came from the Picker directly
    assert picker["unpicked"] == {"no_body": 1} and picker["fallbacks"] == 1
    assert picker["prefix_blocks"]["requested"] > 0 and 0.5 < picker["hit_ratio"] <= 1.0  # turns 2, 3 at home
    assert picker["pick_seconds"]["count"] == 3 and picker["index_blocks"] > 0
    chat = state["pools"]["chat"]["picker"]
    assert chat["picked"] == 3 and chat["picks"] == {"load": 1, "prefix": 2}, chat
    assert len(set(chosen)) == 1  # the conversation stayed home
    assert set(chat["in_flight"]) == {f"127.0.0.1:{ep['port']}" for ep in state["pools"]["chat"]["endpoints"]}
    assert state["pools"]["batch"]["picker"] is None  # least_request: not the picker's pool


def test_finite_encodes_every_non_finite_float_with_its_documented_meaning() -> None:
    value = {"a": math.inf, "b": [-math.inf, math.nan, 1.5], "c": (2, {"d": math.nan})}
    assert finite(value) == {"a": "+Inf", "b": ["-Inf", None, 1.5], "c": [2, {"d": None}]}
    json.dumps(finite(value), allow_nan=False)


def test_no_picker_means_no_picker_section() -> None:
    assert picker_status(CollectorRegistry()) is None


def test_the_picker_figures_match_a_scrape_of_the_same_registry(tmp_path: Path, fleet: FleetHandle) -> None:
    """/state and /metrics read the same counters: the picks /state shows are the scraped ones."""
    async def scenario() -> tuple[dict[str, Any] | None, str]:
        async with serving(tmp_path, fleet, cycles=1) as served:
            pick(served, "one prompt " * 40)
            served.picker.metrics.bypass.set(35)  # what the picker's bypass tick sets once Envoy holds it
            return picker_status(served.registry), generate_latest(served.registry).decode()

    status, text = asyncio.run(scenario())
    assert status is not None
    assert status["bypass_percent"] == 35 and "confgen_picker_bypass_percent 35.0" in text
    picks = status["pools"]["chat"]["picks"]
    (reason, count), = picks.items()
    assert f'confgen_picker_picks_total{{pool="chat",reason="{reason}"}} {float(count)}' in text


def test_metrics_have_no_created_series(tmp_path: Path, fleet: FleetHandle) -> None:
    """/metrics leaves out the `_created` twin prometheus_client adds to each Counter and Histogram
    child (the picker's here), for this registry only: the same registry scraped directly has them."""
    async def scenario() -> tuple[bytes, str]:
        async with serving(tmp_path, fleet, cycles=1) as served:
            pick(served, "a prompt " * 40)
            served.picker.metrics.unpicked.labels(reason="no_body").inc()
            _, _, body = await get(served.base + "/metrics")
            return body, generate_latest(served.registry).decode()

    body, direct = asyncio.run(scenario())
    text = body.decode()
    assert "confgen_picker_picks_created" in direct  # prometheus_client's default, process-wide
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert not [n for n in names if n.endswith("_created")], sorted(n for n in names if n.endswith("_created"))
    assert {"confgen_picker_picks_total", "confgen_picker_unpicked_total", "confgen_picker_pick_seconds_bucket",
            "confgen_picker_pick_seconds_count", "llm_queue_depth"} <= names
