"""The `confgen` command as CI runs it (a real subprocess): exit codes 0/1/2/3, every
error printed at once, render's atomic and deterministic output, --check drift, the
schema command, secrets, and the real Envoy accepting every example."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from confgen import envoy, runtime
from confgen.topology import load

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
FIVE_ERRORS = ROOT / "tests" / "cases" / "invalid" / "five-independent-errors" / "topology.yaml"

TWO_POOLS = """\
version: 1
name: drift
listeners:
  - name: public
    port: 8080
pools:
  - name: alpha
    engine: vllm
    models: [a]
    workers: [127.0.0.1:8000]
  - name: beta
    engine: vllm
    models: [b]
    workers: [127.0.0.1:8001]
"""

WITH_KEY = TWO_POOLS + """\
auth:
  api_keys:
    - client: web
      env: CONFGEN_TEST_KEY_WEB
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFGEN_")}
    env.update(extra)
    return env


def _run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "confgen", *map(str, args)], capture_output=True, text=True,
                          timeout=60, check=False, env=env or _env(), cwd=ROOT)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write(tmp_path: Path, text: str, name: str = "topology.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- exit codes ----------------------------------------------------------------------------


def test_validate_valid_exits_0_and_says_ok() -> None:
    """`validate` on a valid file exits 0 and prints `<file>: ok` on stdout."""
    result = _run("validate", EXAMPLES[0])
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{EXAMPLES[0]}: ok\n", "")


@pytest.mark.parametrize(
    "args",
    [
        ["validate", "--bogus", "examples/01-single-box.yaml"],
        ["validate"],
        ["render", "examples/01-single-box.yaml"],
        ["render", "examples/01-single-box.yaml", "-o", "x", "--check", "y"],
        ["frobnicate"],
        [],
        ["validate", "does-not-exist.yaml"],
        ["render", "examples", "-o", "never-written"],
    ],
    ids=["unknown-flag", "missing-topology", "missing-out", "out-and-check", "unknown-command", "no-command",
         "missing-file", "directory-as-file"],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    """Bad flags, missing arguments and topology arguments that cannot be opened exit 2
    with a message on stderr, and write nothing."""
    result = _run(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() and result.stdout == ""
    assert not (ROOT / "never-written").exists()


def test_missing_envoy_binary_exits_3() -> None:
    """`validate --envoy` exits 3 (the check could not run) when CONFGEN_ENVOY names no
    binary, and says which variable to fix."""
    result = _run("validate", "--envoy", EXAMPLES[0], env=_env(CONFGEN_ENVOY="/nonexistent"))
    assert result.returncode == 3
    assert "CONFGEN_ENVOY=/nonexistent is not an executable file" in result.stderr


def test_a_check_that_cannot_run_still_reports_every_finding() -> None:
    """Found by review: with --format json, exit 3 printed nothing: the five errors of an invalid file were
    lost, and a script saw only "a tool is missing". Every file's findings are said (json and text), no file
    is called ok when a check asked for did not run, and the exit is still 3."""
    env = _env(CONFGEN_ENVOY="/nonexistent")
    result = _run("validate", "--envoy", "--format", "json", FIVE_ERRORS, EXAMPLES[0], env=env)
    assert result.returncode == 3
    report = json.loads(result.stdout)
    assert len([d for d in report if d["severity"] == "error" and d["file"] == str(FIVE_ERRORS)]) == 5, report
    text = _run("validate", "--envoy", EXAMPLES[0], FIVE_ERRORS, env=env)
    assert text.returncode == 3 and ": ok" not in text.stdout
    assert text.stderr.count(f"{FIVE_ERRORS}:") >= 5


def test_a_device_or_a_pipe_is_read_no_further_than_a_topology_may_be() -> None:
    """Found by review: `validate /dev/zero` held 8 GB before it was killed (the size check reads st_size,
    0 for a device or a pipe). It reads 4 MiB and one byte at the most, then refuses."""
    result = _run("validate", "/dev/zero")
    assert result.returncode == 1
    assert "/dev/zero:1:1: <document>: more than 4 MiB read; a topology may be at most 4 MiB" in result.stderr


def test_every_error_is_printed_at_once() -> None:
    """A file with 5 independent errors prints exactly 5 `file:line:col: path: message`
    lines in one run, sorted by place."""
    result = _run("validate", FIVE_ERRORS)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 5
    places = []
    for line in lines:
        file, row, col, rest = line.split(":", 3)
        assert file == str(FIVE_ERRORS) and ": " in rest.strip()
        places.append((int(row), int(col)))
    assert places == sorted(places)


def test_validate_json_format_and_strict_warnings(tmp_path: Path) -> None:
    """--format json lists each finding with file, line, column, path, severity and message;
    --strict turns a warning into exit 1, and in json into an error (a tool filtering on severity sees
    why the exit is 1)."""
    dns = _write(tmp_path, TWO_POOLS.replace("127.0.0.1:8001", "worker.example.internal:8001"))
    result = _run("validate", "--format", "json", dns)
    assert result.returncode == 0
    report = json.loads(result.stdout)
    assert [(r["path"], r["severity"], r["line"]) for r in report] == [("pools[1].workers", "warning", 14)]
    assert _run("validate", "--strict", dns).returncode == 1
    strict = _run("validate", "--strict", "--format", "json", dns)
    assert strict.returncode == 1
    assert [(r["path"], r["severity"]) for r in json.loads(strict.stdout)] == [("pools[1].workers", "error")]


# -- render: atomic, deterministic, stale files, drift ------------------------------------


def test_render_twice_gives_identical_bytes(tmp_path: Path) -> None:
    """Rendering the same topology into two directories (same --config-dir, which file
    xDS paths embed) gives byte-identical trees."""
    for name in ("one", "two"):
        assert _run("render", EXAMPLES[1], "-o", tmp_path / name, "--config-dir", "/etc/confgen").returncode == 0
    assert _tree(tmp_path / "one") == _tree(tmp_path / "two")
    assert "eds/mistral-7b/endpoints.json" in _tree(tmp_path / "one")


def test_render_into_existing_dir_removes_a_dropped_pool(tmp_path: Path) -> None:
    """Re-rendering a topology that no longer has a pool deletes that pool's EDS file and
    directory, keeps the directory itself (Envoy watches its inode), and nothing else
    remains that a fresh render would not write."""
    out = tmp_path / "out"
    topo = _write(tmp_path, TWO_POOLS)
    assert _run("render", topo, "-o", out).returncode == 0
    assert (out / "eds" / "beta" / "endpoints.json").is_file()
    inode = out.stat().st_ino
    topo.write_text(TWO_POOLS.split("  - name: beta")[0])
    assert _run("render", topo, "-o", out).returncode == 0
    assert not (out / "eds" / "beta").exists()
    assert out.stat().st_ino == inode
    assert _run("render", topo, "-o", tmp_path / "fresh", "--config-dir", out.resolve()).returncode == 0
    assert _tree(out) == _tree(tmp_path / "fresh")


def test_a_re_render_that_cannot_write_one_file_replaces_none(tmp_path: Path) -> None:
    """Found by review: a re-render that failed on one file (here a directory where lds.json goes; a full
    disk alike) had already replaced the files before it, leaving a mix of two renders. Every new content
    is now on disk before any file is replaced: the failure replaces nothing, leaves no temp file or
    new directory, and names the file it could not write."""
    out = tmp_path / "out"
    topo = _write(tmp_path, TWO_POOLS)
    assert _run("render", topo, "-o", out).returncode == 0
    (out / "lds.json").unlink()
    (out / "lds.json").mkdir()
    (out / "lds.json" / "x").write_text("in the way")
    before = _tree(out)
    topo.write_text(TWO_POOLS + "  - name: gamma\n    engine: vllm\n    models: [c]\n    workers: [127.0.0.1:8002]\n")
    done = _run("render", topo, "-o", out)
    # 4: the output could not be written (1 would tell a script the topology is invalid)
    assert done.returncode == 4 and "lds.json" in done.stderr and "nothing replaced" in done.stderr, done.stderr
    assert _tree(out) == before
    assert not (out / "eds" / "gamma").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_render_check_detects_drift(tmp_path: Path) -> None:
    """`render --check DIR` exits 0 on a fresh render; after an edit, a deleted file and an
    extra file it exits 1 naming each (differs/missing/extra), and writes nothing."""
    out = tmp_path / "out"
    topo = _write(tmp_path, TWO_POOLS)
    assert _run("render", topo, "-o", out).returncode == 0
    fresh = _run("render", topo, "--check", out, "--config-dir", out.resolve())
    assert fresh.returncode == 0, fresh.stderr
    (out / "cds.json").write_bytes((out / "cds.json").read_bytes() + b" ")
    (out / "eds" / "beta" / "endpoints.json").unlink()
    (out / "stray.json").write_text("{}")
    before = _tree(out)
    drift = _run("render", topo, "--check", out, "--config-dir", out.resolve())
    assert drift.returncode == 1
    assert f"{out}: differs: cds.json" in drift.stderr.splitlines()
    assert f"{out}: missing: eds/beta/endpoints.json" in drift.stderr.splitlines()
    assert f"{out}: extra:   stray.json" in drift.stderr.splitlines()
    assert _tree(out) == before


def test_a_drift_check_never_prints_an_api_key(tmp_path: Path) -> None:
    """Found by review: `render --check DIR --diff` after a key rotation printed the old and the new key
    (nginx's key map as a unified diff, Envoy's credentials as JSON values) into the CI log. The change is
    said without them: nginx's map by a count of lines, Envoy's keys by a short digest."""
    old_key, new_key = "sk-old-0123456789abcdef", "sk-new-0123456789abcdef"
    topo = _write(tmp_path, WITH_KEY)
    for target in ("nginx", "envoy"):
        out = tmp_path / f"out-{target}"
        assert _run("render", topo, "-o", out, "--target", target,
                    env=_env(CONFGEN_TEST_KEY_WEB=old_key)).returncode == 0
        drift = _run("render", topo, "--check", out, "--diff", "--target", target, "--config-dir", out.resolve(),
                     env=_env(CONFGEN_TEST_KEY_WEB=new_key))
        assert drift.returncode == 1, drift.stderr
        assert "differs" in drift.stderr
        assert old_key not in drift.stdout + drift.stderr and new_key not in drift.stdout + drift.stderr, target


def test_render_check_of_missing_dir_reports_every_file(tmp_path: Path) -> None:
    """--check against a directory that does not exist exits 1 listing every file missing."""
    result = _run("render", EXAMPLES[0], "--check", tmp_path / "nope")
    assert result.returncode == 1
    assert "missing: lds.json" in result.stderr and "missing: bootstrap.json" in result.stderr
    assert not (tmp_path / "nope").exists()


# -- schema -------------------------------------------------------------------------------


def test_schema_command_prints_the_committed_schema() -> None:
    """`confgen schema` prints exactly schema/topology.schema.json."""
    result = _run("schema")
    assert result.returncode == 0
    assert result.stdout == (ROOT / "schema" / "topology.schema.json").read_text()


# -- secrets ------------------------------------------------------------------------------


def test_render_without_the_key_env_var_fails_naming_the_field(tmp_path: Path) -> None:
    """`render` with an API key whose env var is unset exits 1 naming auth.api_keys[0].env
    and the variable at its file:line:col, and writes no output directory."""
    topology = _write(tmp_path, WITH_KEY)
    result = _run("render", topology, "-o", tmp_path / "out")
    assert result.returncode == 1
    message = "auth.api_keys[0].env: environment variable CONFGEN_TEST_KEY_WEB is not set or empty"
    assert re.search(rf"^{re.escape(str(topology))}:\d+:\d+: {re.escape(message)}$", result.stderr, re.M), result.stderr
    assert not (tmp_path / "out").exists()


def test_render_with_the_key_writes_it_mode_0600(tmp_path: Path) -> None:
    """With the env var set, the key appears in lds.json and every rendered file is 0600
    (the key is inline in Envoy's config)."""
    out = tmp_path / "out"
    result = _run("render", _write(tmp_path, WITH_KEY), "-o", out, env=_env(CONFGEN_TEST_KEY_WEB="s3cr3t-k3y-42"))
    assert result.returncode == 0, result.stderr
    assert b"s3cr3t-k3y-42" in (out / "lds.json").read_bytes()
    rendered = [p for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert rendered and {stat.S_IMODE(p.stat().st_mode) for p in rendered} == {0o600}


def test_placeholder_secrets_render_without_keys(tmp_path: Path) -> None:
    """--placeholder-secrets renders without reading keys (for CI drift checks): exit 0,
    placeholder in lds.json, and --check with the same flag agrees."""
    out = tmp_path / "out"
    topo = _write(tmp_path, WITH_KEY)
    assert _run("render", topo, "-o", out, "--placeholder-secrets").returncode == 0
    assert b"placeholder-key-web" in (out / "lds.json").read_bytes()
    check = _run("render", topo, "--check", out, "--placeholder-secrets", "--config-dir", out.resolve())
    assert check.returncode == 0, check.stderr


# -- the real Envoy -----------------------------------------------------------------------


def test_every_example_passes_validate_envoy() -> None:
    """Every example passes `confgen validate --envoy` with the real Envoy binary (which
    must be installed: a missing binary fails this test, it is never skipped)."""
    assert runtime.find_envoy().is_file()
    assert len(EXAMPLES) >= 5
    result = _run("validate", "--envoy", *EXAMPLES)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.endswith(": ok")] == [f"{p}: ok" for p in EXAMPLES]


def test_inlined_validation_catches_a_bad_endpoint() -> None:
    """The inlined static bootstrap carries EDS contents, so the real Envoy rejects a bad
    endpoint port there (plain `--mode validate` of the file bootstrap would not)."""
    topo, _ = load(EXAMPLES[0])
    files = envoy.render(topo, config_dir="/nonexistent")
    boot = envoy.static_bootstrap(files)
    cluster = next(c for c in boot["static_resources"]["clusters"] if "load_assignment" in c)
    lb = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    lb["endpoint"]["address"]["socket_address"]["port_value"] = 70000
    assert runtime.validate_envoy_static(boot) != []


def test_the_small_words_say_what_happened(tmp_path: Path) -> None:
    """`wrote 1 file` (not "files"); `render --check` says the directory is up to date on
    success (stdout, exit 0); `validate --envoy` says what the real Envoy accepted before
    `ok`; a render missing its keys points at --placeholder-secrets."""
    topo = _write(tmp_path, "version: 1\nname: one\nlisteners: [{name: l, port: 8080}]\n"
                  "pools: [{name: p, engine: vllm, models: [m], workers: ['10.0.0.1:8000']}]\n"
                  "envoy: {xds: {mode: ads, servers: ['127.0.0.1:18000']}}\n")
    wrote = _run("render", topo, "-o", tmp_path / "one")
    assert wrote.returncode == 0 and f"wrote 1 file to {tmp_path / 'one'}" in wrote.stderr, wrote.stderr
    out = tmp_path / "out"
    assert _run("render", EXAMPLES[0], "-o", out).returncode == 0
    check = _run("render", EXAMPLES[0], "--check", out)
    assert (check.returncode, check.stderr) == (0, "")
    assert check.stdout == f"{out}: up to date with {EXAMPLES[0]} (4 files)\n"
    checked = _run("validate", "--envoy", EXAMPLES[0])
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines() == [
        f"{EXAMPLES[0]}: envoy: accepted by the real Envoy on the rendered output (every listener, route and "
        "cluster, and the first 8 endpoints of each pool)", f"{EXAMPLES[0]}: ok"]
    env = {k: v for k, v in _env().items() if not k.startswith("CONFGEN_KEY_")}
    keys = _run("render", ROOT / "examples" / "04-multi-model-fallback.yaml", "-o", tmp_path / "k", env=env)
    assert keys.returncode == 1 and "--placeholder-secrets" in keys.stderr.splitlines()[-1], keys.stderr


def test_a_mistyped_control_plane_address_is_warned_about(tmp_path: Path) -> None:
    """In mode ads with a kubernetes section, a server that is not a name of the control plane
    `render --target kubernetes` creates (a typo in the namespace, another port) is a warning
    naming the right ones; the right names pass --strict."""
    text = ("version: 1\nname: fleet\nlisteners: [{name: l, port: 8080}]\nkubernetes: {namespace: inference}\n"
            "pools: [{name: p, engine: vllm, models: [m], workers: ['10.0.0.1:8000']}]\n"
            "sidecar: {grpc_tls: {cert: /etc/t/e.crt, key: /etc/t/e.key, ca: /etc/t/ca.crt}}\n"  # beyond loopback
            "envoy: {xds: {mode: ads, servers: [%s]}}\n")
    right = ["confgen-fleet-xds-0.confgen-fleet-xds.inference.svc:18000",
             "confgen-fleet-xds-1.confgen-fleet-xds.inference.svc.cluster.local:18000"]
    good = _run("validate", "--strict", _write(tmp_path, text % ", ".join(right)))
    assert good.returncode == 0, good.stderr
    wrong = ["confgen-fleet-xds-0.confgen-fleet-xds.inferenc.svc:18000",
             "confgen-fleet-xds-1.confgen-fleet-xds.inference.svc:18001"]
    bad = _run("validate", _write(tmp_path, text % ", ".join(wrong)))
    assert bad.returncode == 0
    lines = [line for line in bad.stdout.splitlines() if "warning" in line]
    assert len(lines) == 2, bad.stdout
    assert "servers[0]: warning: 'confgen-fleet-xds-0.confgen-fleet-xds.inferenc.svc' is not a name" in lines[0]
    assert "confgen-fleet-xds-0.confgen-fleet-xds.inference.svc:18000" in lines[0]
    assert "envoy.xds.servers[1]: warning: port 18001 differs" in lines[1]


def test_a_topology_from_a_named_pipe_is_read_once(tmp_path: Path) -> None:
    """Found by review: `confgen validate FIFO` opened the pipe to check it was readable (its writer's bytes
    lost), then blocked for good opening it again; its findings would have read it a third time. Each
    argument is read once: validate and render work from a pipe, and a warning is still pinned to its line."""
    import os
    import threading

    text = (ROOT / "examples" / "07-prefix-affinity.yaml").read_bytes()
    for command in (["validate"], ["render", "-o", str(tmp_path / "out")]):
        fifo = tmp_path / "topology.fifo"
        os.mkfifo(fifo)
        writer = threading.Thread(target=fifo.write_bytes, args=(text,))
        writer.start()
        try:
            done = _run(command[0], fifo, *command[1:])
        finally:
            if writer.is_alive():  # confgen never opened it: unblock the writer
                with fifo.open("rb") as fh:
                    fh.read()
            writer.join(timeout=10)
            fifo.unlink()
        assert done.returncode == 0, (command, done.stdout, done.stderr)
