"""Weights via the sidecar's pure core, driven by the bench harness (not the sidecar daemon).

    python -m bench._weights_core CONFIG.json

Every `interval_s`: GET each endpoint's /metrics (aiohttp, one deadline per probe),
`sidecar.engines.extract` -> `sidecar.weights.Trend.observe` (per endpoint) ->
`sidecar.weights.relative_speeds` (over the pool) -> `sidecar.weights.weight` (default
WeightPolicy, EWMA over the last published weight): the daemon's weight path. Then
`confgen.envoy.render_eds` + `confgen.output.atomic_write` into each EDS path when the
content changed. Health is left HEALTHY and nothing else is done: no state machine and,
unlike the daemon, no in-flight limit (backpressure). Runs until
`duration_s` or SIGTERM.

CONFIG: {"pool": name, "endpoints": [{"port", "capacity", "metrics_url"}], "eds_paths": [...],
         "interval_s": float, "duration_s": float}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

from confgen.envoy import Endpoint, render_eds
from confgen.output import atomic_write
from sidecar.engines import LoadSample, MetricsFormatError, extract
from sidecar.weights import Trend, WeightPolicy, relative_speeds, weight

_ACCEPT = {"Accept": "text/plain;version=0.0.4"}


async def _sample(session: aiohttp.ClientSession, url: str, deadline_s: float) -> LoadSample | None:
    try:
        async with asyncio.timeout(deadline_s), session.get(url, headers=_ACCEPT) as resp:
            if resp.status != 200:
                return None
            return extract("vllm", await resp.read())
    except (aiohttp.ClientError, TimeoutError, MetricsFormatError):
        return None


async def run(config: dict[str, Any]) -> None:
    interval = float(config["interval_s"])
    policy = WeightPolicy()
    endpoints: list[dict[str, Any]] = config["endpoints"]
    previous: dict[int, int] = {}
    trends: dict[int, Trend] = {}
    last_doc = b""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    end = loop.time() + float(config["duration_s"])
    async with aiohttp.ClientSession() as session:
        while not stop.is_set() and loop.time() < end:
            started = loop.time()
            samples = await asyncio.gather(*(_sample(session, ep["metrics_url"], interval * 0.75) for ep in endpoints))
            now = loop.time()
            for ep, sample in zip(endpoints, samples, strict=True):
                port = int(ep["port"])
                trends[port] = trends.get(port, Trend()).observe(sample, now, policy)
            speeds = relative_speeds({port: t.token_latency_s for port, t in trends.items()})
            out = []
            for ep, sample in zip(endpoints, samples, strict=True):
                port = int(ep["port"])
                w = weight(sample, int(ep["capacity"]), previous.get(port), policy,
                           speed=speeds[port], queue=trends[port].queue)
                previous[port] = w
                out.append(Endpoint("127.0.0.1", port, weight=w, worker=f"127.0.0.1:{port}"))
            doc = render_eds(config["pool"], out)
            if doc != last_doc:
                for path in config["eds_paths"]:
                    await asyncio.to_thread(atomic_write, Path(path), doc)
                last_doc = doc
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, started + interval - loop.time()))


def main(argv: list[str]) -> int:
    asyncio.run(run(json.loads(Path(argv[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
