"""API key `file:` sources are read with a bound: a regular file of at most
MAX_KEY_FILE_BYTES, never a device or a FIFO (which would never end or never open),
refused with file:line:col at render and at validate (real `confgen` subprocesses)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from confgen.errors import SecretError
from confgen.secrets import MAX_KEY_FILE_BYTES, read_key_file, resolve
from confgen.topology import parse

ROOT = Path(__file__).resolve().parents[2]

TOPOLOGY = """\
version: 1
name: keys
listeners:
  - name: public
    port: 8080
pools:
  - name: alpha
    engine: vllm
    models: [a]
    workers: [127.0.0.1:8000]
auth:
  api_keys:
    - client: web
      file: {path}
"""


def _run(*args: str | Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFGEN_")}
    return subprocess.run([sys.executable, "-m", "confgen", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False, env=env, cwd=ROOT)


def _topology(tmp_path: Path, key_path: Path | str) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(TOPOLOGY.format(path=key_path))
    return path


def test_a_regular_key_file_is_read_and_stripped(tmp_path: Path) -> None:
    """A key file holding the key and a newline gives the key."""
    key = tmp_path / "key"
    key.write_text("abc.DEF-123\n")
    assert read_key_file(str(key)) == "abc.DEF-123"


def test_a_character_device_is_refused_before_any_read() -> None:
    """/dev/zero never ends: it is refused as a character device, at once, without reading."""
    started = time.monotonic()
    with pytest.raises(OSError, match="is a character device, not a regular file"):
        read_key_file("/dev/zero")
    assert time.monotonic() - started < 5


def test_a_fifo_without_writer_is_refused_without_hanging(tmp_path: Path) -> None:
    """A FIFO with no writer would block a plain open(); it is refused as a FIFO."""
    fifo = tmp_path / "key"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="is a FIFO, not a regular file"):
        read_key_file(str(fifo))


def test_a_file_past_the_cap_is_refused(tmp_path: Path) -> None:
    """A file larger than the cap is refused (a key is at most 512 characters)."""
    big = tmp_path / "key"
    big.write_bytes(b"a" * (MAX_KEY_FILE_BYTES + 1))
    with pytest.raises(OSError, match=f"larger than {MAX_KEY_FILE_BYTES} bytes"):
        read_key_file(str(big))


def test_resolve_names_the_field_for_a_device(tmp_path: Path) -> None:
    """resolve() reports the device key as auth.api_keys[0].file with the reason."""
    topo, _ = parse(TOPOLOGY.format(path="/dev/zero").encode())
    with pytest.raises(SecretError) as info:
        resolve(topo)
    assert info.value.problems == (
        ("auth.api_keys[0].file", "cannot read /dev/zero: is a character device, not a regular file"),
    )


@pytest.mark.parametrize("command", ["render", "validate"])
def test_cli_refuses_a_device_key_with_file_line_col(tmp_path: Path, command: str) -> None:
    """`render` and `validate` on a topology whose key file is /dev/zero exit 1 quickly with
    file:line:col: auth.api_keys[0].file: ... character device; render writes nothing."""
    topology = _topology(tmp_path, "/dev/zero")
    args = ["-o", tmp_path / "out"] if command == "render" else []
    result = _run(command, topology, *args)
    assert result.returncode == 1, result
    pattern = rf"^{re.escape(str(topology))}:\d+:\d+: auth\.api_keys\[0\]\.file: .*character device"
    assert re.search(pattern, result.stderr, re.M), result.stderr
    assert not (tmp_path / "out").exists()


def test_validate_refuses_a_fifo_key_and_accepts_a_missing_one(tmp_path: Path) -> None:
    """validate reads no key: a FIFO key file is an error (it would hang a plain read), a
    key file that is not on this machine is fine (render, where the key must be, checks)."""
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    result = _run("validate", _topology(tmp_path, fifo))
    assert result.returncode == 1 and "is a FIFO, not a regular file" in result.stderr, result
    result = _run("validate", _topology(tmp_path, tmp_path / "absent"))
    assert result.returncode == 0, result
