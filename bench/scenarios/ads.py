"""ADS: one control plane (confgen-sidecar --serve-xds) feeding many Envoys.

Fan-out: 1,000 endpoints in 10 pools (2 metrics-server processes, an idle fleet: weights
stay put), 20 real Envoys over ADS. A decision is a drain call on the sidecar (POST /drain:
the daemon republishes at once); applied = that pool's `cluster.<pool>.update_success`
moved in an Envoy's admin stats, polled from one asyncio loop in this process (the
resolution is one polling round, reported). Fan-out = decision until all 20 applied.
Sidecar CPU from /proc over a window with the 20 Envoys connected, probing at 1 Hz.

Scale: 1,000 pools of one endpoint each, one Envoy over ADS: time until it holds all
1,000 clusters with their endpoint (Envoy's admin stats), and whether it refused anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from confgen import envoy, runtime
from confgen.runtime import EnvoyProcess
from confgen.topology import parse

from .._harness import Context, Result, Target, wait_until
from .._procstat import cpu_s, rss_mb
from .sidecar_cost import _metrics_servers, _pad, _sim_body

NAME = "ads"
TITLE = "ADS: one control plane, 20 Envoys; 1,000 pools over ADS"

ENDPOINTS = 1000
POOLS = 10
ENVOYS = 20


def _topology(pools: Sequence[Sequence[int]], *, listen: int, admin: int, xds: int) -> str:
    out = []
    for p, ports in enumerate(pools):
        workers = "\n".join(f"      - 127.0.0.1:{port}" for port in ports)
        out.append(f"""  - name: pool{p:04d}
    engine: vllm
    models: [model-{p:04d}]
    capacity: 16
    health: {{enabled: false}}
    workers:
{workers}""")
    return (f"version: 1\nname: ads\nadmin: {{address: 127.0.0.1, port: {admin}}}\n"
            f"listeners:\n  - {{name: public, address: 127.0.0.1, port: {listen}}}\n"
            f"envoy:\n  xds: {{mode: ads, servers: [\"127.0.0.1:{xds}\"]}}\n"
            "pools:\n" + "\n".join(out) + "\n")


class _Sidecar:
    """confgen-sidecar --serve-xds --interval 1 (the issue's 1 Hz), default flags otherwise; stopped by its pid."""

    def __init__(self, topology: Path, xds: int, log: Path) -> None:
        self.listen = runtime.free_port()
        self.url = f"http://127.0.0.1:{self.listen}"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sidecar.main", "--topology", str(topology), "--serve-xds",
                 f"127.0.0.1:{xds}", "--listen", f"127.0.0.1:{self.listen}", "--interval", "1",
                 "--log-level", "WARNING"],
                stdout=out, stderr=subprocess.STDOUT)
        self.log = log
        if not wait_until(self._ready, 60):
            self.stop()
            raise RuntimeError(f"sidecar not ready: {log.read_text()[-1500:]}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"sidecar exited {self.proc.returncode}: {self.log.read_text()[-1500:]}")
        try:
            with urllib.request.urlopen(self.url + "/readyz", timeout=2) as resp:
                return int(resp.status) == 200
        except OSError:
            return False

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict[str, str]) -> None:
        req = urllib.request.Request(self.url + path, method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def stop(self) -> None:
        runtime.stop_process(self.proc, timeout=10)


def _start_envoys(ctx: Context, text_for: Any, count: int) -> list[EnvoyProcess]:
    def start(i: int) -> EnvoyProcess:
        topo, _ = parse(text_for(runtime.free_port()).encode(), "<ads>")
        boot = json.loads(envoy.render(topo, config_dir=str(ctx.work))["bootstrap.json"])
        proxy = EnvoyProcess(boot, extra_args=["--service-node", f"envoy-{i:02d}"], log_level="warning",
                             startup_timeout=90)
        proxy.start()
        return proxy

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(start, i) for i in range(count)]
        envoys = []
        for f in futures:
            try:
                envoys.append(f.result())
            except BaseException:
                for other in futures:
                    if other.done() and other.exception() is None:
                        other.result().stop()
                raise
    return envoys


async def _counter(session: aiohttp.ClientSession, admin: str, name: str) -> int:
    async with session.get(f"{admin}/stats", params={"filter": f"^{name}$", "format": "json"}) as resp:
        body = await resp.json(content_type=None)
    values = [s["value"] for s in body.get("stats", []) if s.get("name") == name]
    return int(values[0]) if values else 0


