"""Where a rate limit check's time goes inside the sidecar, measured in one process on a real redis-server.

    python -m bench.ratelimit_profile [--checks 2000] [--in-flight 0,100,1000]

Per check, wall and CPU time of: the whole servicer call (ShouldRateLimit, no gRPC), the
Redis script alone (RedisCounter.decide with the same ops), and the rest (descriptors and
answer) as the difference; for a request budget, and for a token budget's check-and-reserve
with N other reservations held on the same key (the script sums them: its cost grows with N).
The gRPC layer's own cost is measured by bench.ratelimit_bench (end to end through Envoy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import wrappers_pb2
from prometheus_client.registry import CollectorRegistry

from confgen.runtime import RedisProcess
from confgen.topology import parse
from sidecar.outputs.ratelimit import RateLimitService
from sidecar.outputs.ratelimit.store import RedisCounter

_TOPOLOGY = """\
version: 1
name: prof
listeners: [{{name: public, port: 8080}}]
pools: [{{name: p, engine: vllm, models: [m], workers: ["127.0.0.1:8000"], max_output_tokens: 100}}]
auth:
  api_keys:
    - {{client: alice, env: A}}
limits:
  store: {{redis: "{redis}", envoys: 3}}
  per_key:
    - {{scope: global, requests: 10000000, window: hour}}
    - {{scope: global, unit: total_tokens, tokens: 1000000000000, window: hour}}
"""


def _descriptor(limit: str, **extra: str) -> Any:
    entries = [ratelimit_pb2.RateLimitDescriptor.Entry(key="confgen_limit", value=limit),
               ratelimit_pb2.RateLimitDescriptor.Entry(key="client", value="alice")]
    entries += [ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in extra.items()]
    d = ratelimit_pb2.RateLimitDescriptor(entries=entries)
    if limit == "per_key/1":
        d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=0))
    return d


async def _measure(service: RateLimitService, counter: RedisCounter, checks: int, in_flight: int) -> dict[str, Any]:
    # N reservations held on the token key (requests in flight that never end during the run)
    for i in range(in_flight):
        await service.ShouldRateLimit(rls_pb2.RateLimitRequest(domain="confgen.prof", descriptors=[
            _descriptor("per_key/1", request_id=f"held-{i}", max_output="10", body_bytes="40", hold_s="3600")]), None)
    out: dict[str, Any] = {"in_flight": in_flight}
    for name, make in (
        ("requests", lambda i: [_descriptor("per_key/0")]),
        ("tokens", lambda i: [_descriptor("per_key/1", request_id=f"r-{in_flight}-{i}", max_output="10",
                                          body_bytes="40", hold_s="1")]),
    ):
        requests = [rls_pb2.RateLimitRequest(domain="confgen.prof", descriptors=make(i)) for i in range(checks)]
        wall, cpu = time.perf_counter(), time.process_time()
        for request in requests:
            answer = await service.ShouldRateLimit(request, None)
            assert answer.overall_code == rls_pb2.RateLimitResponse.OK
        call_wall, call_cpu = (time.perf_counter() - wall) / checks, (time.process_time() - cpu) / checks
        # the script alone, with the ops the service built (one request's)
        table = service._table_now()  # the bench reads the service's own resolution of the descriptors
        ops = [found[1] for d in requests[0].descriptors
               if (found := service._op(table, d, 0, time.time())) is not None]
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(checks):
            await counter.decide(ops, time.time())
        script_wall, script_cpu = (time.perf_counter() - wall) / checks, (time.process_time() - cpu) / checks
        out[name] = {"servicer_ms": round(call_wall * 1000, 3), "servicer_cpu_ms": round(call_cpu * 1000, 3),
                     "script_ms": round(script_wall * 1000, 3), "script_cpu_ms": round(script_cpu * 1000, 3),
                     "rest_ms": round((call_wall - script_wall) * 1000, 3)}
    return out


async def _run(checks: int, in_flight: list[int]) -> list[dict[str, Any]]:
    results = []
    with RedisProcess() as redis:
        topo, _ = parse(_TOPOLOGY.format(redis=redis.address).encode(), "prof.yaml")
        for n in in_flight:
            registry = CollectorRegistry()
            service = RateLimitService(lambda: topo, registry, time.monotonic, flush_interval_s=3600)
            await service.start()
            counter = RedisCounter("127.0.0.1", redis.port, 1.0)
            try:
                results.append(await _measure(service, counter, checks, n))
            finally:
                await counter.close()
                await service.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=2000)
    parser.add_argument("--in-flight", default="0,100,1000")
    args = parser.parse_args()
    counts = [int(n) for n in args.in_flight.split(",") if n]
    print(json.dumps(asyncio.run(_run(min(args.checks, 20_000), counts)), indent=1))


if __name__ == "__main__":
    main()
