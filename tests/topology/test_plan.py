"""The routing plan: resolved once from the model, the one place routing rules live."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from confgen import balancing, model, targets
from confgen.plan import plan
from confgen.topology import load

ROOT = Path(__file__).resolve().parents[2]


def test_plan_orders_explicit_then_per_model_then_default_with_effective_clients() -> None:
    """Routes come in the order a proxy tries them (explicit routes, one per served name no
    route claims, the default pool); a route without its own allow list takes its pool's; a
    name served by a pool and its fallback goes to the pool whose chain holds the other."""
    topo, _ = load(ROOT / "tests/golden/inputs/routing-matrix.yaml")
    routing = plan(topo)
    assert [(r.name, r.kind, r.pool.name) for r in routing.routes] == [
        ("admin-path", "explicit", "small"),
        ("beta", "explicit", "mid"),
        ("nobody", "explicit", "hashed-cookie"),
        ("model/big-model", "model", "big"),
        ("model/chat", "model", "big"),  # big -> mid -> small all serve chat: big's chain holds them
        ("model/mid-model", "model", "mid"),
        ("model/code", "model", "mid"),
        ("model/small-model", "model", "small"),
        ("model/session-model", "model", "hashed-header"),
        ("model/secret", "model", "hashed-cookie"),
        ("model/sticky-model", "model", "hashed-cookie"),
        ("default", "default", "small"),
    ]
    by_name = {r.name: r for r in routing.routes}
    assert by_name["admin-path"].clients == ("alice",)
    assert by_name["beta"].clients == ("alice", "bob")  # mid's allow list
    assert by_name["nobody"].clients == ()  # an empty list admits nobody, and is kept as such
    assert by_name["model/big-model"].clients is None
    assert by_name["beta"].models == ("chat", "code") and by_name["admin-path"].models is None
    assert [p.name for p in routing.pool("big").chain] == ["big", "mid", "small"]
    assert routing.pool("big").next_pool is not None and routing.pool("small").next_pool is None
    assert {p.name for p in routing.pools if p.hashing} == {"hashed-header", "hashed-cookie"}
    assert routing.restricted


def test_every_policy_and_engine_kind_has_one_implementation() -> None:
    """The model's balancing policies are exactly the balancing registry's; its engine kinds
    exactly the sidecar's metric adapters (an engine added to one side only fails here, not
    at probe time); its targets are the registry's, each module naming itself."""
    from sidecar.observe.engines import ENGINE_KINDS

    assert set(get_args(model.Policy)) == {*balancing.POLICIES, balancing.AUTO}  # auto: resolved, not a row
    assert set(get_args(model.Engine)) == set(ENGINE_KINDS)
    # auto gives the picker to every engine with metrics to learn from: all but the generic one
    assert set(get_args(model.Engine)) - {"openai"} == balancing.PREDICTABLE_ENGINES
    for name in targets.names():
        assert targets.get(name).name == name


def _imports(path: Path) -> set[str]:
    """Modules `path` imports, relative ones resolved against its package."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import _checks`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_renderers_read_the_plan_never_the_validator() -> None:
    """No module of a renderer (envoy, nginx, deploy) or a target imports the validator
    (confgen._checks); the "is this a hashing policy" test is written only in the
    balancing registry."""
    renderers = [p for d in ("envoy", "nginx", "deploy", "targets") for p in (ROOT / "confgen" / d).rglob("*.py")]
    assert renderers
    for path in renderers:
        assert "confgen._checks" not in _imports(path), path
    assert "confgen._checks" in _imports(ROOT / "confgen/topology.py")  # the check sees imports
    spelled = [p for p in (ROOT / "confgen").rglob("*.py") if '("ring_hash", "maglev")' in p.read_text()]
    assert spelled == []
