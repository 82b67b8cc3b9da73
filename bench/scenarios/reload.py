"""EDS replacement under load: decision -> applied in Envoy, and requests lost over 100 replacements."""

from __future__ import annotations

import http.client
import random
import time
from urllib.parse import urlparse

from confgen.envoy import Endpoint, render_eds
from confgen.output import atomic_write
from confgen.simulate import FleetSpec, WorkerSpec, run_fleet_in_thread

from .. import _proxies, _stats, loadgen
from .._harness import Context, Result, Target, fmt_ms
from .._workload import poisson

NAME = "reload"
TITLE = "Reload: EDS replacements under load"


class _Admin:
    """One keep-alive connection to Envoy's admin, for tight polling."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=2)

    def stats(self) -> dict[str, str]:
        self.conn.request("GET", f"/stats?filter=^cluster\\.{_proxies.POOL}\\.(update_success|version_text)$")
        body = self.conn.getresponse().read().decode()
        out = {}
        for line in body.splitlines():
            k, _, v = line.partition(": ")
            out[k.rsplit(".", 1)[-1]] = v.strip().strip('"')
        return out


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    replacements = int(ctx.scale(100, 30))
    gap = 0.15
    duration = replacements * (gap + 0.02) + 4
    rate = 30.0
    rng = random.Random(ctx.seed)
    requests = []
    for i, t in poisson(rng, rate, int(rate * duration)):
        requests.append({"i": i, "t": round(t, 5), "headers": {},
                         "body": {"model": "sim-model", "prompt": f"reload {i}", "max_tokens": rng.randint(8, 32),
                                  "stream": i % 2 == 0}})
    spec = FleetSpec(workers=tuple(WorkerSpec(name=f"w{i}", max_num_seqs=16, decode_ms=20.0) for i in range(3)),
                     seed=ctx.seed)
    latencies: list[float] = []
    unconfirmed = 0
    with run_fleet_in_thread(spec) as fleet:
        rendered = _proxies.render([("127.0.0.1", w.port, 16) for w in fleet.workers],
                                   _proxies.PoolConfig(policy="least_request", capacity=16), ctx.work / "rl.envoy")
        with _proxies.run_envoy(rendered) as proxy:
            admin = _Admin(proxy.admin_url)
            job = {"targets": [rendered.url], "requests": requests, "deadline_s": duration, "timeout_s": 30.0}
            proc, out_path = loadgen.start(job, ctx.work, "reload")
            time.sleep(1.0)
            ports = [w.port for w in fleet.workers]
            for k in range(replacements):
                # Every 10th replacement drops a worker; the next one brings it back.
                members = ports if k % 10 != 9 else [p for p in ports if p != ports[k // 10 % len(ports)]]
                eps = [Endpoint("127.0.0.1", p, weight=rng.randint(1, 200), worker=f"127.0.0.1:{p}") for p in members]
                before = int(admin.stats().get("update_success", "0"))
                decided = time.perf_counter()
                doc = render_eds(_proxies.POOL, eps)
                atomic_write(rendered.eds_file, doc)
                confirmed = None
                while time.perf_counter() - decided < 2.0:
                    if int(admin.stats().get("update_success", "0")) > before:
                        confirmed = time.perf_counter()
                        break
                    time.sleep(0.0005)
                if confirmed is None:
                    unconfirmed += 1
                else:
                    latencies.append((confirmed - decided) * 1000)
                time.sleep(gap)
            records = loadgen.collect(proc, out_path, timeout=duration + 60)
    s = _stats.summarize(records)
    p50, p99 = _stats.pct(latencies, 50), _stats.pct(latencies, 99)
    res.tables.append((f"{replacements} EDS replacements {gap * 1000:.0f} ms apart (weights change every time; every "
                       f"10th drops a worker, the next restores it), {rate:.0f} req/s of mixed streaming and "
                       "non-streaming requests",
                       ["replacements", "confirmed", "decision->applied P50 ms", "P99 ms", "max ms", "requests",
                        "lost (non-200 or cut)"],
                       [[str(replacements), str(len(latencies)), fmt_ms(p50), fmt_ms(p99),
                         fmt_ms(max(latencies) if latencies else None), str(s["requests"]), str(s["errors"])]]))
    met = p99 is not None and p99 <= 50 and s["errors"] == 0 and unconfirmed == 0
    res.targets.append(Target("Reload decision -> applied P99, and lost requests", "<= 50 ms, 0 lost",
                              f"P50 {fmt_ms(p50)} ms, P99 {fmt_ms(p99)} ms, {s['errors']} lost", p99, met, 50.0))
    res.raw = {"latencies_ms": latencies, "unconfirmed": unconfirmed, "summary": s}
    res.notes.append("'Decision' is the moment the new endpoint list is known: the timer covers render_eds, "
                     "atomic_write (temp file, fsync, rename, fsync dir) and Envoy applying it, confirmed by "
                     "`cluster.chat.update_success` rising in admin /stats (polled every 0.5 ms).")
    return res
