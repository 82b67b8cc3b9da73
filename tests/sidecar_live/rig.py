"""A live rig: simulated fleet + confgen-rendered Envoy + the sidecar as a subprocess.

The sidecar runs as `python -m sidecar.main` (what the container runs), so a restart is
a real process restart and SIGTERM is a real signal. Everything binds 127.0.0.1; every
process started here is stopped here, by its pid.

`live_rig`: files mode (the sidecar writes EDS files one Envoy watches). `control_plane` +
`ads_envoy` (`ads_bootstrap` to edit one first): the ADS setup of envoy.xds.mode ads, one
sidecar serving `--serve-xds` and the Envoys started from the render's bootstrap, each with
its node id.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetHandle, FleetSpec, WorkerSpec, fleet_topology, run_fleet_in_thread
from tests.support.envoy import wait_until

REPO = Path(__file__).resolve().parents[2]


# Fast, test-sized policy: a 0.5 s cycle, no slow-start ramp, short stall floor.
FAST_ARGS = (
    "--interval", "0.5", "--jitter", "0.05", "--probe-deadline", "0.4",
    "--health", "slow_start_s=0", "--health", "stall_min_s=1.5", "--health", "stall_probes=3",
    "--health", "degraded_latency_s=0.15", "--weights", "smoothing=1.0",
    "--publish-debounce", "0.05", "--confirm-timeout", "1.0", "--watch-debounce", "0.1",
)  # fmt: skip


def topology_text(
    workers: Sequence[str], *, admin: int | None, port: int, capacity: int = 4, policy: str = "least_request",
    sidecar_port: int | None = None, listener: str = "",
) -> str:
    # The sidecar alone decides health here: no active checks, no outlier ejection.
    return fleet_topology(name="live", admin=admin, port=port, workers=workers, models=["sim-model"],
                          capacity=capacity, pool=[f"balancing: {{policy: {policy}}}", "health: {enabled: false}",
                                                   "outlier_detection: {enabled: false}"], sidecar_port=sidecar_port,
                          listener=listener)


# The sidecar's admin token in the rigs (its POST /drain and /undrain need one, loopback included).
ADMIN_TOKEN = "rig-admin-token-0123456789"


def admin_token_args(tmp: Path) -> list[str]:
    """The sidecar's flags for ADMIN_TOKEN, its file written 0600 under `tmp`."""
    path = tmp / "admin-token"
    path.write_text(ADMIN_TOKEN + "\n")
    path.chmod(0o600)
    return ["--admin-token-file", str(path)]


