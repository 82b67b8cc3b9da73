"""Golden outputs: every example rendered for every target, checked in byte for byte.

    tests/golden/<example>/<target>/<path>      what `confgen render` writes for it

The inputs are examples/*.yaml plus tests/golden/inputs/*.yaml (topologies that are not
examples but exercise every routing and balancing rule at once).

`python -m tests.golden --update` (or `make golden`) regenerates them; `test_golden.py`
fails on any difference, so every change to what confgen emits shows up in review as a
diff of these files. API keys are the renderers' placeholders (no key is ever here), and
the config directory is fixed, so nothing depends on the machine.
"""

from __future__ import annotations

from pathlib import Path

from confgen import targets
from confgen.topology import load

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent
EXAMPLES = sorted([*(ROOT / "examples").glob("*.yaml"), *(GOLDEN / "inputs").glob("*.yaml")])
CONFIG_DIR = "/etc/confgen"  # where the files would live, for targets whose topology says nothing


def render(example: Path, target_name: str) -> dict[str, bytes]:
    """The files `example` renders to for `target_name`, with placeholder keys."""
    topo, _ = load(example)
    target = targets.get(target_name)
    return target.render(topo, target.config_dir(topo) or CONFIG_DIR, None)


def cases() -> list[tuple[Path, str]]:
    """(example, target) for every example and every registered target that can render it
    (nginx refuses global and token limits: `Target.refusals`)."""
    out = []
    for example in EXAMPLES:
        topo, _ = load(example)
        out += [(example, name) for name in targets.names() if not targets.get(name).refusals(topo)]
    return out


def golden_dir(example: Path, target_name: str) -> Path:
    return GOLDEN / example.stem / target_name


def stored(example: Path, target_name: str) -> dict[str, bytes]:
    """The checked-in files for one case, keyed by path relative to its directory."""
    base = golden_dir(example, target_name)
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}
