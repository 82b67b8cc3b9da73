"""The case folders: every invalid topology prints exactly its pinned diagnostics and
leaves the output directory alone; every edge-valid one loads, renders the same bytes
twice, and is accepted by the real Envoy."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from confgen import envoy, verify
from confgen.cli import main
from confgen.topology import load

CASES = Path(__file__).parent
INVALID = sorted(p for p in (CASES / "invalid").iterdir() if p.is_dir())
VALID = sorted(p for p in (CASES / "valid").iterdir() if p.is_dir())


def _expected(case: Path, topology: Path) -> list[str]:
    file = case / "expected.txt"
    if not file.exists():
        return []
    return file.read_text().replace("{file}", str(topology)).splitlines()


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>", p.stat().st_mode)
        for p in sorted(root.rglob("*"))
    }


def test_case_folders_are_complete() -> None:
    """Every invalid case pins its expected diagnostics; the folders are not empty."""
    assert len(INVALID) >= 25 and len(VALID) >= 6
    missing = [c.name for c in INVALID if not (c / "expected.txt").is_file() or not (c / "topology.yaml").is_file()]
    assert missing == []


@pytest.mark.timeout(5)
@pytest.mark.parametrize("case", INVALID, ids=lambda p: p.name)
def test_invalid_case(case: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`validate` exits 1 and prints exactly the pinned `file:line:col: path: message` lines;
    `render -o` exits 1, leaves an existing output directory byte-for-byte as it was and
    creates none where there was none."""
    topology = case / "topology.yaml"
    expected = _expected(case, topology)
    assert expected, f"{case.name}: expected.txt is empty"

    assert main(["validate", str(topology)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == expected
    assert captured.out == ""

    existing = tmp_path / "existing"
    (existing / "eds" / "old").mkdir(parents=True)
    (existing / "lds.json").write_bytes(b'{"previous": true}\n')
    (existing / "eds" / "old" / "endpoints.json").write_bytes(b"{}\n")
    before = _snapshot(existing)
    assert main(["render", str(topology), "-o", str(existing)]) == 1
    assert _snapshot(existing) == before

    fresh = tmp_path / "fresh"
    assert main(["render", str(topology), "-o", str(fresh)]) == 1
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]  # no staging directory left behind
    assert capsys.readouterr().err.splitlines() == expected * 2


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", VALID, ids=lambda p: p.name)
def test_valid_case(case: Path) -> None:
    """An edge-valid topology loads with exactly the pinned warnings (none without
    expected.txt), renders to the same bytes twice, and the real Envoy accepts the
    inlined static bootstrap of that output."""
    topology = case / "topology.yaml"
    topo, warnings = load(topology)
    assert [str(w) for w in warnings] == _expected(case, topology)
    assert all(w.severity == "warning" for w in warnings)

    first = envoy.render(topo, config_dir="/etc/confgen")
    again = envoy.render(load(topology)[0], config_dir="/etc/confgen")
    digest = {k: hashlib.sha256(v).hexdigest() for k, v in first.items()}
    assert digest == {k: hashlib.sha256(v).hexdigest() for k, v in again.items()}
    assert sorted(first) == sorted(
        ["bootstrap.json", "lds.json", "cds.json"]
        + [f"eds/{p.name}/endpoints.json" for p in topo.pools if p.discovery == "eds"]
    )
    assert verify.verify(topo, "envoy") == []