async def _fanout(sidecar: _Sidecar, admins: list[str], pools: list[list[int]], changes: int
                  ) -> tuple[list[float], list[float], list[float]]:
    """Per drain: seconds until all Envoys applied it; the polling rounds' and drain calls' durations."""
    spans: list[float] = []
    posts: list[float] = []
    rounds: list[float] = []
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for k in range(changes):
            p = k % POOLS
            stat = f"cluster.pool{p:04d}.update_success"
            worker = f"127.0.0.1:{pools[p][k // POOLS]}"
            before = await asyncio.gather(*(_counter(session, a, stat) for a in admins))
            called = time.monotonic()
            # The daemon decides when the call runs (after a probe cycle in progress: one lock), and
            # answers after the decision is in the served resources: the fan-out starts there.
            await asyncio.to_thread(sidecar.post, "/drain", {"pool": f"pool{p:04d}", "worker": worker})
            started = time.monotonic()
            posts.append(started - called)
            pending = dict(enumerate(before))
            done_at = started
            while pending and time.monotonic() - started < 10:
                t0 = time.monotonic()
                seen = await asyncio.gather(*(_counter(session, admins[i], stat) for i in pending))
                now = time.monotonic()
                rounds.append(now - t0)
                for i, value in zip(list(pending), seen, strict=True):
                    if value > pending[i]:
                        del pending[i]
                        done_at = now
            spans.append(done_at - started if not pending else float("inf"))
            await asyncio.sleep(0.3)
    return spans, rounds, posts


