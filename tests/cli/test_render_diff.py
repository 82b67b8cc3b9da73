"""`confgen render --check DIR --diff` says what would change, in terms a reviewer acts on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFGEN = str(Path(sys.executable).parent / "confgen")
EXAMPLE = ROOT / "examples" / "02-replicas-least-request.yaml"


def _confgen(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CONFGEN, *map(str, args)], capture_output=True, text=True, timeout=60, check=False)


def _edited(tmp_path: Path) -> Path:
    text = EXAMPLE.read_text()
    text = text.replace("10.0.1.13:8000", "10.0.1.14:8000")
    text = text.replace("      - address: 10.0.1.12:8000\n", "      - address: 10.0.1.12:8000\n        weight: 3\n")
    text = text.replace("      attempts: 2\n", "      attempts: 3\n")
    edited = tmp_path / "edited.yaml"
    edited.write_text(text)
    return edited


def test_endpoint_changes_are_named_per_worker(tmp_path: Path) -> None:
    """An endpoint file's drift is told per worker (weight change, removed, added); other JSON by field path."""
    out = tmp_path / "out"
    assert _confgen("render", EXAMPLE, "-o", out).returncode == 0
    done = _confgen("render", _edited(tmp_path), "--check", out, "--diff")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert "    worker 10.0.1.12:8000: weight 256 -> 768" in lines
    assert "    worker 10.0.1.13:8000: removed (was weight 128, HEALTHY)" in lines
    assert "    worker 10.0.1.14:8000: added (weight 128, HEALTHY)" in lines
    assert any(line.startswith("    resources[") and line.endswith("retry_policy.num_retries: 2 -> 3")
               for line in lines), lines
    assert lines[-1].endswith("differs from what " + str(tmp_path / "edited.yaml") + " renders to")


def test_text_files_get_a_unified_diff(tmp_path: Path) -> None:
    """nginx.conf and upstream files, which are text, show a unified diff of what would change."""
    out = tmp_path / "out"
    assert _confgen("render", EXAMPLE, "-o", out, "--target", "nginx").returncode == 0
    done = _confgen("render", _edited(tmp_path), "--check", out, "--diff", "--target", "nginx")
    assert done.returncode == 1
    assert "    --- upstreams/mistral-7b.conf (on disk)" in done.stderr
    assert any(line.startswith("    -") and "10.0.1.13:8000" in line for line in done.stderr.splitlines())
    assert any(line.startswith("    +") and "10.0.1.14:8000" in line for line in done.stderr.splitlines())


def test_no_drift_prints_nothing_and_diff_needs_check(tmp_path: Path) -> None:
    """Without drift --diff adds nothing (exit 0); without --check it is a usage error (exit 2)."""
    out = tmp_path / "out"
    assert _confgen("render", EXAMPLE, "-o", out).returncode == 0
    same = _confgen("render", EXAMPLE, "--check", out, "--diff")
    assert (same.returncode, same.stderr) == (0, "")
    assert _confgen("render", EXAMPLE, "-o", tmp_path / "x", "--diff").returncode == 2
