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
from .errors import DeployError
from .output import write_tree
from .simulate import fleet_topology
from .topology import parse


def demo_topology(admin: int | None, port: int, workers: list[str], sidecar_port: int | None = None) -> str:
    """The demo's topology: pool `chat` of the simulated workers, Envoy's own checks fast; Envoy's admin
    on 127.0.0.1:`admin`, or (None) on its Unix socket beside the rendered files, the default."""
    return fleet_topology(
        name="demo", admin=admin, port=port, workers=workers, models=["demo-8b"], capacity=8,
        pool=["aliases: [chat]",
              "balancing: {choice_count: 2}",  # the default policy (auto): the endpoint picker
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
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # --keep names a file, or a place it may not write
            print(f"confgen demo: --keep {base}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        port, sidecar_port = runtime.free_port(), runtime.free_port()
        text = demo_topology(None, port, [f"127.0.0.1:{w.port}" for w in fleet.workers], sidecar_port)
        rendered = _render_validated(base, text)
        if rendered is None:
            return 1
        topology, out, names = rendered
        print(f"1. rendered {topology} -> {out}/: " + ", ".join(names))
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


# -- `confgen demo --prefix`: prefix affinity beside least_request -------------------------------------------

PREFIX_WORKERS = ("gpu-0", "gpu-1", "gpu-2")
CONVERSATIONS = 16
TURNS = 8
CLIENTS = 4  # conversations in flight at once, per setup


@dataclass
class Homes:
    """Which worker each conversation's turns went to, for one setup; updated from the client threads."""

    first: dict[int, str] = field(default_factory=dict)
    followups: int = 0
    home: int = 0
    served: Counter[str] = field(default_factory=Counter)
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, conversation: int, turn: int, status: int, worker: str) -> None:
        with self.lock:
            if status != 200:
                self.failed += 1
                return
            self.served[worker] += 1
            if turn == 0:
                self.first[conversation] = worker
            elif conversation in self.first:
                self.followups += 1
                self.home += worker == self.first[conversation]

    def share(self) -> float:
        return self.home / self.followups if self.followups else 0.0


def _system_prompt(conversation: int) -> str:
    """Long enough that the engine's prefix cache keys on it (the simulator keys on the first 256 characters)."""
    return (f"You are the support assistant of account {conversation}. "
            + f"Account {conversation} has this long shared context that every turn resends. " * 6)


def _conversations(url: str, homes: Homes, stop: threading.Event) -> None:
    """CONVERSATIONS growing chats of TURNS turns each, CLIENTS at a time, from plain clients (no session header)."""
    def talk(conversation: int) -> None:
        messages = [{"role": "system", "content": _system_prompt(conversation)}]
        for turn in range(TURNS):
            if stop.is_set():
                return
            messages.append({"role": "user", "content": f"Question {turn} of conversation {conversation}?"})
            status, worker = _post(url, {"model": "demo-8b", "messages": messages, "max_tokens": 16})
            homes.record(conversation, turn, status, worker)
            messages.append({"role": "assistant", "content": "An answer."})

    with ThreadPoolExecutor(max_workers=CLIENTS, thread_name_prefix="demo-chat") as pool:
        list(pool.map(talk, range(CONVERSATIONS)))


def _prefix_topology(name: str, admin: int, port: int, workers: list[str], policy: str,
                     sidecar: tuple[int, int] | None) -> str:
    tail = [f"sidecar: {{port: {sidecar[0]}, grpc_port: {sidecar[1]}}}"] if sidecar else []
    return fleet_topology(name=name, admin=admin, port=port, workers=workers, models=["demo-8b"], capacity=8,
                          pool=[f"balancing: {{policy: {policy}}}"], tail=tail)


def _render_validated(base: Path, text: str) -> tuple[Path, Path, list[str]] | None:
    """`text` written to base/topology.yaml, rendered into base/envoy and checked by the real Envoy:
    (the topology file, the Envoy directory, the files written), or None (the refusal printed)."""
    topology = base / "topology.yaml"
    topology.write_text(text)
    topo, _ = parse(text.encode(), str(topology))
    out = base / "envoy"
    try:
        files = envoy.render(topo, config_dir=str(out.resolve()))
    except DeployError as exc:  # e.g. --keep DIR too long a path for Envoy's admin socket
        print(f"confgen demo: {exc}", file=sys.stderr)
        return None
    write_tree(files, out)
    problems = runtime.validate_envoy_static(envoy.static_bootstrap(files))
    if problems:
        print("the real Envoy rejected the configuration:\n" + "\n".join(problems), file=sys.stderr)
        return None
    return topology, out, sorted(files)


def _start_envoy(stack: contextlib.ExitStack, base: Path, text: str) -> tuple[Path, runtime.EnvoyProcess] | None:
    rendered = _render_validated(base, text)
    if rendered is None:
        return None
    topology, out, _ = rendered
    return topology, stack.enter_context(runtime.EnvoyProcess(out / "bootstrap.json"))


def _picks(sidecar_url: str) -> float:
    try:
        with urllib.request.urlopen(f"{sidecar_url}/metrics", timeout=1.0) as resp:  # noqa: S310 - loopback URL
            text = resp.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("confgen_picker_picks_total{"))


def _picker_warm(chat_url: str, sidecar_url: str, deadline_s: float = 15.0) -> bool:
    """The picker has the fleet view: a request through Envoy is picked (counted), within the deadline."""
    until = time.monotonic() + deadline_s
    while time.monotonic() < until:
        _post(chat_url, {"model": "demo-8b", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1})
        if _picks(sidecar_url) > 0:
            return True
        time.sleep(0.2)
    return False


def _hits(fleet: Any) -> dict[str, tuple[int, int]]:
    return {w.name: (w.stats()["prefix_cache"]["hits"], w.stats()["prefix_cache"]["lookups"]) for w in fleet.workers}


def _prefix_table(fleets: dict[str, Any], base: dict[str, dict[str, tuple[int, int]]],
                  homes: dict[str, Homes]) -> list[str]:
    names = list(fleets)
    rows = [f"  {'worker':<8}" + "".join(f"  {name + ': served':>26} {'cache hits':>14}" for name in names)]
    now = {name: _hits(fleet) for name, fleet in fleets.items()}
    for worker in PREFIX_WORKERS:
        cells = ""
        for name in names:
            hits, lookups = (a - b for a, b in zip(now[name][worker], base[name][worker], strict=True))
            ratio = f"{100 * hits / lookups:.0f}%" if lookups else "-"
            cells += f"  {homes[name].served[worker]:>26} {f'{hits}/{lookups} {ratio}':>14}"
        rows.append(f"  {worker:<8}{cells}")
    rows.append("  follow-up turns on their conversation's first worker: " + ", ".join(
        f"{name} {100 * homes[name].share():.0f}% ({homes[name].home}/{homes[name].followups})" for name in names))
    return rows


def run_prefix_demo(keep: Path | None = None) -> int:
    """The same conversations from plain clients through two Envoys, each over its own simulated fleet of three
    workers: one balanced by confgen's endpoint picker (prefix_affinity, the sidecar beside it), one by
    least_request; a live table of each worker's requests and prefix-cache hits, and how many follow-up turns
    went back to the worker that served the conversation's first turn."""
    from .simulate import FleetSpec, WorkerSpec, run_fleet_in_thread

    workers = tuple(WorkerSpec(name=name, models=("demo-8b",), max_num_seqs=8, decode_ms=10.0)
                    for name in PREFIX_WORKERS)
    with contextlib.ExitStack() as stack:
        root = keep if keep is not None else Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="confgen-demo-")))
        fleets = {name: stack.enter_context(run_fleet_in_thread(FleetSpec(workers=workers, seed=11)))
                  for name in ("prefix_affinity", "least_request")}
        urls, sidecar_url = {}, ""
        for name, fleet in fleets.items():
            base = root / name
            try:
                base.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # --keep names a file, or a place it may not write
                print(f"confgen demo: --keep {root}: {exc.strerror or exc}", file=sys.stderr)
                return 2
            port, admin = runtime.free_port(), runtime.free_port()
            sidecar = (runtime.free_port(), runtime.free_port()) if name == "prefix_affinity" else None
            text = _prefix_topology(f"demo-{name.replace('_', '-')}", admin, port,
                                    [f"127.0.0.1:{w.port}" for w in fleet.workers], name, sidecar)
            started = _start_envoy(stack, base, text)
            if started is None:
                return 1
            topology, proxy = started
            urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
            print(f"{name}: envoy (pid {proxy.pid}) serves {urls[name]} over its own three simulated workers")
            if sidecar is not None:
                sidecar_url = stack.enter_context(_sidecar(topology, base / "envoy", sidecar[0], base / "sidecar.log"))
                if not (_wait_ready(sidecar_url) and _picker_warm(urls[name], sidecar_url)):
                    print(f"the sidecar's picker did not start; its log: {base / 'sidecar.log'}", file=sys.stderr)
                    return 1
                print(f"{name}: confgen-sidecar picks for it (Envoy ext_proc on 127.0.0.1:{sidecar[1]}); "
                      f"state {sidecar_url}/state")
        print(f"\n{CONVERSATIONS} conversations of {TURNS} turns, {CLIENTS} at a time, each turn resending the "
              "whole conversation (no session header), to both:")
        before = {name: _hits(fleet) for name, fleet in fleets.items()}
        homes = {name: Homes() for name in fleets}
        screen = Screen(sys.stdout)
        stop = threading.Event()
        threads = [threading.Thread(target=_conversations, args=(urls[name], homes[name], stop), daemon=True)
                   for name in fleets]
        for thread in threads:
            thread.start()
        until = time.monotonic() + 45.0  # bounded: the scene ends here whatever the machine's speed
        while any(t.is_alive() for t in threads) and time.monotonic() < until:
            screen.show(_prefix_table(fleets, before, homes), final=False)
            time.sleep(0.5)
        stop.set()
        for thread in threads:
            thread.join(timeout=REQUEST_TIMEOUT_S)
        screen.show(_prefix_table(fleets, before, homes), final=True)
        failed = sum(h.failed for h in homes.values())
        print(f"\n{'none failed' if not failed else f'{failed} failed'}. The picker sends each turn back to the "
              "worker holding its conversation's prefix (least_request spreads them by load).")
        if keep is not None:
            print(f"kept in {root}: per setup topology.yaml, envoy/; prefix_affinity/sidecar.log")
    print("stopped confgen-sidecar, both envoys and the simulated fleets")
    return 0
