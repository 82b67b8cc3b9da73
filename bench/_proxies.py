"""The proxies under test: Envoy rendered by confgen from a topology, the sidecar, and the peer vLLM Router.

`user_topology` + `render_cli` are the product path of the headline rows: the topology a
user writes for the fleet (the defaults, nothing tuned), rendered by `confgen render` (the
CLI, as its own process), the output used unmodified. `render` (the Python API, with the
bench's PoolConfig) serves the scenarios that set pool fields on purpose (failover, reload,
overhead); `lift_circuit_breakers` is only for rows labelled as diagnostics.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confgen import envoy, runtime
from confgen.output import write_tree
from confgen.runtime import stop_process
from confgen.topology import parse

POOL = "chat"
MODEL = "sim-model"


@dataclass(frozen=True)
class PoolConfig:
    policy: str = "least_request"  # round_robin | least_request | ring_hash
    choice_count: int = 2
    capacity: int = 8
    health_interval: str = "1s"
    outlier: str = "{consecutive_gateway_failure: 2, interval: 1s, base_ejection_time: 10s}"
    retries: str = "{attempts: 2}"
    lift_circuit_breakers: bool = False


def topology_yaml(workers: Sequence[tuple[str, int, int]], cfg: PoolConfig, port: int, admin: int) -> str:
    """A one-pool topology; workers are (host, port, capacity)."""
    balancing = f"{{policy: {cfg.policy}, choice_count: {cfg.choice_count}}}"
    if cfg.policy == "ring_hash":
        balancing = "{policy: ring_hash, hash_on: {header: x-session-id}, hash_balance_factor: 150}"
    pool = (f"    capacity: {cfg.capacity}\n    balancing: {balancing}\n"
            f"    health: {{interval: {cfg.health_interval}, timeout: 500ms, unhealthy_threshold: 2, "
            f"no_traffic_interval: 1s}}\n    outlier_detection: {cfg.outlier}\n    retries: {cfg.retries}\n")
    return _one_pool(workers, port, admin, pool)


# The bench's load generator stands for the gateway in front of Envoy that sets the class header.
TRUSTED = ", trusted_headers: {names: [x-tier], from: [127.0.0.1/32]}"


def _one_pool(workers: Sequence[tuple[str, int, int]], port: int, admin: int, pool_fields: str,
              grpc_port: int | None = None, routes: str = "", socket_dir: str | None = None) -> str:
    """The bench's one-pool topology: `pool_fields` (indented YAML lines) between models and workers;
    `grpc_port` sets sidecar.grpc_port and `socket_dir` sidecar.grpc_socket_dir; `routes`: a top-level
    `routes:` list in flow style."""
    lines = "\n".join(f"      - {{address: '{h}:{p}', capacity: {c}}}" for h, p, c in workers)
    sockets = f", grpc_socket_dir: {socket_dir}" if socket_dir is not None else ""
    link = f"sidecar: {{grpc_port: {grpc_port}{sockets}}}\n" if grpc_port is not None else ""
    return f"""\
