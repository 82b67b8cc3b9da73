"""The README's quickstart Envoy command runs as written, beside another Envoy on the same host."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quickstart_envoy_lines() -> list[str]:
    block = re.search(r"## Quickstart.*?```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None
    return [line.split(" #", 1)[0].strip() for line in block.group(1).splitlines() if line.startswith("envoy ")]


def test_the_quickstart_envoy_keeps_off_the_shared_hot_restart_base_id(tmp_path: Path) -> None:
    """`envoy -c out/bootstrap.json` alone takes hot-restart base-id 0, so a second Envoy on the host (another
    project, a Compose stack, a test) fails to start; the quickstart says --disable-hot-restart as the Compose
    render does (it did not). The line, as written, is accepted by the real Envoy (--mode validate) on what the
    quickstart's render writes."""
    (line,) = quickstart_envoy_lines()
    argv = shlex.split(line)
    assert "--disable-hot-restart" in argv or "--base-id" in argv, line
    example = ROOT / "examples/02-replicas-least-request.yaml"
    done = subprocess.run([sys.executable, "-m", "confgen", "render", str(example), "-o", "out/"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    envoy = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    checked = subprocess.run([envoy, *argv[1:], "--mode", "validate"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stderr[-2000:]
