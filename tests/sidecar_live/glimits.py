"""A rig for global limits: N Envoys, each with its own confgen-sidecar (its rate limit
service), all counting in one real redis-server, in front of one simulated fleet.

That is the file-mode deployment: an Envoy + sidecar pair per proxy replica; the shared
Redis makes a budget one budget whatever the number of pairs.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_sync

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, RedisProcess, SentinelProcess, free_port
from confgen.simulate import FleetHandle, FleetSpec, fleet_topology, run_fleet_in_thread
from tests.sidecar_live.rig import FAST_ARGS, SidecarProcess, ads_envoy, control_plane, worker_specs

NAME = "glim"
# client -> its rate_limit YAML (None: no limit of its own)
CLIENTS: dict[str, str | None] = {
    "req": "{scope: global, requests: 60, window: minute}",
    "loc": "{requests: 60, per: 1m}",
    "tok": "{scope: global, unit: total_tokens, tokens: 3000, window: minute}",
    "out": "{scope: global, unit: output_tokens, tokens: 100000, window: hour}",
    "sec": "{scope: global, requests: 5, window: second}",
    "closed": "{scope: global, requests: 100000, window: minute, fail_closed: true}",
    "big": "{scope: global, requests: 10000000, window: minute}",  # never refused: the check's cost alone
    # hour windows: a test that must stay in one window does not wait for a minute's start
    "tok10k": "{scope: global, unit: total_tokens, tokens: 10000, window: hour}",
    "reqh": "{scope: global, requests: 60, window: hour}",
    "free": None,
}
KEYS = {client: f"key-{client}-0123456789" for client in CLIENTS}


def topology_text(workers: Sequence[str], *, admin: int, port: int, listen: int, grpc: int, redis: str,
                  check_timeout: str | None = "500ms", store_timeout: str | None = "200ms",
                  clients: dict[str, str | None] | None = None, sockets: Path | None = None, envoys: int | None = None,
                  pool_extra: Sequence[str] = (), ads: str | None = None, grpc_tls: str = "",
                  sentinel: tuple[str, str] | None = None, per_key: str | None = None,
                  listener: str | None = None) -> str:
    """None for a timeout: the product's default; `clients` (default CLIENTS): client -> its rate_limit;
    `sockets`: the sidecar's Unix socket directory (the default transport; without it /tmp/confgen-<name>);
    `envoys`: limits.store.envoys (the local floor's divisor); `pool_extra`: more lines of the pool;
    `ads`: the control plane's host:port (envoy.xds.mode ads); `grpc_tls`: sidecar.grpc_tls's flow mapping;
    `sentinel`: (a Sentinel's host:port, the master's name) instead of `redis` (limits.store.sentinel);
    `per_key`: limits.per_key (every client without a rate_limit of its own); `listener`: limits.global."""
    auth = ["auth:", "  api_keys:"]
    for client, limit in (CLIENTS if clients is None else clients).items():
        auth.append(f"    - {{client: {client}, env: CONFGEN_GLIM_{client.upper()}"
                    + (f", rate_limit: {limit}}}" if limit else "}"))
    tail = [*auth,
            "limits:",
            (f"  store: {{sentinel: {{addresses: ['{sentinel[0]}'], master: {sentinel[1]}}}" if sentinel else
             f"  store: {{redis: '{redis}'")
            + (f", timeout: {store_timeout}" if store_timeout else "")
            + (f", check_timeout: {check_timeout}" if check_timeout else "")
            + (f", envoys: {envoys}" if envoys else "") + "}",
            *([f"  per_key: {per_key}"] if per_key else []),
            *([f"  global: {listener}"] if listener else []),
            f"sidecar: {{address: 127.0.0.1, port: {listen}, grpc_port: {grpc}"
            + (f", grpc_socket_dir: {sockets}" if sockets is not None else "")
            + (f", grpc_tls: {grpc_tls}" if grpc_tls else "") + "}",
            *([f"envoy: {{xds: {{mode: ads, servers: ['{ads}']}}}}"] if ads else [])]
    return fleet_topology(name=NAME, admin=admin, port=port, workers=workers, models=["sim-model"], capacity=64,
                          pool=["health: {enabled: false}", "outlier_detection: {enabled: false}", *pool_extra],
                          tail=tail)


@dataclass
class Pair:
    envoy: EnvoyProcess
    sidecar: SidecarProcess | None
    port: int
    topology: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"


@dataclass
class GlobalRig:
    fleet: FleetHandle
    redis: RedisProcess
    pairs: list[Pair]  # with ADS (ads_global_rig): the Envoys, each without a sidecar of its own
    lock: threading.Lock = field(default_factory=threading.Lock)
    control: SidecarProcess | None = None  # ADS: the control plane, every Envoy's rate limit service

    def store(self) -> redis_sync.Redis:
        return redis_sync.Redis(host="127.0.0.1", port=self.redis.port, socket_timeout=2, socket_connect_timeout=2)

    def counted(self, budget: str) -> int:
        """Sum of the Redis counters of one budget id (every client, model, window): what was spent."""
        client = self.store()
        try:
            total = 0
            for key in client.scan_iter(match=f"confgen:confgen.{NAME}:{budget}:*", count=1000):
                if not key.endswith((b":r", b":r:z")):  # the reservations beside a token counter
                    total += int(client.get(key) or 0)
            return total
        finally:
            client.close()


    def reserved(self, budget: str) -> int:
        """Tokens still reserved by requests of one budget whose answer has not been charged."""
        client = self.store()
        try:
            return sum(int(v.split(b":")[0]) for key in client.scan_iter(match=f"confgen:confgen.{NAME}:{budget}:*:r")
                       for rid, v in client.hgetall(key).items() if rid != b"#total")
        finally:
            client.close()


def call(url: str, client: str, body: dict[str, Any], timeout: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    """POST through Envoy as `client`; (status, headers, body); status 0 for a connection failure."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={
        "content-type": "application/json", "authorization": f"Bearer {KEYS[client]}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()
    except OSError:
        return 0, {}, b""


def usage_of(status: int, payload: bytes, stream: bool) -> dict[str, int] | None:
    """The usage object of a completion (the last usage chunk of a stream)."""
    if status != 200:
        return None
    if not stream:
        usage = json.loads(payload).get("usage")
        return dict(usage) if usage else None
    found = None
    for line in payload.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                found = dict(chunk["usage"])
    return found


@contextlib.contextmanager
def global_rig(tmp: Path, envoys: int = 3, *, sidecars: bool = True, workers: int = 2,
               decode_ms: float = 2.0, check_timeout: str | None = "500ms", store_timeout: str | None = "200ms",
               grpc_ports: Sequence[int] | None = None, sidecar_args: Sequence[str] = FAST_ARGS,
               envoy_concurrency: int = 1,
               clients: Sequence[dict[str, str | None] | None] | None = None,
               default_max_tokens: int = 64, pool_extra: Sequence[str] = (),
               envoys_in_store: int | None = None, sentinel: SentinelProcess | None = None,
               primary: RedisProcess | None = None, per_key: str | None = None) -> Iterator[GlobalRig]:
    """`envoys` pairs (Envoy + sidecar) on one fleet and one Redis; `sidecars=False` starts
    no sidecar (the rate limit service is unreachable); `clients[i]`: pair i's clients. The
    tests give the store and Envoy generous timeouts (a loaded machine must not turn a slow answer into fail-open, which
    would count as a wrong admission); the bench passes None: the product's defaults. `sentinel`: the
    sidecars find the store through it (limits.store.sentinel), `primary` its first primary (the rig's
    `redis`), both started and stopped by the caller."""
    import os

    specs = worker_specs([f"w{i}" for i in range(workers)], decode_ms=decode_ms, max_num_seqs=64,
                         prefill_ms_per_1k=5.0, default_max_tokens=default_max_tokens)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFGEN_")}
    with (contextlib.nullcontext(primary) if primary is not None else RedisProcess()) as store, \
            run_fleet_in_thread(FleetSpec(workers=specs, seed=5)) as fleet, contextlib.ExitStack() as stack:
        pairs: list[Pair] = []
        started: list[SidecarProcess] = []
        try:
            for i in range(envoys):
                port, admin, listen = free_port(), free_port(), free_port()
                grpc = grpc_ports[i] if grpc_ports else free_port()
                directory = tmp / f"pair{i}"
                text = topology_text([f"127.0.0.1:{w.port}" for w in fleet.workers], admin=admin, port=port,
                                     listen=listen, grpc=grpc, redis=store.address, check_timeout=check_timeout,
                                     store_timeout=store_timeout, clients=clients[i] if clients else None,
                                     sockets=directory / "sockets", envoys=envoys_in_store, pool_extra=pool_extra,
                                     sentinel=(sentinel.address, sentinel.master) if sentinel else None,
                                     per_key=per_key)
                directory.mkdir(parents=True)
                topo_path = directory / "topology.yaml"
                topo_path.write_text(text)
                topo, _ = parse_topology(text.encode())
                xds = directory / "envoy"
                write_tree(envoy.render(topo, config_dir=str(xds), secrets=KEYS), xds, rank=envoy.layout.write_rank)
                proxy = stack.enter_context(EnvoyProcess(xds / "bootstrap.json", concurrency=envoy_concurrency))
                sidecar = None
                if sidecars:
                    sidecar = SidecarProcess(["--topology", str(topo_path), "--xds-dir", str(xds), "--listen",
                                              f"127.0.0.1:{listen}", *sidecar_args], directory / "sidecar.log", listen,
                                             env=env)
                    sidecar.start()
                    started.append(sidecar)
                pairs.append(Pair(proxy, sidecar, port, topo_path))
            for sidecar in started:
                sidecar.wait_ready()
            yield GlobalRig(fleet, store, pairs)
        finally:
            codes = [(s.stop(), s) for s in started]
        for code, sidecar in codes:
            assert code == 0, f"sidecar exited {code} on SIGTERM:\n{sidecar.log_tail()}"


def spread(rig: GlobalRig, client: str, bodies: Sequence[dict[str, Any]], concurrency: int,
           deadline_s: float = 120.0) -> list[tuple[int, dict[str, str], bytes, dict[str, Any]]]:
    """Send every body once, round-robin over the Envoys, `concurrency` at a time; bounded in time."""
    stop_at = time.monotonic() + deadline_s

    def one(index: int) -> tuple[int, dict[str, str], bytes, dict[str, Any]]:
        body = bodies[index]
        if time.monotonic() > stop_at:
            return -1, {}, b"", body
        status, headers, payload = call(rig.pairs[index % len(rig.pairs)].url, client, body)
        return status, headers, payload, body

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, range(len(bodies))))