version: 1
name: bench
admin: {{address: 127.0.0.1, port: {admin}}}
{link}listeners:
  - {{name: public, address: 127.0.0.1, port: {port}{TRUSTED if routes else ""}}}
{f"routes: {routes}{chr(10)}" if routes else ""}pools:
  - name: {POOL}
    engine: vllm
    models: [{MODEL}]
{pool_fields}    workers:
{lines}
"""


def lift_circuit_breakers(files: dict[str, bytes]) -> dict[str, bytes]:
    cds = json.loads(files[envoy.layout.CDS])
    for cluster in cds["resources"]:
        for t in cluster.get("circuit_breakers", {}).get("thresholds", []):
            for key in ("max_requests", "max_pending_requests", "max_connections"):
                if key in t:
                    t[key] = 100_000
    out = dict(files)
    out[envoy.layout.CDS] = json.dumps(cds, indent=1).encode()
    return out


@dataclass
class RenderedEnvoy:
    dir: Path
    port: int
    admin: int
    files: dict[str, bytes]
    topology: Path
    sockets: Path | None = None  # the sidecar's Unix socket directory (sidecar.grpc_socket_dir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def eds_file(self) -> Path:
        return self.dir / envoy.layout.eds_path(POOL)


def render(workers: Sequence[tuple[str, int, int]], cfg: PoolConfig, out_dir: Path) -> RenderedEnvoy:
    port, admin = runtime.free_port(), runtime.free_port()
    text = topology_yaml(workers, cfg, port, admin)
    topo, _ = parse(text.encode(), "<bench>")
    files = envoy.render(topo, config_dir=str(out_dir))
    if cfg.lift_circuit_breakers:
        files = lift_circuit_breakers(files)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    write_tree(files, out_dir)
    # A directory of its own: the sidecar watches the topology's directory and reloads (writing the
    # whole tree again) on any event there, so nothing else may be written next to it.
    topo_path = out_dir.parent / f"{out_dir.name}.topology" / "topology.yaml"
    topo_path.parent.mkdir(parents=True, exist_ok=True)
    topo_path.write_text(text)
    return RenderedEnvoy(out_dir, port, admin, files, topo_path)


def _has_grpc_port() -> bool:
    """Does this confgen's topology have sidecar.grpc_port (the endpoint picker's gRPC services)?"""
    from dataclasses import fields

    from confgen.model import SidecarLink

    return any(f.name == "grpc_port" for f in fields(SidecarLink))


def user_topology(workers: Sequence[tuple[str, int, int]], port: int, admin: int, balancing: str = "",
                  grpc_port: int | None = None, routes: str = "", socket_dir: str | None = None) -> str:
    """The topology a user writes for a fleet: each worker's address and its max_num_seqs as
    `capacity`, the pool's engine and model; everything else (balancing, health, retries,
    breakers, backpressure) left at its default unless `balancing` is given (sessions, the
    picker's policy). `grpc_port`: where the sidecar's gRPC services (the endpoint picker)
    listen, a free port like the others (a deployment fact: the default 9110 would collide
    between runs on one machine and between the two sidecars of two ingresses), and `socket_dir`
    the directory of its Unix socket (likewise: the default /tmp/confgen-<name> is one per name on a
    host, and the second sidecar of two ingresses would find the first's socket there). `routes`: a
    top-level `routes:` list in flow style (traffic classes)."""
    return _one_pool(workers, port, admin, f"    balancing: {balancing}\n" if balancing else "", grpc_port, routes,
                     socket_dir)


def render_cli(workers: Sequence[tuple[str, int, int]], out_dir: Path, balancing: str = "",
               routes: str = "", ads_port: int | None = None) -> RenderedEnvoy:
    """`confgen render TOPOLOGY -o OUT` as its own process, on the topology a user would write;
    `ads_port`: in `envoy.xds.mode: ads`, its control plane at 127.0.0.1:`ads_port` (the render's one
    file is then the bootstrap, the rest the control plane serves)."""
    port, admin = runtime.free_port(), runtime.free_port()
    grpc = _has_grpc_port()
    # a private directory per render, short enough for a socket path (mkdtemp makes it 0700)
    sockets = tempfile.mkdtemp(prefix="cg-bench-") if grpc else None
    text = user_topology(workers, port, admin, balancing, runtime.free_port() if grpc else None, routes, sockets)
    if ads_port is not None:
        text += f"envoy: {{xds: {{mode: ads, servers: ['127.0.0.1:{ads_port}']}}}}\n"
    # A directory of its own: the sidecar watches the topology's directory.
    topo_path = out_dir.parent / f"{out_dir.name}.topology" / "topology.yaml"
    topo_path.parent.mkdir(parents=True, exist_ok=True)
    topo_path.write_text(text)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    proc = subprocess.run([os.sys.executable, "-m", "confgen", "render", str(topo_path), "-o", str(out_dir)],
                          capture_output=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"confgen render failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return RenderedEnvoy(out_dir, port, admin, {}, topo_path, Path(sockets) if sockets else None)


@contextlib.contextmanager
def run_control_plane(rendered: RenderedEnvoy, xds_port: int, log: Path,
                      extra: Sequence[str] = ()) -> Iterator[SidecarProcess]:
    """One confgen-sidecar serving ADS (`--serve-xds`) for every Envoy of `rendered`, default flags
    but the deployment facts; stopped by its pid."""
    listen = runtime.free_port()
    args = [os.sys.executable, "-m", "sidecar.main", "--topology", str(rendered.topology),
            "--serve-xds", f"127.0.0.1:{xds_port}", "--listen", f"127.0.0.1:{listen}", *extra]
    with log.open("wb") as out:
        child = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not _http_ok(f"http://127.0.0.1:{listen}/readyz"):
            if child.poll() is not None:
                raise RuntimeError(f"control plane exited {child.returncode}: {log.read_text()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"control plane not ready in 30 s: {log.read_text()[-1500:]}")
            time.sleep(0.1)
        yield SidecarProcess(child, f"http://127.0.0.1:{listen}")
        if child.poll() is not None:
            raise RuntimeError(f"the control plane died during the run ({child.returncode}): "
                               f"{log.read_text()[-1500:]}")
    finally:
        stop_process(child, timeout=10)


@contextlib.contextmanager
def run_ads_envoy(rendered: RenderedEnvoy, node: str) -> Iterator[runtime.EnvoyProcess]:
    """One Envoy of the control plane: the rendered ADS bootstrap with its own node id and admin port.
    Every Envoy binds the listener's port (SO_REUSEPORT: the kernel spreads connections over them)."""
    config = json.loads((rendered.dir / envoy.layout.BOOTSTRAP).read_bytes())
    config["admin"]["address"]["socket_address"]["port_value"] = 0
    with runtime.EnvoyProcess(config, log_level="warning", concurrency=1,
                              extra_args=["--service-node", node]) as proc:
        wait_hosts(proc, timeout=30.0)
        yield proc


@contextlib.contextmanager
def run_sidecar(rendered: RenderedEnvoy, proc: runtime.EnvoyProcess, log: Path, interval_s: float | None = None,
                extra: Sequence[str] = ()) -> Iterator[SidecarProcess]:
    """The real sidecar daemon (python -m sidecar.main) for one Envoy; stopped by its pid.

    interval_s None = the sidecar's defaults: only the deployment facts are passed (the
    topology, the xDS directory it shares with Envoy, a free port for its own server),
    plus `extra`."""
    listen = runtime.free_port()
    args = [os.sys.executable, "-m", "sidecar.main", "--topology", str(rendered.topology),
            "--xds-dir", str(rendered.dir), "--listen", f"127.0.0.1:{listen}"]
    if interval_s is not None:
        args += ["--envoy-admin", proc.admin_url, "--interval", str(interval_s), "--log-format", "text",
                 "--log-level", "WARNING"]
    args += list(extra)
    with log.open("wb") as out:
        child = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if child.poll() is not None:
                raise RuntimeError(f"sidecar exited {child.returncode}: {log.read_text()[-1500:]}")
            if _http_ok(f"http://127.0.0.1:{listen}/readyz"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sidecar not ready in 30 s: {log.read_text()[-1500:]}")
            time.sleep(0.1)
        yield SidecarProcess(child, f"http://127.0.0.1:{listen}")
        if child.poll() is not None:
            raise RuntimeError(f"the sidecar died during the run ({child.returncode}): {log.read_text()[-1500:]}")
    finally:
        stop_process(child, timeout=10)


@dataclass
class SidecarProcess:
    proc: subprocess.Popen[bytes]
    url: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metric_by(self, name: str, label: str) -> dict[str, float] | None:
        """The sidecar's samples of metric `name` (exact, counters without their `_total`), summed
        by the value of `label` (None: the server did not answer)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=2) as resp:
                body = resp.read().decode()
        except (OSError, urllib.error.URLError):
            return None
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(body):
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
        return out

    def metric_sum(self, *needles: str) -> float | None:
        """Sum of the sidecar's own metric samples whose name contains every needle, where a needle
        may offer alternatives ("publish|write") (None: none found or the server did not answer);
        e.g. ("eds", "publish|write") counts EDS writes under either name."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=2) as resp:
                body = resp.read().decode()
        except (OSError, urllib.error.URLError):
            return None
        total, seen = 0.0, False
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if (all(any(alt in sample.name for alt in n.split("|")) for n in needles)
                        and not sample.name.endswith("_created") and "rejected" not in sample.name):
                    total += sample.value
                    seen = True
        return total if seen else None


@contextlib.contextmanager
def run_envoy(rendered: RenderedEnvoy) -> Iterator[runtime.EnvoyProcess]:
    with runtime.EnvoyProcess(rendered.dir / envoy.layout.BOOTSTRAP, log_level="warning", concurrency=1) as proc:
        wait_hosts(proc)
        yield proc


def wait_hosts(proc: runtime.EnvoyProcess, timeout: float = 10.0) -> None:
    """Wait until every cluster's hosts are known and have passed a first health check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        flags = [ln for ln in proc.clusters_text().splitlines() if "::health_flags::" in ln]
        if flags and all(ln.endswith("::healthy") for ln in flags):
            return
        time.sleep(0.1)
    raise RuntimeError(f"envoy hosts not all healthy within {timeout} s")


def vllm_router_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("vllm-router")
    except metadata.PackageNotFoundError:
        return "not installed"


@contextlib.contextmanager
def run_vllm_router(urls: Sequence[str], policy: str, log: Path) -> Iterator[str]:
    """The peer router on a free loopback port; stopped by its pid."""
    binary = shutil.which("vllm-router") or str(Path(os.sys.executable).parent / "vllm-router")
    port = runtime.free_port()
    args = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--log-level", "warning", "--max-concurrent-requests", "4096", "--queue-size", "4096",
            "--request-timeout-secs", "120", "--health-check-interval-secs", "1",
            # Its metrics exporter binds 29000 by default: two routers (or another user's) would collide.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(runtime.free_port())]
    env = {**os.environ, "RUST_LOG": "warn"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited {proc.returncode}: {log.read_text()[-1500:]}")
            if _http_ok(f"{url}/health"):
                # A router that lost its port to another process exits; a 200 from that process
                # must not pass for ours.
                time.sleep(0.3)
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm-router exited {proc.returncode}: {log.read_text()[-1500:]}")
                break
            if time.monotonic() > deadline:
                raise RuntimeError("vllm-router not healthy in 30 s")
            time.sleep(0.1)
        yield url
    finally:
        stop_process(proc, timeout=5)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status) == 200
    except (OSError, urllib.error.URLError):
        return False


def envoy_version() -> str:
    try:
        out = subprocess.run([str(runtime.find_envoy()), "--version"], capture_output=True, timeout=10, check=False)
    except (OSError, runtime.BinaryNotFoundError) as exc:
        return f"unavailable ({exc})"
    text = out.stdout.decode().strip()
    return text.split("version:", 1)[-1].strip() if text else "unknown"


def admin_json(proc: runtime.EnvoyProcess, path: str) -> Any:
    status, body = proc.admin_get(path)
    if status != 200:
        raise RuntimeError(f"admin {path}: {status}")
    return json.loads(body)
