"""Smoke test of the benchmark suite: it runs end to end and writes its report (no performance assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_bench_writes_report_with_sections(tmp_path: Path) -> None:
    """`python -m bench run --quick --only ...` exits 0 and writes report.md (machine, targets, one section
    per scenario), chart.png and results.json with every target row; it measures, it does not judge.
    `overload` runs the product as shipped (confgen render CLI + Envoy + confgen-sidecar) and vLLM Router
    through the load generator, so the headline path cannot rot; `prefix` does the same with chat
    conversations on engines with a block prefix cache, and its TTFT / NTPOT / hit-rate columns and
    its summary (gathered under Headlines) are written."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "run", "--quick", "--only", "render_scale", "overload", "prefix", "--seed",
         "3", "--out", str(out)],
        cwd=ROOT, capture_output=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = (out / "report.md").read_text()
    for section in ("## Machine", "## Targets", "## Render scale", "## Overload", "| seed | 3 |", "| envoy |",
                    "confgen render + confgen-sidecar (as shipped)", "vLLM Router power_of_two", "## Headlines",
                    "## Prefix-cache affinity", "NTPOT P99 ms/token", "prefix-cache hit", "vLLM Router cache_aware"):
        assert section in report, section
    assert (out / "chart.png").read_bytes().startswith(b"\x89PNG")
    data = json.loads((out / "results.json").read_text())
    assert set(data["scenarios"]) == {"render_scale", "overload", "prefix"}
    plain = data["scenarios"]["prefix"]["raw"]["plain"]
    assert plain["pooled"]["product"]["requests"] > 0 and plain["pooled"]["product"]["prefix_hit_rate"] is not None
    assert "samples" not in json.dumps(data)  # per-request samples stay out of results.json
    assert not data["errors"]
    for scenario in data["scenarios"].values():
        for row in scenario["targets"]:
            assert {"name", "goal", "measured", "ratio", "met"} <= set(row)


def test_unknown_scenario_is_a_usage_error(tmp_path: Path) -> None:
    """Naming a scenario that does not exist is refused before anything starts (argparse exit 2)."""
    proc = subprocess.run([sys.executable, "-m", "bench", "run", "--only", "nope", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert b"nope" in proc.stderr
    assert not (tmp_path / "report.md").exists()