def http(method: str, url: str, body: Any = None, timeout: float = 5.0,
         token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP call with a JSON body (and `token` as a bearer token); (status, headers, body)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


class SidecarProcess:
    """`python -m sidecar.main ...` with its log in a file; stop() sends SIGTERM."""

    def __init__(self, args: Sequence[str], log_path: Path, listen_port: int, wrapper: Path | None = None,
                 *, cwd: Path = REPO, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{listen_port}"
        self._wrapper = wrapper
        self._cwd = cwd
        self._env = dict(os.environ) if env is None else env
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    def start(self) -> None:
        entry = [str(self._wrapper)] if self._wrapper else ["-m", "sidecar.main"]
        env = {**self._env, "PYTHONPATH": str(REPO)}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, *entry, *self.args], stdout=log, stderr=log,
                                         cwd=self._cwd, env=env)

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"sidecar exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                return self.get("/readyz")[0] == 200
            except OSError:
                return False

        if not wait_until(ready, timeout=timeout, interval=0.1):
            raise AssertionError(f"sidecar not ready in {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; SIGKILL only if it hangs (then the test fails on the code)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        self.returncode = self.proc.returncode
        self.proc = None
        return self.returncode

    def get(self, path: str) -> tuple[int, bytes]:
        status, _, body = http("GET", self.url + path, timeout=3.0)
        return status, body

    def post(self, path: str, body: Any = None) -> tuple[int, bytes]:
        """A mutating call (POST /drain, /undrain) with the rig's admin token."""
        status, _, answer = http("POST", self.url + path, body, token=ADMIN_TOKEN)
        return status, answer

    def state(self) -> dict[str, Any]:
        status, body = self.get("/state")
        assert status == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def endpoint(self, port: int, pool: str = "chat") -> dict[str, Any]:
        for ep in self.state()["pools"][pool]["endpoints"]:
            if ep["port"] == port:
                return dict(ep)
        raise KeyError(port)

    def metrics(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200
        return body.decode()

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                item = json.loads(line)
                if isinstance(item, dict):
                    out.append(item)
        return out

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@dataclass
class Rig:
    fleet: FleetHandle
    envoy: EnvoyProcess
    sidecar: SidecarProcess
    topology_path: Path
    xds_dir: Path
    port: int
    admin: int | None  # None: Envoy's admin on its Unix socket in xds_dir (the product's default)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    def send(self, max_tokens: int = 2, timeout: float = 10.0) -> tuple[int, str]:
        """One request through Envoy; (status, x-sim-worker or '-')."""
        try:
            status, headers, _ = http("POST", self.url, {"model": "sim-model", "prompt": "hi",
                                                         "max_tokens": max_tokens}, timeout=timeout)
        except OSError:
            return 0, "-"
        return status, headers.get("x-sim-worker", "-")

    def envoy_host(self, port: int) -> dict[str, str]:
        """Envoy's own view of one host of `chat` (/clusters lines), {} when absent."""
        out: dict[str, str] = {}
        prefix = f"chat::127.0.0.1:{port}::"
        for line in self.envoy.clusters_text().splitlines():
            if line.startswith(prefix):
                key, _, value = line[len(prefix):].partition("::")
                out[key] = value
        return out

    def worker_port(self, name: str) -> int:
        return self.fleet.worker(name).port


def worker_specs(names: Sequence[str], **fields: Any) -> tuple[WorkerSpec, ...]:
    return tuple(WorkerSpec(name=n, models=("sim-model",), **fields) for n in names)


@contextlib.contextmanager
def live_rig(
    tmp: Path,
    workers: Sequence[WorkerSpec],
    *,
    sidecar_args: Sequence[str] = FAST_ARGS,
    capacity: int = 4,
    policy: str = "least_request",
    wrapper: Path | None = None,
    listed: int | None = None,
    configmap: bool = False,
    worker_item: Callable[[int], str] = lambda port: f"127.0.0.1:{port}",
    prepare_xds: Callable[[Path], None] | None = None,
    extra_yaml: str = "",
    listener_yaml: str = "",
    admin_port: bool = False,
) -> Iterator[Rig]:
    """Fleet, rendered config, Envoy and the sidecar, all ready; everything stopped after.

    `listed`: only the first N workers are in the topology. `configmap`: the topology is
    mounted the way Kubernetes mounts a ConfigMap (symlinks through `..data`).
    `worker_item`: the YAML list item that names the worker listening on a port.
    `prepare_xds`: called with the xDS directory's path before anything is written there.
    `extra_yaml`: top-level topology keys appended to the rig's (e.g. `routes:`); `listener_yaml`:
    more keys of the listener (flow style, e.g. `trusted_headers: {...}`). Envoy's admin is on its Unix
    socket as the product renders it by default; `admin_port`: on a free loopback port instead.
    """
    with run_fleet_in_thread(FleetSpec(workers=tuple(workers), seed=3)) as fleet:
        port, listen = free_port(), free_port()
        admin = free_port() if admin_port else None
        chosen = fleet.workers[: listed or len(fleet.workers)]
        text = topology_text([worker_item(w.port) for w in chosen], admin=admin, port=port,
                             capacity=capacity, policy=policy, sidecar_port=listen,
                             listener=listener_yaml) + extra_yaml
        if configmap:
            topo_path = configmap_publish(tmp / "cm", text)
        else:
            topo_path = tmp / "topology.yaml"
            topo_path.write_text(text)
        xds = tmp / "envoy"
        if prepare_xds is not None:
            prepare_xds(xds)  # e.g. a small filesystem mounted there
        topo, _ = parse_topology(text.encode())
        write_tree(envoy.render(topo, config_dir=str(xds)), xds, rank=envoy.layout.write_rank)
        args = ["--topology", str(topo_path), "--xds-dir", str(xds), "--listen", f"127.0.0.1:{listen}",
                *admin_token_args(tmp), *sidecar_args]
        sidecar = SidecarProcess(args, tmp / "sidecar.log", listen, wrapper)
        with EnvoyProcess(xds / "bootstrap.json") as proxy:
            sidecar.start()
            try:
                sidecar.wait_ready()
                yield Rig(fleet, proxy, sidecar, topo_path, xds, port, admin)
            finally:
                code = sidecar.stop()
            assert code == 0, f"sidecar exited {code} on SIGTERM:\n{sidecar.log_tail()}"


@contextlib.contextmanager
def control_plane(
    topology: Path, xds: int, log_path: Path, *args: str, listen: int | None = None,
    env: dict[str, str] | None = None, clean_exit: bool = False,
) -> Iterator[SidecarProcess]:
    """The ADS control plane the Envoys of a test connect to, ready: `python -m sidecar.main
    --topology <topology> --serve-xds 127.0.0.1:<xds> --listen 127.0.0.1:<listen>`, then `args`
    (e.g. TLS flags), then FAST_ARGS; its log at `log_path`; SIGTERM on the way out.
    `listen`: the sidecar's HTTP port (default: a free one). `clean_exit`: once the test's body has
    passed, assert that the control plane exited 0 on SIGTERM."""
    listen = free_port() if listen is None else listen
    sidecar = SidecarProcess(["--topology", str(topology), "--serve-xds", f"127.0.0.1:{xds}",
                              "--listen", f"127.0.0.1:{listen}", *args, *FAST_ARGS], log_path, listen, env=env)
    sidecar.start()
    try:
        sidecar.wait_ready()
        yield sidecar
    finally:
        code = sidecar.stop()
    if clean_exit:
        assert code == 0, f"control plane exited {code} on SIGTERM:\n{sidecar.log_tail()}"


def _ads_render(text: str, out: Path) -> bytes:
    topo, _ = parse_topology(text.encode())
    return envoy.render(topo, config_dir=str(out))["bootstrap.json"]


def ads_bootstrap(text: str, out: Path) -> dict[str, Any]:
    """The bootstrap `confgen render` writes to `out` for the topology `text` in `envoy.xds.mode: ads`
    (that render's one file: the rest comes over ADS), as JSON to edit."""
    boot: dict[str, Any] = json.loads(_ads_render(text, out))
    return boot


def ads_envoy(text: str, out: Path, node: str, *, any_admin_port: bool = False) -> EnvoyProcess:
    """An Envoy of the control plane, not started (start() it, or use it as a context manager):
    the rendered ADS bootstrap of `text`, written to `out`/bootstrap.json, node id `node`
    (`--service-node`). `any_admin_port`: its admin on port 0 (EnvoyProcess reads the one it got)."""
    rendered = _ads_render(text, out)
    out.mkdir(parents=True, exist_ok=True)
    boot = out / "bootstrap.json"
    boot.write_bytes(rendered)
    if any_admin_port:
        config = json.loads(rendered)
        config["admin"]["address"]["socket_address"]["port_value"] = 0
        return EnvoyProcess(config, extra_args=["--service-node", node])
    return EnvoyProcess(boot, extra_args=["--service-node", node])


def configmap_publish(directory: Path, text: str) -> Path:
    """Write `text` the way the kubelet updates a ConfigMap volume; returns the file's path.

    A new timestamped directory, a `..data_tmp` symlink to it renamed over `..data`
    (one atomic swap), and `topology.yaml -> ..data/topology.yaml` made once.
    """
    directory.mkdir(parents=True, exist_ok=True)
    stamp = f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
    (directory / stamp).mkdir()
    (directory / stamp / "topology.yaml").write_text(text)
    tmp_link = directory / "..data_tmp"
    tmp_link.symlink_to(stamp)
    os.replace(tmp_link, directory / "..data")
    link = directory / "topology.yaml"
    if not link.is_symlink():
        link.symlink_to("..data/topology.yaml")
    return link


def poll(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    return wait_until(predicate, timeout=timeout, interval=interval)


def now() -> float:
    return time.monotonic()
