"""`confgen demo`: the whole path on loopback, in about half a minute.

Three simulated vLLM workers (one at half speed), the built-in topology rendered for them
and checked by the real Envoy, Envoy serving it, and `confgen-sidecar` (as its own process,
default flags but a short interval) probing the workers and publishing health and weights.
Under a steady, bounded load the demo then slows one worker down and crashes another,
and prints a live per-worker table — the sidecar's state and weight, the engine's queue,
and the requests each worker served — so you can watch the fleet being re-weighted and a
dead worker evicted without a failed request. `--keep DIR` leaves the rendered config, the
topology and the logs in DIR to inspect afterwards.

Nothing leaves 127.0.0.1; every process started here is stopped here, by its pid.
confgen never imports the sidecar: the demo runs the installed `confgen-sidecar` command.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from . import envoy, runtime
from .output import write_tree
from .simulate import fleet_topology
from .topology import parse


def demo_topology(admin: int, port: int, workers: list[str], sidecar_port: int | None = None) -> str:
    """The demo's topology: pool `chat` of the simulated workers, Envoy's own checks fast."""
    return fleet_topology(
        name="demo", admin=admin, port=port, workers=workers, models=["demo-8b"], capacity=8,
        pool=["aliases: [chat]",
              "balancing: {policy: least_request, choice_count: 2}",
              "health: {interval: 1s, timeout: 500ms, unhealthy_threshold: 2, no_traffic_interval: 1s}",
              "outlier_detection: {consecutive_gateway_failure: 2, interval: 1s, base_ejection_time: 10s}"],
        tail=["last_resort: {kind: error, status: 503, message: Every demo worker is down.}"],
        sidecar_port=sidecar_port,
    )


WORKERS = (("a100-0", 1.0), ("a100-1", 1.0), ("a10-slow", 0.5))
SIDECAR_INTERVAL_S = 0.5
CONCURRENCY = 6
REQUEST_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Phase:
    title: str
    seconds: float
    slow: tuple[str, float] | None = None  # (worker, factor): its engine steps take factor x longer
    crash: str | None = None


PHASES = (
    Phase("steady load over three workers (a10-slow runs at half speed)", 6.0),
    Phase("a100-1 slows down 4x (a throttling GPU)", 8.0, slow=("a100-1", 4.0)),
    Phase("a100-0 crashes", 6.0, crash="a100-0"),
)


@dataclass
class Tally:
    """What the load has seen so far; updated from the load threads under a lock."""

    served: Counter[str] = field(default_factory=Counter)
    failed: Counter[int] = field(default_factory=Counter)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, status: int, worker: str) -> None:
        with self.lock:
            self.sent += 1
            if status == 200:
                self.served[worker] += 1
            else:
                self.failed[status] += 1


def _post(url: str, body: dict[str, object]) -> tuple[int, str]:
    req = urllib.request.Request(  # noqa: S310 - a loopback URL built here
        url, data=json.dumps(body).encode(), method="POST", headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:  # noqa: S310 - loopback URL
            resp.read()
            return resp.status, resp.headers.get("x-sim-worker", "?")
    except urllib.error.HTTPError as err:
        return err.code, "-"
    except OSError:
        return 0, "-"


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 - loopback URL built here
            data = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Load:
    """CONCURRENCY closed loops of completions until `stop`, bounded by `max_requests`."""

    def __init__(self, url: str, tally: Tally, max_requests: int) -> None:
        self._url, self._tally, self._max = url, tally, max_requests
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="demo-load")

    def __enter__(self) -> Load:
        for i in range(CONCURRENCY):
            self._pool.submit(self._loop, i)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)

    def _loop(self, index: int) -> None:
        n = 0
        while not self._stop.is_set() and self._tally.sent < self._max:
            body = {"model": "chat", "prompt": f"Loop {index} asks question {n}.", "max_tokens": 24}
            self._tally.record(*_post(self._url, body))
            n += 1


def _table(state: dict[str, Any] | None, fleet: Any, speeds: dict[str, float], tally: Tally) -> list[str]:
    endpoints = {ep["worker"]: ep for ep in (state or {}).get("pools", {}).get("chat", {}).get("endpoints", [])}
    rows = [f"  {'worker':<10} {'speed':>5}  {'state':<10} {'weight':>6}  {'running':>7} {'waiting':>7}  "
            f"{'served':>6}"]
    for worker, (name, _) in zip(fleet.workers, WORKERS, strict=True):
        speed = speeds[name]
        ep = endpoints.get(f"127.0.0.1:{worker.port}", {})
        sample = ep.get("sample") or {}
        running = sample.get("running")
        waiting = sample.get("waiting")
        rows.append(
            f"  {name:<10} {speed:>4g}x  {str(ep.get('status', '?')).lower():<10} {ep.get('weight', '-')!s:>6}  "
            f"{'-' if running is None else int(running):>7} {'-' if waiting is None else int(waiting):>7}  "
            f"{tally.served[name]:>6}"
        )
    failed = sum(tally.failed.values())
    rows.append(f"  requests sent {tally.sent}, failed {failed}"
                + (f" ({dict(tally.failed)})" if failed else ""))
    return rows


class Screen:
    """Redraws the table in place on a terminal; prints it once per phase otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._live = stream.isatty()
        self._drawn = 0

    def show(self, lines: list[str], final: bool) -> None:
        if not self._live and not final:
            return
        if self._live and self._drawn:
            self._stream.write(f"\x1b[{self._drawn}F\x1b[J")
        self._stream.write("\n".join(lines) + "\n")
        self._stream.flush()
        self._drawn = 0 if final else len(lines)


