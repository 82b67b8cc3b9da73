"""The everyday kit around the commands: --version, help on every option, the pre-commit
hooks and the CI example, each run for real on the shipped examples."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from confgen import __version__
from confgen.cli import _parser as confgen_parser
from confgen.simulate._cli import build_parser as simulate_parser
from sidecar.config import parser as sidecar_parser
from tests.support.wheel import DIST_NAME, build_wheel, clean_env, fresh_venv

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    found: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(f"{name} {sub_name}", sub)

    walk("confgen", confgen_parser())
    walk("confgen simulate", simulate_parser())
    walk("confgen-sidecar", sidecar_parser())
    return found


def test_every_option_has_help_text() -> None:
    """Every flag and positional of every command says what it is for in --help."""
    missing = [
        f"{name}: {'/'.join(action.option_strings) or action.dest}"
        for name, parser in _all_parsers()
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction | argparse._HelpAction | argparse._VersionAction)
        and action.help in (None, "", argparse.SUPPRESS)
    ]
    assert missing == []


@pytest.mark.parametrize("command", [["confgen"], ["confgen", "simulate"], ["confgen-sidecar"]],
                         ids=lambda c: " ".join(c))
def test_version_on_every_command(command: list[str]) -> None:
    """`--version` prints the package version and exits 0 on every command a user runs."""
    done = subprocess.run([str(BIN / command[0]), *command[1:], "--version"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{' '.join(command)} {__version__}"


def _hooks() -> dict[str, dict[str, object]]:
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    return {hook["id"]: hook for hook in hooks}


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which(argv[0], path=str(BIN))
    assert exe is not None, f"{argv[0]} is not installed next to the test interpreter"
    return subprocess.run([exe, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def _repo_with(example: Path, tmp_path: Path) -> Path:
    """A user's repository: deploy/topology.yaml and its committed render in deploy/envoy."""
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    shutil.copy(example, deploy / "topology.yaml")
    done = _run(["confgen", "render", "deploy/topology.yaml", "-o", "deploy/envoy", "--placeholder-secrets"],
                tmp_path)
    assert done.returncode == 0, done.stderr
    return tmp_path


def test_validate_hooks_select_topologies_and_judge_them(tmp_path: Path) -> None:
    """The validate hooks pick topology files by name, pass a good one and fail a broken one (exit 1)."""
    repo = _repo_with(EXAMPLES[0], tmp_path)
    for hook_id in ("confgen-validate", "confgen-validate-envoy"):
        hook = _hooks()[hook_id]
        pattern = re.compile(str(hook["files"]))
        assert pattern.search("deploy/topology.yaml") and pattern.search("prod.topology.yml")
        assert not pattern.search("deploy/values.yaml")
        entry = shlex.split(str(hook["entry"]))
        good = _run([*entry, "deploy/topology.yaml"], repo)
        assert good.returncode == 0, good.stderr
        (repo / "deploy" / "bad-topology.yaml").write_text("version: 1\nname: x\npools: []\nlisteners: nope\n")
        bad = _run([*entry, "deploy/bad-topology.yaml"], repo)
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert "bad-topology.yaml:" in bad.stderr


def test_drift_hook_catches_a_stale_render(tmp_path: Path) -> None:
    """The drift hook, with the arguments its documentation shows, passes a fresh render and fails a stale one."""
    repo = _repo_with(EXAMPLES[1], tmp_path)
    hook = _hooks()["confgen-drift"]
    assert hook["pass_filenames"] is False
    argv = [*shlex.split(str(hook["entry"])), "deploy/topology.yaml", "--check", "deploy/envoy",
            "--placeholder-secrets"]
    assert _run(argv, repo).returncode == 0
    topo = repo / "deploy" / "topology.yaml"
    topo.write_text(topo.read_text().replace("name: ", "name: drifted-", 1))
    stale = _run(argv, repo)
    assert stale.returncode == 1, stale.stderr
    assert "differs" in stale.stderr


def _workflow_runs() -> list[list[str]]:
    workflow = yaml.safe_load((ROOT / "examples" / "ci" / "github-actions.yml").read_text())
    steps = workflow["jobs"]["validate"]["steps"]
    return [shlex.split(step["run"]) for step in steps if "run" in step]


def _workflow_commands() -> list[list[str]]:
    return [argv for argv in _workflow_runs() if argv[0] == "confgen"]


@pytest.fixture(scope="module")
def ci_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workflow's install step, run as written in a fresh virtual environment, pip told to
    find the distribution in a wheel built from this checkout (--no-index --find-links: the
    suite stays offline; the other requirements are already there, see tests.support.wheel).
    Returns that environment's bin directory, holding the `confgen` the step installed."""
    installs = [argv for argv in _workflow_runs() if argv[:2] == ["pip", "install"]]
    assert len(installs) == 1, installs
    assert DIST_NAME in installs[0][2:], f"the CI recipe must install {DIST_NAME}: {installs[0]}"
    base = tmp_path_factory.mktemp("ci")
    wheel = build_wheel(base / "dist")
    python = fresh_venv(base / "venv")
    env = clean_env(python.parent)
    done = subprocess.run([str(python), "-m", *installs[0], "--no-index", "--find-links", str(wheel.parent),
                           "--disable-pip-version-check"], capture_output=True, text=True, timeout=300, env=env,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    probe = subprocess.run(
        [str(python), "-c", "import confgen, sidecar, importlib.metadata as m;"
         f"print(confgen.__file__, sidecar.__file__, m.version({DIST_NAME!r}))"],
        capture_output=True, text=True, timeout=60, env=env, check=True, cwd=base)
    venv_dir = str(base / "venv")
    confgen_file, sidecar_file, version = probe.stdout.split()
    assert confgen_file.startswith(venv_dir) and sidecar_file.startswith(venv_dir), probe.stdout
    assert version == __version__
    for command in ("confgen", "confgen-sidecar"):
        assert (python.parent / command).is_file(), f"the install step gave no {command} command"
    return python.parent


def test_ci_install_step_installs_this_project(ci_bin: Path, tmp_path: Path) -> None:
    """`pip install confgen-llm ...` (the recipe's line) gives this project's commands, which run
    from the installed copy, not the checkout."""
    for command in ("confgen", "confgen-sidecar"):
        done = subprocess.run([str(ci_bin / command), "--version"], capture_output=True, text=True, timeout=60,
                              env=clean_env(ci_bin), cwd=tmp_path, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"{command} {__version__}"


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_ci_example_passes_on_every_example(example: Path, tmp_path: Path, ci_bin: Path) -> None:
    """Each step of the GitHub Actions example succeeds on a repository holding an example, with
    the real Envoy and nginx: the install step (ci_bin), then each confgen step run with the
    commands it installed."""
    commands = _workflow_commands()
    assert len(commands) == 3
    repo = _repo_with(example, tmp_path)
    for argv in commands:
        done = subprocess.run([str(ci_bin / argv[0]), *argv[1:]], cwd=repo, capture_output=True, text=True,
                              timeout=120, env=clean_env(ci_bin), check=False)
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout}{done.stderr}"
