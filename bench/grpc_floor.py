"""What one rate limit check or picker stream costs in transport alone: Envoy -> a Python gRPC server.

    python -m bench.grpc_floor [--rate 200] [--requests 4000] [--rounds 2] [--kinds aio,sync,none,extproc]

Issue 30 asks where the check's time goes before choosing how to make it cheaper. This isolates
the floor under the sidecar's rate limit service: one real Envoy, two listeners with the same
`envoy.filters.http.ratelimit` filter and a direct_response route, one listener's route carrying
a rate limit action (every request makes one `ShouldRateLimit` call), the other's none; the open
loop load generator (bench.loadgen, its own process) alternates the two, so both halves meet the
machine alike, and the difference of their percentiles is what the call adds. The server is a
process of its own that answers OK at once, written two ways:

    aio    grpc.aio (what the sidecar runs: one asyncio loop, grpc's poller thread hands it events)
    sync   grpc.server on a thread pool (grpc's C-core threads call the servicer directly)
    none   the aio server runs but neither route has an action: the A/A row (what two halves
           of one Envoy differ by when nothing is called), the noise under the other two
    extproc  the same for the endpoint picker (issue 28's cost target): the checked listener runs
           the product's own ext_proc filter (confgen's rendered settings: headers sent, body
           buffered, the stream held to the response's end) against a grpc.aio processor that
           answers every message at once with nothing, the free listener no ext_proc
    extproc-grpclib  the same processor on grpclib (pure-Python HTTP/2 by h2, all on the asyncio
           loop, no poller thread): what another Python gRPC stack would save (bench extra)

Nothing of the product's service runs (no descriptors, no Redis): this is the price of the
gRPC layer a Python service cannot go under, per kind. Bounded: `--requests` per round, each
request 10 s, the whole round its schedule + 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

from bench import loadgen
from bench._harness import wait_until
from bench._procstat import cpu_s
from bench._stats import pct
from confgen.binaries import stop_process
from confgen.runtime import EnvoyProcess, free_port

KINDS = ("aio", "sync", "none", "extproc", "extproc-grpclib")
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def _serve_extproc(port: int) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    answers = {"request_headers": pb.HeadersResponse, "response_headers": pb.HeadersResponse,
               "request_body": pb.BodyResponse, "response_body": pb.BodyResponse,
               "request_trailers": pb.TrailersResponse, "response_trailers": pb.TrailersResponse}

    class Processor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, request_iterator: Any, context: Any) -> Any:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind in answers:
                    yield pb.ProcessingResponse(**{kind: answers[kind]()})

    _run_aio(lambda server: pb_grpc.add_ExternalProcessorServicer_to_server(Processor(), server), port)


def _serve_extproc_grpclib(port: int) -> None:
    """The same do-nothing processor on grpclib (HTTP/2 by h2, on the asyncio loop; no poller thread)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    answers = {"request_headers": pb.HeadersResponse, "response_headers": pb.HeadersResponse,
               "request_body": pb.BodyResponse, "response_body": pb.BodyResponse,
               "request_trailers": pb.TrailersResponse, "response_trailers": pb.TrailersResponse}

    class Processor:
        async def process(self, stream: Any) -> None:
            async for request in stream:
                kind = request.WhichOneof("request")
                if kind in answers:
                    await stream.send_message(pb.ProcessingResponse(**{kind: answers[kind]()}))

        def __mapping__(self) -> dict[str, Any]:
            return {"/envoy.service.ext_proc.v3.ExternalProcessor/Process": Handler(
                self.process, Cardinality.STREAM_STREAM, pb.ProcessingRequest, pb.ProcessingResponse)}

    async def main() -> None:
        server = Server([Processor()])
        await server.start("127.0.0.1", port)
        await server.wait_closed()

    asyncio.run(main())