def paced_load(rig: GlobalRig, client: str, body: dict[str, Any], stop: threading.Event,
               out: list[tuple[float, int]], rate: float, limit: int = 100_000) -> None:
    """One request every 1/rate s through the Envoys in turn until `stop` or `limit` requests; each
    (monotonic time of the answer, status) appended to `out`."""
    index = 0
    next_at = time.monotonic()
    while not stop.is_set() and index < limit:
        status, _, _ = call(rig.pairs[index % len(rig.pairs)].url, client, body, timeout=10)
        out.append((time.monotonic(), status))
        index += 1
        next_at += 1 / rate
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)


def sidecar_metric(rig: GlobalRig, name: str, labels: str = "") -> float:
    """A metric summed over the rig's sidecars (every series of it, or those whose labels contain `labels`)."""
    total = 0.0
    for pair in rig.pairs:
        assert pair.sidecar is not None
        for line in pair.sidecar.metrics().splitlines():
            if (line.startswith(name + " ") or line.startswith(name + "{")) and labels in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_window(seconds_left: float, window: int = 60, timeout: float = 70.0) -> None:
    """Return once the current fixed window (of the wall clock, as the sidecars count) has at
    least `seconds_left` to run: a run that must stay inside one window starts there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if window - (time.time() % window) >= seconds_left:
            return
        time.sleep(0.2)
    raise AssertionError("no window start seen")


@contextlib.contextmanager
def ads_global_rig(tmp: Path, envoys: int = 3, *, clients: dict[str, str | None] | None = None,
                   mtls: bool = False, workers: int = 2, control_args: Sequence[str] = ()) -> Iterator[GlobalRig]:
    """`envoys` Envoys on one control plane (`confgen-sidecar --serve-xds`, which serves them ADS and the
    rate limit service) counting in one real Redis, in front of one simulated fleet: mode ads. The
    Envoys share the listener's port (SO_REUSEPORT: the kernel spreads connections over them) and
    differ in node id and admin port. Transport: the control plane's Unix sockets, or `mtls` (one CA,
    the Envoys sharing one client certificate, as the Kubernetes render mounts it). The same
    generous timeouts as `global_rig` (a slow answer must not fail open). `control_args`: more flags of the
    control plane's."""
    import os

    from tests.support.certs import CertAuthority

    specs = worker_specs([f"w{i}" for i in range(workers)], decode_ms=2.0, max_num_seqs=64,
                         prefill_ms_per_1k=5.0, default_max_tokens=64)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFGEN_")}
    # the control plane serves the listeners with the keys (ADS, ECDS): it reads them where topology_text says
    env |= {f"CONFGEN_GLIM_{client.upper()}": KEYS[client] for client in (CLIENTS if clients is None else clients)}
    tls_args: list[str] = []
    grpc_tls = ""
    if mtls:
        ca = CertAuthority.create(tmp / "pki")
        server = ca.issue("control-plane", ["IP:127.0.0.1"])
        client = ca.issue(f"{NAME}-envoy", [f"DNS:{NAME}-envoy"])
        grpc_tls = f"{{cert: {client.cert}, key: {client.key}, ca: {ca.cert}}}"
        tls_args = ["--grpc-tls-cert", str(server.cert), "--grpc-tls-key", str(server.key),
                    "--grpc-client-ca", str(ca.cert), "--xds-nodes-per-identity", str(envoys)]
    with RedisProcess() as store, run_fleet_in_thread(FleetSpec(workers=specs, seed=5)) as fleet, \
            contextlib.ExitStack() as stack:
        port, listen, grpc, xds = free_port(), free_port(), free_port(), free_port()

        def text(admin: int) -> str:
            return topology_text([f"127.0.0.1:{w.port}" for w in fleet.workers], admin=admin, port=port,
                                 listen=listen, grpc=grpc, redis=store.address, clients=clients,
                                 sockets=tmp / "sockets", ads=f"127.0.0.1:{xds}", grpc_tls=grpc_tls)

        topo_path = tmp / "topology.yaml"
        topo_path.write_text(text(free_port()))
        # the stack stops the Envoys first: they would fail open against a stopped service
        control = stack.enter_context(control_plane(topo_path, xds, tmp / "control-plane.log", *tls_args, *control_args,
                                                    listen=listen, env=env, clean_exit=True))
        pairs = []
        for i in range(envoys):
            node = f"{NAME}-envoy/{i}" if mtls else f"envoy-{i}"
            proxy = stack.enter_context(ads_envoy(text(free_port()), tmp / f"envoy{i}", node))
            pairs.append(Pair(proxy, None, port, topo_path))
        yield GlobalRig(fleet, store, pairs, control=control)
