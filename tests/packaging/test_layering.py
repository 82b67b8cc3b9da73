"""What a user installs confgen for never loads the test rig or the simulator.

Render, validate and the sidecar import neither `confgen.runtime` (start/stop proxies, the
test and demo rig), nor `confgen.simulate` / `confgen.demo` (the "try it without a GPU"
features), nor anything from tests/ or bench/. Checked in a fresh interpreter, after really
running each path, by reading its sys.modules.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "04-multi-model-fallback.yaml"
FORBIDDEN = ("confgen.runtime", "confgen.simulate", "confgen.demo", "tests", "bench")


def _modules_after(code: str) -> list[str]:
    """The modules loaded by running `code` in a fresh interpreter."""
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def _forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def test_entry_points_import_no_rig_and_no_simulator() -> None:
    """Importing every product entry point (CLI, renderers, verifier, sidecar) loads no rig,
    simulator, demo, tests or bench module — and the check itself sees them when imported."""
    modules = _modules_after("""
        import confgen, confgen.cli, confgen.envoy, confgen.nginx, confgen.deploy, confgen.verify
        import confgen.topology, confgen.output, confgen.schema, confgen.binaries
        import sidecar.main, sidecar.daemon, sidecar.serve.server
        import sidecar.outputs.files.publisher, sidecar.outputs.nginx.publisher
    """)
    assert "confgen.cli" in modules and "sidecar.main" in modules
    assert _forbidden(modules) == []
    # The check can fail: importing the rig is seen.
    assert _forbidden(_modules_after("import confgen.runtime")) == ["confgen.runtime"]


def test_render_and_validate_with_real_proxies_load_no_rig(tmp_path: Path) -> None:
    """`confgen render` (every target) and `confgen validate --envoy --nginx` (the real
    binaries' checks), run to completion, leave no rig or simulator module loaded."""
    modules = _modules_after(f"""
        from confgen.cli import main
        for target in ("envoy", "nginx", "kubernetes", "compose"):
            assert main(["render", {str(EXAMPLE)!r}, "-o", {str(tmp_path)!r} + "/" + target,
                         "--target", target, "--placeholder-secrets"]) == 0, target
        assert main(["validate", "--envoy", "--nginx", {str(EXAMPLE)!r}]) == 0
    """)
    assert "confgen.binaries" in modules  # the real checks ran
    assert _forbidden(modules) == []