def _run_aio(register: Callable[[Any], None], port: int) -> None:
    """A grpc.aio server on loopback `port` with what `register` adds, until it is terminated."""
    import grpc

    async def main() -> None:
        server = grpc.aio.server()
        register(server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _serve(kind: str, port: int) -> None:
    if kind == "extproc":
        _serve_extproc(port)
        return
    if kind == "extproc-grpclib":
        _serve_extproc_grpclib(port)
        return
    import grpc
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    ok = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)

    if kind == "aio":
        class AioServicer(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
            async def ShouldRateLimit(self, request: Any, context: Any) -> Any:
                return ok

        _run_aio(lambda server: rls_pb2_grpc.add_RateLimitServiceServicer_to_server(AioServicer(), server), port)
        return

    class SyncServicer(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
        def ShouldRateLimit(self, request: Any, context: Any) -> Any:
            return ok

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(SyncServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def _hcm(name: str, route: dict[str, Any], filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {"@type": _HCM, "stat_prefix": name,
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
            "http_filters": [*filters, {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}


def _listener(name: str, port: int, hcm: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def _cluster(name: str, port: int, http2: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "type": "STATIC", "connect_timeout": "1s",
                           "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                               {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                            "port_value": port}}}}]}]}}
    if http2:
        out["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return out


def _extproc_filter() -> dict[str, Any]:
    """The ext_proc filter confgen renders before the endpoint picker (inside its bypass matcher, as
    rendered: the share 0), pointed at this bench's server."""
    from confgen.envoy._listener import _picker_filter

    config = copy.deepcopy(_picker_filter())
    inner = config["typed_config"]["extension_config"]["typed_config"]
    inner["grpc_service"]["envoy_grpc"]["cluster_name"] = "rls"
    return config


def bootstrap(free: int, checked: int, backend: int, rls: int, call: bool = True,
              extproc: bool = False) -> dict[str, Any]:
    """Listeners `free` and `checked` proxy to `backend` (a direct_response listener of the same
    Envoy: the rate limit filter needs a route with an upstream); only `checked`'s route has a
    rate limit action, so only its requests call the server on `rls`. With `extproc`, `checked`
    runs the picker's ext_proc filter instead and `free` none."""
    ratelimit = {"name": "envoy.filters.http.ratelimit", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
        "domain": "floor", "timeout": "0.1s", "failure_mode_deny": False,
        "rate_limit_service": {"transport_api_version": "V3",
                               "grpc_service": {"envoy_grpc": {"cluster_name": "rls"}}}}}
    plain: dict[str, Any] = {"match": {"prefix": "/"}, "route": {"cluster": "backend"}}
    limited: dict[str, Any] = {"match": {"prefix": "/"}, "route": {
        "cluster": "backend", "rate_limits": [{"actions": [{"generic_key": {"descriptor_value": "floor"}}]}]}}
    if not call:
        limited = plain
    answer = {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}
    free_filters, checked_filters = [ratelimit], [ratelimit]
    if extproc:
        free_filters, checked_filters, limited = [], [_extproc_filter()], plain
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [_listener("free", free, _hcm("free", plain, free_filters)),
                          _listener("checked", checked, _hcm("checked", limited, checked_filters)),
                          _listener("backend", backend, _hcm("backend", answer, []))],
            "clusters": [_cluster("backend", backend, False), _cluster("rls", rls, True)]},
    }


@contextlib.contextmanager
def _server(kind: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--serve", kind, "--port", str(port)])
    try:
        wait_until(lambda: proc.poll() is not None or _listening(port), 15)
        if proc.poll() is not None or not _listening(port):
            raise RuntimeError(f"{kind} server did not start")
        yield proc
    finally:
        stop_process(proc, timeout=5)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _job(rate: float, count: int) -> dict[str, Any]:
    return {"targets": None, "path": "/", "deadline_s": count / rate + 5, "timeout_s": 10, "max_in_flight": 500,
            "requests": [{"i": i, "t": i / rate, "body": {"max_tokens": 1}, "headers": {}} for i in range(count)]}


def _round(kind: str, rate: float, count: int, workdir: Path) -> dict[str, Any]:
    free, checked, backend, rls = free_port(), free_port(), free_port(), free_port()
    with (_server("aio" if kind == "none" else kind, rls) as server,
          EnvoyProcess(bootstrap(free, checked, backend, rls, call=kind != "none",
                                 extproc=kind.startswith("extproc"))) as envoy):
        proc, path = loadgen.start(_job(rate, count), workdir, f"{kind}-{time.monotonic_ns()}")
        cpu0 = cpu_s(server.pid)
        loadgen.go(proc, [f"http://127.0.0.1:{free}", f"http://127.0.0.1:{checked}"])
        records = loadgen.collect(proc, path, count / rate + 60)
        cpu = cpu_s(server.pid) - cpu0
        stats = envoy.stats()
    warm = [r for r in records if r["sched"] >= 1.0]  # the first second warms connections
    halves = {name: sorted(r["end"] - r["sched"] for r in warm if r["i"] % 2 == parity and r["status"] == 200)
              for name, parity in (("free", 0), ("checked", 1))}
    failed = sum(1 for r in records if r["status"] != 200)
    out: dict[str, Any] = {"kind": kind, "rate": rate, "requests": count, "failed": failed,
                           "server_cpu_s": round(cpu, 3), "server_cpu_ms_per_call": round(1000 * cpu / (count / 2), 3),
                           "calls_ok": stats.get("cluster.rls.upstream_rq_200", 0),
                           "checks_failed_open": sum(int(stats.get(name, 0)) for name in (
                               "cluster.backend.ratelimit.failure_mode_allowed",
                               "http.checked.ext_proc.failure_mode_allowed")),
                           "extproc_messages_sent": stats.get("http.checked.ext_proc.stream_msgs_sent", 0)}
    for q in (50, 90, 99):
        f, c = pct(halves["free"], q) or 0.0, pct(halves["checked"], q) or 0.0
        out[f"p{q}_free_ms"], out[f"p{q}_checked_ms"] = round(1000 * f, 3), round(1000 * c, 3)
        out[f"p{q}_added_ms"] = round(1000 * (c - f), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--out", type=Path)
    p.add_argument("--serve", choices=("aio", "sync", "extproc", "extproc-grpclib"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        _serve(args.serve, args.port)
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in KINDS for k in kinds):
        p.error(f"--kinds: choose from {', '.join(KINDS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpc-floor-") as tmp:
        for r in range(args.rounds):
            for kind in kinds:  # interleaved rounds: a drift of the machine meets both kinds
                row = _round(kind, args.rate, args.requests, Path(tmp))
                row["round"] = r
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
