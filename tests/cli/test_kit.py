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


def _workflow_commands() -> list[list[str]]:
    workflow = yaml.safe_load((ROOT / "examples" / "ci" / "github-actions.yml").read_text())
    steps = workflow["jobs"]["validate"]["steps"]
    return [shlex.split(step["run"]) for step in steps if str(step.get("run", "")).startswith("confgen ")]


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_ci_example_passes_on_every_example(example: Path, tmp_path: Path) -> None:
    """Each confgen step of the GitHub Actions example succeeds on a repository holding an example,
    with the real Envoy and nginx."""
    commands = _workflow_commands()
    assert len(commands) == 3
    repo = _repo_with(example, tmp_path)
    for argv in commands:
        done = _run(argv, repo)
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout}{done.stderr}"
