"""Real llama-server processes on loopback: start N, stop each by its pid.

Each server gets a port from the OS, one thread (the machine is shared), `--metrics` and
`--slots`, and an alias as its model name. Every wait is bounded; every process started
here is stopped here, by its pid (SIGTERM, then SIGKILL if it hangs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confgen.runtime import free_port
from tests.support.envoy import wait_until

MODEL_ALIAS = "tiny-llama"
# A context this large makes the server allocate and clear a 2 GiB KV cache before it is ready:
# ~1.5 s of 503 "Loading model" on this machine, a window tests can watch (the model alone loads in ms).
LOADING_CONTEXT = 2_097_152


def http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


@dataclass
class LlamaServer:
    """One llama-server; `start()` returns once it accepts connections (the model may still load)."""

    binary: Path
    model: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    slots: int = 4
    context: int = 4096
    extra: Sequence[str] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def command(self) -> list[str]:
        return [
            str(self.binary), "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "--alias", MODEL_ALIAS, "--parallel", str(self.slots), "--ctx-size", str(self.context),
            "--threads", "1", "--threads-batch", "1", "--threads-http", "4", "--metrics", "--slots",
            "--no-webui", *self.extra,
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, "LLAMA_LOG_COLORS": "off"})
        if not wait_until(self._listening, timeout=timeout, interval=0.02):
            raise AssertionError(f"llama-server on {self.port} never listened:\n{self.log_tail()}")

    def _listening(self) -> bool:
        self._check_alive()
        try:
            return self.get("/health", timeout=2.0)[0] in (200, 503)
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            self._check_alive()
            try:
                return self.get("/health", timeout=2.0)[0] == 200
            except OSError:
                return False

        if not wait_until(ready, timeout=timeout, interval=0.05):
            raise AssertionError(f"llama-server on {self.port} not ready in {timeout}s:\n{self.log_tail()}")

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"llama-server exited {self.proc.returncode}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL, the way a crashed or OOM-killed engine disappears."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout)

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        status, _, body = http("GET", self.url + path, timeout=timeout)
        return status, body

    def metrics_text(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200, body
        return body.decode()

    def metric(self, name: str) -> float:
        """One unlabelled sample of the real /metrics, e.g. `llamacpp:requests_deferred`."""
        for line in self.metrics_text().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@contextmanager
def llama_servers(binary: Path, model: Path, tmp: Path, count: int, **options: Any) -> Iterator[list[LlamaServer]]:
    """`count` ready servers; all stopped (by pid) on exit, even when a test killed some."""
    with ExitStack() as stack:
        servers = []
        for i in range(count):
            server = LlamaServer(binary, model, tmp / f"llama-{i}.log", **options)
            stack.callback(server.stop)
            server.start()
            servers.append(server)
        for server in servers:
            server.wait_ready()
        yield servers


def wait(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    return wait_until(predicate, timeout=timeout, interval=interval)


def now() -> float:
    return time.monotonic()