def _sidecar_command() -> str:
    found = shutil.which("confgen-sidecar", path=str(Path(sys.executable).parent)) or shutil.which("confgen-sidecar")
    if found is None:
        raise FileNotFoundError("confgen-sidecar is not installed next to confgen")
    return found


@contextlib.contextmanager
def _sidecar(topology: Path, xds_dir: Path, port: int, log: Path) -> Iterator[str]:
    with log.open("wb") as sink:
        proc = subprocess.Popen(  # the installed command, loopback only
            [_sidecar_command(), "--topology", str(topology), "--xds-dir", str(xds_dir),
             "--interval", str(SIDECAR_INTERVAL_S), "--listen", f"127.0.0.1:{port}", "--log-format", "text"],
            stdout=sink, stderr=subprocess.STDOUT,
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            runtime.stop_process(proc)


def _wait_ready(sidecar_url: str, deadline_s: float = 10.0) -> bool:
    until = time.monotonic() + deadline_s
    while time.monotonic() < until:
        state = _get_json(f"{sidecar_url}/state")
        if state is not None and state.get("ready") and state.get("cycles", 0) >= 2:
            return True
        time.sleep(0.2)
    return False


def run_demo(requests: int, keep: Path | None = None) -> int:
    from .simulate import FleetSpec, WorkerSpec, run_fleet_in_thread

    max_requests = max(30, min(requests, 5000))
    workers = tuple(
        WorkerSpec(name=name, models=("demo-8b", "chat"), speed=speed, max_num_seqs=8, decode_ms=15.0)
        for name, speed in WORKERS
    )
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(run_fleet_in_thread(FleetSpec(workers=workers, seed=7)))
        base = keep if keep is not None else Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="confgen-demo-")))
        base.mkdir(parents=True, exist_ok=True)
        port, admin, sidecar_port = runtime.free_port(), runtime.free_port(), runtime.free_port()
        text = demo_topology(admin, port, [f"127.0.0.1:{w.port}" for w in fleet.workers], sidecar_port)
        topology = base / "topology.yaml"
        topology.write_text(text)
        topo, _ = parse(text.encode(), str(topology))
        out = base / "envoy"
        files = envoy.render(topo, config_dir=str(out.resolve()))
        write_tree(files, out)
        print(f"1. rendered {topology} -> {out}/: " + ", ".join(sorted(files)))
        problems = runtime.validate_envoy_static(envoy.static_bootstrap(files))
        if problems:
            print("the real Envoy rejected the configuration:\n" + "\n".join(problems), file=sys.stderr)
            return 1
        print("2. the real Envoy accepts it (envoy --mode validate on the inlined config)")
        proxy = stack.enter_context(runtime.EnvoyProcess(out / "bootstrap.json"))
        url = f"http://127.0.0.1:{port}/v1/completions"
        print(f"3. envoy (pid {proxy.pid}) serves {url}; admin {proxy.admin_url}")
        sidecar_url = stack.enter_context(_sidecar(topology, out, sidecar_port, base / "sidecar.log"))
        if not _wait_ready(sidecar_url):
            print(f"the sidecar did not become ready; its log: {base / 'sidecar.log'}", file=sys.stderr)
            return 1
        print(f"4. confgen-sidecar probes every {SIDECAR_INTERVAL_S}s; its state: {sidecar_url}/state, "
              f"metrics: {sidecar_url}/metrics")
        tally = Tally()
        screen = Screen(sys.stdout)
        speeds = dict(WORKERS)
        with Load(url, tally, max_requests):
            for number, phase in enumerate(PHASES, start=1):
                print(f"\n-- phase {number}/{len(PHASES)}: {phase.title}")
                if phase.slow is not None:
                    name, factor = phase.slow
                    fleet.worker(name).set_fault("slow", factor=factor)
                    speeds[name] /= factor
                if phase.crash is not None:
                    fleet.worker(phase.crash).crash()
                until = time.monotonic() + phase.seconds
                while time.monotonic() < until and tally.sent < max_requests:
                    screen.show(_table(_get_json(f"{sidecar_url}/state"), fleet, speeds, tally), final=False)
                    time.sleep(0.5)
                screen.show(_table(_get_json(f"{sidecar_url}/state"), fleet, speeds, tally), final=True)
        failed = sum(tally.failed.values())
        verdict = "none failed" if not failed else f"{failed} failed: {dict(tally.failed)}"
        print(f"\n{tally.sent} requests through Envoy, {verdict}. Served per worker: "
              + ", ".join(f"{name} {tally.served[name]}" for name, _ in WORKERS))
        if keep is not None:
            print(f"kept in {base}: topology.yaml, envoy/ (what the sidecar last published), sidecar.log")
    print("stopped confgen-sidecar, envoy and the simulated fleet")
    return 0
