"""A simulated fleet plus the real Envoy serving confgen's rendering of a topology for it.

Topology texts are `string.Template`s (YAML braces stay as they are):
  $port   the public listener's port
  $admin  the admin port
  $w_NAME host:port of the fleet's worker NAME
Every wait here is bounded; every load loop is bounded in count and in time.
"""

from __future__ import annotations

import http.client
import json
import string
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetHandle, FleetSpec, WorkerHandle, run_fleet_in_thread
from tests.support.envoy import request, running_envoy, wait_until

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Answer:
    """One client-side result: status, the answering worker (or "" if none), the body."""

    status: int
    worker: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Stack:
    fleet: FleetHandle
    envoy: EnvoyProcess
    port: int
    out: Path
    topology_text: str
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str = COMPLETIONS) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def worker(self, name: str) -> WorkerHandle:
        return self.fleet.worker(name)

    def post(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
        path: str = COMPLETIONS,
        timeout: float = 10.0,
    ) -> Answer:
        status, got, raw = request(self.url(path), dict(body), headers, timeout=timeout)
        return Answer(status, got.get("x-sim-worker", ""), got, raw)

    def wait_served(self, body: Mapping[str, Any], by: set[str] | None = None, timeout: float = 10.0) -> None:
        """Poll until `body` gets a 200 (from one of `by`, if given); fail loudly otherwise."""

        def ok() -> bool:
            answer = self.post(body, timeout=2.0)
            return answer.status == 200 and (by is None or answer.worker in by)

        assert wait_until(ok, timeout=timeout, interval=0.05), f"{body} never served by {by}"

    def stat(self, name: str) -> int:
        value = self.envoy.stats().get(name, 0)
        assert isinstance(value, int), (name, value)
        return value

    def host_flags(self, cluster: str) -> dict[str, str]:
        """host:port -> health_flags of one cluster, from the admin /clusters page."""
        flags: dict[str, str] = {}
        for line in self.envoy.clusters_text().splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster and parts[2] == "health_flags":
                flags[parts[1]] = parts[3]
        return flags

    def load(
        self,
        body: Mapping[str, Any],
        *,
        count: int,
        concurrency: int,
        max_seconds: float,
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
    ) -> list[tuple[float, Answer]]:
        """Send up to `count` requests from `concurrency` threads, stopping at `max_seconds`.

        Returns (seconds since start when the answer arrived, answer) in arrival order.
        A connection error counts as status 0.
        """
        start = time.monotonic()
        deadline = start + max_seconds
        results: list[tuple[float, Answer]] = []
        lock = threading.Lock()
        issued = [0]

        def run() -> None:
            while time.monotonic() < deadline:
                with lock:
                    if issued[0] >= count:
                        return
                    issued[0] += 1
                try:
                    answer = self.post(body, headers, timeout=timeout)
                except OSError:
                    answer = Answer(0, "", {}, b"")
                with lock:
                    results.append((time.monotonic() - start, answer))

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for future in [pool.submit(run) for _ in range(concurrency)]:
                future.result(timeout=max_seconds + timeout + 5)
        return results


def by_worker(answers: list[tuple[float, Answer]]) -> Counter[str]:
    return Counter(a.worker for _, a in answers if a.status == 200)


@contextmanager
def stack(
    topology: str,
    spec: FleetSpec,
    out: Path,
    secrets: Mapping[str, str] | None = None,
) -> Iterator[Stack]:
    """Start the fleet, render `topology` for its ports, and run Envoy on it."""
    with ExitStack() as stack_:
        fleet = stack_.enter_context(run_fleet_in_thread(spec))
        port, admin = free_port(), free_port()
        values = {"port": str(port), "admin": str(admin)}
        values.update({f"w_{w.name}": f"127.0.0.1:{w.port}" for w in fleet.workers})
        text = string.Template(topology).substitute(values)
        proc = stack_.enter_context(running_envoy(text, out, secrets))
        yield Stack(fleet, proc, port, out, text)


@dataclass(frozen=True)
class Stream:
    """A streamed answer as the client saw it: status, chunks with arrival times, and
    whether the body ended cleanly (a cut chunked body raises IncompleteRead)."""

    status: int
    worker: str
    started: float
    chunks: list[tuple[float, bytes]]
    complete: bool
    ended: float  # seconds from the request to the end of the body (clean or cut)

    @property
    def text(self) -> str:
        return b"".join(c for _, c in self.chunks).decode()

    @property
    def events(self) -> list[str]:
        return [e[len("data: ") :] for e in self.text.split("\n\n") if e.startswith("data: ")]


def stream(
    port: int,
    body: Mapping[str, Any],
    *,
    timeout: float,
    path: str = COMPLETIONS,
    on_first_chunk: Any = None,
) -> Stream:
    """POST a streaming request and read the body chunk by chunk as it arrives.

    `timeout` bounds every socket read; `on_first_chunk` (a callable) runs after the first
    chunk, e.g. to inject a fault mid-stream.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}),
                     {"content-type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        worker = resp.getheader("x-sim-worker", "")
        chunks: list[tuple[float, bytes]] = []
        complete = False
        try:
            while True:
                data = resp.read1(65536)
                if not data:
                    complete = True
                    break
                chunks.append((time.monotonic() - started, data))
                if len(chunks) == 1 and on_first_chunk is not None:
                    on_first_chunk()
        except http.client.IncompleteRead:
            complete = False
        return Stream(resp.status, worker, started, chunks, complete, time.monotonic() - started)
    finally:
        conn.close()
