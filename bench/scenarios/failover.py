"""Kill a worker under load: failed requests, and how long until Envoy stops sending it traffic."""

from __future__ import annotations

import threading
import time
from typing import Any

from confgen.model import Retries
from confgen.simulate import FleetSpec, WorkerSpec, run_fleet_in_thread

from .. import _proxies, _stats, loadgen
from .._harness import Context, Result, Target
from .._workload import poisson

NAME = "failover"
TITLE = "Failover: a worker killed under load"


def _host_counters(text: str, port: int) -> dict[str, str]:
    prefix = f"{_proxies.POOL}::127.0.0.1:{port}::"
    return {ln[len(prefix):].split("::", 1)[0]: ln.rsplit("::", 1)[1] for ln in text.splitlines()
            if ln.startswith(prefix)}


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    default_floor = Retries().min_concurrency  # from the model, so the label cannot go stale
    default = _once(ctx, res, f"product defaults (retries.min_concurrency {default_floor})", "{attempts: 2}")
    tuned = _once(ctx, res, "retries.min_concurrency 16 (one worker's capacity)", "{attempts: 2, min_concurrency: 16}")
    s, quiet_s = default["summary"], default["quiet_s"]
    res.targets.append(Target("Worker kill: failed non-stream requests (topology defaults)", "0",
                              f"{s['errors']} ({', '.join(f'{n}x {k}' for k, n in s['error_kinds'].items()) or '-'}); "
                              f"with min_concurrency 16: {tuned['summary']['errors']}", None, s["errors"] == 0))
    res.targets.append(Target("Worker kill: no traffic to it after", "<= 1 s", f"{quiet_s * 1000:.0f} ms",
                              quiet_s, quiet_s <= 1.0, 1.0))
    res.raw = {"defaults": default, "min_concurrency_16": tuned}
    res.notes.append("Pool settings come from the topology: retries 2 on connect-failure/reset/refused-stream "
                     "(another host each time) under a retry budget of 20 % with `min_concurrency` concurrent retries "
                     "always allowed, outlier detection after 2 consecutive gateway failures, active health checks "
                     "every 1 s. 'Traffic' is Envoy's per-host rq_total + cx_total + cx_connect_fail from admin "
                     "/clusters, polled every 50 ms. A failed attempt whose retry the budget refused is answered as "
                     "503 upstream_failure.")
    return res


def _once(ctx: Context, res: Result, label: str, retries: str) -> dict[str, Any]:
    duration = ctx.scale(16, 8)
    kill_at = ctx.scale(6, 3)
    rate = 30.0
    import random

    rng = random.Random(ctx.seed)
    requests = []
    for i, t in poisson(rng, rate, int(rate * duration)):
        requests.append({"i": i, "t": round(t, 5), "headers": {},
                         "body": {"model": "sim-model", "prompt": f"failover {i} " + "x" * rng.randint(50, 400),
                                  "max_tokens": rng.randint(8, 24), "stream": False}})
    spec = FleetSpec(workers=tuple(WorkerSpec(name=f"w{i}", max_num_seqs=16, decode_ms=20.0) for i in range(3)),
                     seed=ctx.seed)
    samples: list[tuple[float, dict[str, str]]] = []
    with run_fleet_in_thread(spec) as fleet:
        victim = fleet.workers[1]
        rendered = _proxies.render([("127.0.0.1", w.port, 16) for w in fleet.workers],
                                   _proxies.PoolConfig(policy="least_request", capacity=16, retries=retries),
                                   ctx.work / f"fo.envoy.{len(res.tables)}")
        with _proxies.run_envoy(rendered) as proxy:
            job = {"targets": [rendered.url], "requests": requests, "deadline_s": duration + 1, "timeout_s": 30.0}
            proc, out_path = loadgen.start(job, ctx.work, f"failover{len(res.tables)}")
            t0 = time.monotonic()
            stop = threading.Event()

            def poll() -> None:
                while not stop.is_set():
                    try:
                        text = proxy.clusters_text()
                    except (OSError, RuntimeError):
                        text = ""
                    samples.append((time.monotonic(), _host_counters(text, victim.port)))
                    stop.wait(0.05)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            time.sleep(max(0.0, kill_at - (time.monotonic() - t0)))
            killed = time.monotonic()
            victim.crash()
            records = loadgen.collect(proc, out_path, timeout=duration + 60)
            stop.set()
            poller.join(timeout=5)
            stats_txt = proxy.stats()
    # Traffic to the victim = requests or connection attempts Envoy made to it.
    def traffic(c: dict[str, str]) -> int:
        return sum(int(c.get(k, "0")) for k in ("rq_total", "cx_total", "cx_connect_fail"))

    last_change, flagged = killed, None
    prev = None
    for ts, c in samples:
        if not c:
            continue
        value = traffic(c)
        if prev is not None and value != prev and ts >= killed:
            last_change = ts
        prev = value
        if flagged is None and ts >= killed and c.get("health_flags", "healthy") != "healthy":
            flagged = ts
    quiet_s = last_change - killed
    flag_s = None if flagged is None else flagged - killed
    s = _stats.summarize(records)
    after = [r for r in records if r["sched"] >= kill_at - 2]
    failed_after = sum(1 for r in after if not _stats.ok(r))
    retries = {k: v for k, v in stats_txt.items() if isinstance(k, str) and k.startswith(f"cluster.{_proxies.POOL}.")
               and k.rsplit(".", 1)[1] in ("upstream_rq_retry", "upstream_rq_retry_success",
                                           "outlier_detection.ejections_enforced_total")}
    ej = stats_txt.get(f"cluster.{_proxies.POOL}.outlier_detection.ejections_enforced_total", 0)
    res.tables.append((f"{label}: 3 workers, {rate:.0f} req/s non-streaming (8-24 tokens) for {duration:.0f} s, "
                       f"Envoy least_request; worker w1 crashed at t={kill_at:.0f} s",
                       ["requests", "failed (all)", "failed from 2 s before the kill", "retries (ok)",
                        "outlier ejections", "victim marked unhealthy after", "last traffic to victim after"],
                       [[str(s["requests"]), str(s["errors"]), str(failed_after),
                         f"{retries.get(f'cluster.{_proxies.POOL}.upstream_rq_retry', 0)} "
                         f"({retries.get(f'cluster.{_proxies.POOL}.upstream_rq_retry_success', 0)})",
                         str(ej), "-" if flag_s is None else f"{flag_s * 1000:.0f} ms", f"{quiet_s * 1000:.0f} ms"]]))
    return {"summary": s, "quiet_s": quiet_s, "flagged_s": flag_s, "stats": retries, "ejections": ej,
            "failed_around_kill": failed_after}