def _scale_run(ctx: Context, ports: list[int]) -> dict[str, float]:
    """1,000 pools of one endpoint each: one Envoy over ADS takes them all."""
    listen, xds = runtime.free_port(), runtime.free_port()
    pools = [[port] for port in ports[:1000]]
    topo_path = ctx.work / "ads-scale.yaml"
    topo_path.write_text(_topology(pools, listen=listen, admin=runtime.free_port(), xds=xds))
    sidecar = _Sidecar(topo_path, xds, ctx.work / "ads-scale.sidecar.log")
    try:
        started = time.monotonic()
        (proxy,) = _start_envoys(ctx, lambda admin: _topology(pools, listen=listen, admin=admin, xds=xds), 1)
        try:
            def settled() -> bool:
                stats = proxy.stats()
                return int(stats.get("cluster_manager.active_clusters", 0)) >= len(pools) + 1
            wait_until(settled, 120)
            ready_s = time.monotonic() - started
            stats = proxy.stats()
            healthy = sum(1 for line in proxy.admin_get("/clusters")[1].splitlines()
                          if line.startswith("pool") and line.endswith("::health_flags::healthy"))
            state = sidecar.get("/state")["xds"]
            node = next(iter(state["nodes"].values()), {})
            return {"pools": len(pools), "ready_s": ready_s,
                    "active_clusters": int(stats.get("cluster_manager.active_clusters", 0)) - 1,
                    "healthy_hosts": healthy,
                    "cds_rejected": int(stats.get("cluster_manager.cds.update_rejected", 0)),
                    "nacks": sum(node.get("nacks", {}).values()) if node else -1}
        finally:
            proxy.stop()
    finally:
        sidecar.stop()


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    envoys_n = int(ctx.scale(ENVOYS, 5))
    changes = int(ctx.scale(30, 8))
    window = ctx.scale(20, 6)
    body = _pad(_sim_body(ctx.seed), 40_000)
    body_path = ctx.work / "ads.body.prom"
    body_path.write_bytes(body)
    with _metrics_servers(ctx, body_path, busy=False) as ports:
        per = ENDPOINTS // POOLS
        pools = [ports[p * per:(p + 1) * per] for p in range(POOLS)]
        listen, xds = runtime.free_port(), runtime.free_port()
        topo_path = ctx.work / "ads.yaml"
        topo_path.write_text(_topology(pools, listen=listen, admin=runtime.free_port(), xds=xds))
        sidecar = _Sidecar(topo_path, xds, ctx.work / "ads.sidecar.log")
        try:
            envoys = _start_envoys(ctx, lambda admin: _topology(pools, listen=listen, admin=admin, xds=xds),
                                   envoys_n)
            try:
                wait_until(lambda: len(sidecar.get("/state")["xds"]["nodes"]) == envoys_n, 30)
                time.sleep(ctx.scale(5, 2))
                cpu0, t0 = cpu_s(sidecar.proc.pid), time.monotonic()
                time.sleep(window)
                cores = (cpu_s(sidecar.proc.pid) - cpu0) / (time.monotonic() - t0)
                rss, hwm = rss_mb(sidecar.proc.pid)
                spans, rounds, posts = asyncio.run(_fanout(sidecar, [e.admin_url for e in envoys], pools, changes))
                state = sidecar.get("/state")["xds"]
            finally:
                for proxy in envoys:
                    proxy.stop()
        finally:
            sidecar.stop()
        scale = _scale_run(ctx, ports)
    finite = sorted(s for s in spans if s != float("inf"))
    p50 = statistics.median(finite) if finite else float("inf")
    p99 = finite[min(len(finite) - 1, int(0.99 * len(finite)))] if len(finite) == len(spans) else float("inf")
    poll_ms = statistics.median(rounds) * 1000 if rounds else 0.0
    nacks = sum(sum(n["nacks"].values()) for n in state["nodes"].values())
    post_ms = statistics.median(posts) * 1000 if posts else 0.0
    res.tables.append((f"confgen-sidecar --serve-xds --interval 1 (default flags otherwise) with {envoys_n} Envoys "
                       f"(--concurrency 1) over ADS (delta), {ENDPOINTS} endpoints in {POOLS} pools (idle fleet); "
                       f"{changes} drains, each applied = the pool's update_success moved in every Envoy",
                       ["Envoys", "fan-out P50", "fan-out P99 (max)", "drain call (median)", "polling round (median)",
                        "sidecar CPU (cores)",
                        "sidecar RSS MB", "NACKs"],
                       [[str(envoys_n), f"{p50 * 1000:.0f} ms", f"{p99 * 1000:.0f} ms", f"{post_ms:.0f} ms",
                         f"{poll_ms:.0f} ms",
                         f"{cores:.3f}", f"{hwm:.0f}", str(nacks)]]))
    res.tables.append(("1,000 pools of one endpoint each, one Envoy over ADS (delta)",
                       ["pools", "clusters active in Envoy", "healthy hosts", "CDS rejected", "NACKs",
                        "start to all clusters active"],
                       [[str(int(scale["pools"])), str(int(scale["active_clusters"])),
                         str(int(scale["healthy_hosts"])), str(int(scale["cds_rejected"])), str(int(scale["nacks"])),
                         f"{scale['ready_s']:.1f} s"]]))
    res.targets.append(Target(f"ADS EDS fan-out to {envoys_n} Envoys (P99)", "<= 100 ms", f"{p99 * 1000:.0f} ms",
                              p99 * 1000, p99 * 1000 <= 100, 100))
    res.targets.append(Target(f"Control plane CPU, {ENDPOINTS} endpoints, {envoys_n} Envoys", "<= 0.5 core",
                              f"{cores:.2f} core", cores, cores <= 0.5, 0.5))
    ok = scale["active_clusters"] >= 1000 and scale["cds_rejected"] == 0 and scale["nacks"] == 0
    res.targets.append(Target("1,000 pools accepted by one Envoy over ADS", "all active, no NACK",
                              f"{int(scale['active_clusters'])} active, {int(scale['nacks'])} NACKs",
                              None, ok))
    res.raw = {"spans_s": spans, "drain_call_s": posts,
               "poll_round_s": statistics.median(rounds) if rounds else None, "cores": cores,
               "rss_mb": rss, "hwm_mb": hwm, "scale": scale, "envoys": envoys_n}
    res.notes.append("The sidecar runs with --serve-xds and --interval 1 (the 1 Hz of the target; the default is 2 s), "
                     "default flags otherwise, probing all 1,000 endpoints: its CPU includes the probe cost (see "
                     "sidecar_cost). Fan-out runs from the drain call's answer (sent once the "
                     "decision is in the served resources; the call itself waits for a probe cycle in progress, shown "
                     "apart) until every Envoy's stats show it, including up to one polling round of admin requests to "
                     "every Envoy from one asyncio loop.")
    return res
