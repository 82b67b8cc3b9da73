"""Every example's rendered output, for every target, equals the checked-in golden files."""

from __future__ import annotations

from pathlib import Path

import pytest

from confgen.topology import load
from tests.golden import GOLDEN, cases, golden_dir, render, stored

_HOW = "run `python -m tests.golden --update` (make golden) and review the diff of tests/golden"


@pytest.mark.parametrize(("example", "target"), cases(), ids=lambda v: v.stem if isinstance(v, Path) else v)
def test_render_matches_golden(example: Path, target: str) -> None:
    """`confgen render` of this example for this target is byte for byte the checked-in output:
    same file names, same bytes (an intended change regenerates the goldens in the same commit)."""
    files = render(example, target)
    golden = stored(example, target)
    assert golden, f"no golden files for {example.name} / {target}: {_HOW}"
    assert sorted(files) == sorted(golden), f"file set differs: {_HOW}"
    differing = [rel for rel in sorted(files) if files[rel] != golden[rel]]
    assert differing == [], f"{differing} differ: {_HOW}"


def test_goldens_hold_placeholder_keys_and_no_stale_case() -> None:
    """Where an example has API keys, its goldens carry the renderers' placeholders (never a
    key read from the environment), and every golden directory is a current (example, target)
    case, so a removed example or target leaves nothing behind."""
    wanted = {golden_dir(example, target) for example, target in cases()}
    present = {d for d in GOLDEN.glob("*/*") if d.is_dir() and d.name != "__pycache__" and d.parent.name != "inputs"}
    assert present == wanted
    with_keys = 0
    rendered = cases()
    for example in {example for example, _ in rendered}:
        topo, _ = load(example)
        if topo.envoy.xds.mode == "ads":  # the control plane serves the keys (ECDS): none in the bootstrap
            assert b"placeholder-key-" not in stored(example, "envoy")["bootstrap.json"], example
            continue
        for key in topo.auth.api_keys if topo.auth else []:
            with_keys += 1
            placeholder = f"placeholder-key-{key.client}".encode()
            assert placeholder in stored(example, "envoy")["lds.json"], (example, key.client)
            if (example, "nginx") in rendered:  # nginx refuses global limits
                assert placeholder in stored(example, "nginx")["auth/clients.map"], (example, key.client)
    assert with_keys, "no example has API keys: this check checks nothing"
