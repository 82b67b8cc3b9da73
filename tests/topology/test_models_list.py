"""The /v1/models list every target and the sidecar answer with: which names, given which
pools have a worker serving."""

from __future__ import annotations

from confgen._openai import models_list
from confgen.topology import parse

TOPOLOGY = b"""\
version: 1
name: chain
listeners: [{name: public, port: 8080}]
pools:
  - {name: big, engine: vllm, models: [big-70b], aliases: [chat], fallback: mid, workers: [10.0.0.1:8000]}
  - {name: mid, engine: vllm, models: [mid-13b], aliases: [chat], fallback: small, workers: [10.0.0.2:8000]}
  - {name: small, engine: vllm, models: [small-8b], aliases: [chat], workers: [10.0.0.3:8000]}
  - {name: embed, engine: vllm, models: [embed-1], workers: [10.0.0.4:8000]}
"""


def _ids(in_rotation: set[str] | None) -> list[str]:
    topo, _ = parse(TOPOLOGY, "chain.yaml")
    return [m["id"] for m in models_list(topo, in_rotation)["data"]]


def test_without_a_health_view_every_name_is_listed() -> None:
    """No view (render time, or the sidecar unsure): every model and alias, sorted."""
    assert _ids(None) == ["big-70b", "chat", "embed-1", "mid-13b", "small-8b"]


def test_a_name_is_listed_while_any_pool_down_its_chain_serves() -> None:
    """big falls back to mid then small: with only small serving, big, mid and small (and the
    shared alias) are still answered by a model; a pool with nothing behind it drops out."""
    assert _ids({"small"}) == ["big-70b", "chat", "mid-13b", "small-8b"]
    assert _ids({"embed"}) == ["embed-1"]
    assert _ids({"mid", "embed"}) == ["big-70b", "chat", "embed-1", "mid-13b"]
    assert _ids(set()) == []
