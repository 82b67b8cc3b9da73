"""`confgen demo`: the whole path on loopback, in about ten seconds.

Start three simulated vLLM workers (one at half speed), render the built-in topology for
them, have the real Envoy validate and serve it, send requests, kill a worker under load,
and show where requests went. Nothing leaves 127.0.0.1; every process started here is
stopped here.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import envoy, runtime
from .output import write_tree
from .topology import parse

DEMO_TOPOLOGY = """\
version: 1
name: demo
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
pools:
  - name: chat
    engine: vllm
    models: [demo-8b]
    aliases: [chat]
    capacity: 16
    balancing: {{policy: least_request, choice_count: 2}}
    health: {{interval: 1s, timeout: 500ms, unhealthy_threshold: 2, no_traffic_interval: 1s}}
    outlier_detection: {{consecutive_gateway_failure: 2, interval: 1s, base_ejection_time: 10s}}
    workers:
{workers}
last_resort: {{kind: error, status: 503, message: Every demo worker is down.}}
"""


def _post(url: str, body: dict[str, object], timeout: float = 15.0) -> tuple[int, str]:
    req = urllib.request.Request(  # noqa: S310 - a loopback URL built here
        url, data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback URL we built
            return resp.status, resp.headers.get("x-sim-worker", "?")
    except urllib.error.HTTPError as err:
        return err.code, "-"
    except OSError:
        return 0, "-"


def _burst(url: str, count: int, tag: str) -> Counter[tuple[int, str]]:
    body = {"model": "chat", "prompt": f"Tell me about {tag}.", "max_tokens": 16}
    with ThreadPoolExecutor(max_workers=8) as pool:
        return Counter(pool.map(lambda _: _post(url, body), range(count)))


def _show(title: str, tally: Counter[tuple[int, str]]) -> None:
    print(f"\n{title}")
    for (status, worker), n in sorted(tally.items()):
        print(f"  {n:4d} x HTTP {status} from {worker}")


def run_demo(requests: int) -> int:
    from .simulate import FleetSpec, WorkerSpec, run_fleet_in_thread

    requests = max(1, min(requests, 500))
    workers = tuple(
        WorkerSpec(name=name, models=("demo-8b", "chat"), speed=speed, max_num_seqs=16, decode_ms=10.0)
        for name, speed in (("a100-0", 1.0), ("a100-1", 1.0), ("a10-slow", 0.5))
    )
    with run_fleet_in_thread(FleetSpec(workers=workers, seed=7)) as fleet, \
            tempfile.TemporaryDirectory(prefix="confgen-demo-") as tmp:
        port, admin = runtime.free_port(), runtime.free_port()
        lines = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)
        topo, _ = parse(DEMO_TOPOLOGY.format(admin=admin, port=port, workers=lines).encode(), "<demo>")
        out = Path(tmp) / "envoy"
        files = envoy.render(topo, config_dir=str(out))
        write_tree(files, out)
        print(f"rendered {len(files)} files: " + ", ".join(sorted(files)))
        problems = runtime.validate_envoy_static(envoy.static_bootstrap(files))
        if problems:
            print("the real Envoy rejected the configuration:\n" + "\n".join(problems), file=sys.stderr)
            return 1
        print("the real Envoy accepts it (envoy --mode validate on the inlined config)")
        with runtime.EnvoyProcess(out / "bootstrap.json") as proxy:
            url = f"http://127.0.0.1:{port}/v1/completions"
            print(f"envoy pid {proxy.pid} serving {url}; admin {proxy.admin_url}")
            _show(f"{requests} requests, least_request over 3 workers (a10-slow runs at half speed):",
                  _burst(url, requests, "least request"))
            fleet.worker("a100-1").crash()
            started = time.monotonic()
            tally = _burst(url, requests, "failover")
            _show(f"a100-1 crashed; {requests} more requests (retries go to another worker):", tally)
            failed = sum(n for (status, _), n in tally.items() if status != 200)
            print(f"  failed requests after the crash: {failed} ({time.monotonic() - started:.1f}s)")
    print("\nstopped envoy and the simulated fleet")
    return 0
