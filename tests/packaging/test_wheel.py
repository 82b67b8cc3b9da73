"""The built wheel is self-contained: installed elsewhere, it renders with its own templates."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support.wheel import ROOT, build_wheel


def test_wheel_ships_templates_and_runs_from_another_directory(tmp_path: Path) -> None:
    """The wheel holds confgen/templates and the sidecar package and no file that reads tests/
    or imports tests or bench; installed into a fresh
    directory and run from an unrelated working directory, `confgen render` (Envoy and
    Nginx targets) and `confgen schema` work from the installed copy, not the checkout."""
    wheel = build_wheel(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("confgen/templates/") for n in names), names
    assert "sidecar/main.py" in names or any(n.startswith("sidecar/") for n in names)
    assert "confgen/envoy/eds.py" in names
    # Nothing installed reads the checkout: no path into tests/, no import of tests or bench.
    reads_checkout = re.compile(r"""["'/]tests/|^\s*(?:from|import)\s+(?:tests|bench)\b""", re.MULTILINE)
    with zipfile.ZipFile(wheel) as zf:
        culprits = [n for n in names if n.endswith(".py") and reads_checkout.search(zf.read(n).decode())]
    assert culprits == [], culprits
    assert not any(n.startswith(("tests/", "bench/")) for n in names), names

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60
        )

    where = run("-c", "import confgen; print(confgen.__file__)")
    assert where.stdout.strip().startswith(str(target)), where
    example = ROOT / "examples" / "04-multi-model-fallback.yaml"
    for target_name in ("envoy", "nginx"):
        out = elsewhere / target_name
        done = run(
            "-m", "confgen", "render", str(example), "-o", str(out), "--target", target_name, "--placeholder-secrets"
        )
        assert done.returncode == 0, done.stderr
        assert any(out.iterdir())
    schema = run("-m", "confgen", "schema")
    assert schema.returncode == 0 and "draft-07" in schema.stdout
