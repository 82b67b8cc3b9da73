"""The abuse campaign (#19) against the ADS control plane: hostile gRPC clients beside a real Envoy.

The sidecar runs as shipped (`python -m sidecar.main --serve-xds` on loopback, plaintext by the
explicit opt-in `--grpc-plaintext-loopback`: the hostile clients need no certificate, the worst
case for the bounds; the default Unix socket admits only the sidecar's user); one real
Envoy (`envoy-0`) is connected and served throughout. Each case measures the sidecar's
resident memory from /proc/<pid>/status (VmRSS, sampled every 50 ms) against its idle size,
the growth of its log, and checks the real Envoy still routes and that no traceback was
printed. Rows go into the campaign table (docs/reliability.md).

- never-reading streams: streams that send big requests as fast as the server takes them and
  never read a response;
- NACK storm: one nonce NACKed again and again with 1 MiB of error text;
- huge and fake node ids: 1 MiB node ids; hundreds of fake nodes that connect and never
  apply the limits (they must not change the count the in-flight limits are divided by);
- the HTTP server: slow request heads, thousands of idle connections, a 50 MiB chunked body,
  a 2,000-deep JSON body.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, run_fleet_in_thread
from tests.faults._campaign import Campaign, Row, size
from tests.sidecar_live.rig import (
    ADMIN_TOKEN,
    SidecarProcess,
    admin_token_args,
    ads_envoy,
    control_plane,
    http,
    poll,
    worker_specs,
)

LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
RTDS = "type.googleapis.com/envoy.service.runtime.v3.Runtime"
MIB = 1024 * 1024

TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
sidecar: {{grpc_plaintext_loopback: true, grpc_port: {grpc}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"], protocol: delta}}
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 4
    health: {{enabled: false}}
    outlier_detection: {{enabled: false}}
    workers:
{workers}
"""


def _channel(port: int) -> grpc.aio.Channel:
    """A channel with its own connection (grpc shares one between channels to a target by default)."""
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class RssPeak:
    """The highest VmRSS of `pid` while the block runs (sampled every 50 ms, bounded in time)."""

    def __init__(self, pid: int, max_seconds: float = 120.0) -> None:
        self._pid, self.peak = pid, rss_kib(pid)
        self._stop = threading.Event()
        self._deadline = time.monotonic() + max_seconds
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05) and time.monotonic() < self._deadline:
            self.peak = max(self.peak, rss_kib(self._pid))

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.peak = max(self.peak, rss_kib(self._pid))


async def _never_reading(port: int, node: str, requests: int, seconds: float) -> int:
    """A stream that sends `requests` padded EDS requests (~0.5 MiB each: 0.5 MiB of error text on a stale
    nonce), switching its subscription each time so that each asks for a new response, and never reads
    one; the count the server took."""
    padding = {"code": 3, "message": "P" * (MIB // 2)}
    sent = 0

    async def gen() -> AsyncIterator[Any]:
        nonlocal sent
        deadline = time.monotonic() + seconds
        for i in range(requests):
            if time.monotonic() > deadline:
                return
            yield discovery_pb2.DiscoveryRequest(node={"id": node}, type_url=EDS, response_nonce="stale",
                                                 resource_names=["chat"] if i % 2 else [], error_detail=padding)
            sent += 1

    async with _channel(port) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(gen())
        await asyncio.sleep(seconds)  # never read a response
        call.cancel()
    return sent


async def _unknown_names(port: int, count: int) -> str:
    """One request subscribing to `count` EDS names that are not served; the status code."""
    async def gen() -> AsyncIterator[Any]:
        yield discovery_pb2.DiscoveryRequest(node={"id": "namer"}, type_url=EDS,
                                             resource_names=[f"pool-{i:05d}-" + "x" * 40 for i in range(count)])
        await asyncio.sleep(30)

    async with _channel(port) as channel:
        try:
            async for _ in ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
                    gen(), timeout=20):
                return "OK"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return "CLOSED"


async def _nack_storm(port: int, node: str, nacks: int) -> int:
    """Read one LDS response, then NACK its nonce `nacks` times with 1 MiB of text each; NACKs sent."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    sent = 0

    async def gen() -> AsyncIterator[Any]:
        nonlocal sent
        yield discovery_pb2.DiscoveryRequest(node={"id": node}, type_url=LDS)
        nonce = await queue.get()
        for _ in range(nacks):
            yield discovery_pb2.DiscoveryRequest(type_url=LDS, response_nonce=nonce,
                                                 error_detail={"code": 3, "message": "N" * (MIB - 1024)})
            sent += 1

    async with _channel(port) as channel:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(gen(), timeout=60)
        response = await call.read()
        await queue.put(response.nonce)
        # the requests end after the last NACK; the server ends the call once it has read them all
        while await call.read() is not grpc.aio.EOF:
            pass
    return sent


async def _huge_ids(port: int, streams: int, length: int) -> list[str]:
    """`streams` calls with a node id of `length` characters; their status codes."""
    async def one(i: int) -> str:
        async def gen() -> AsyncIterator[Any]:
            yield discovery_pb2.DiscoveryRequest(node={"id": f"{i}-" + "h" * length}, type_url=LDS)
            await asyncio.sleep(30)

        async with _channel(port) as channel:
            try:
                async for _ in ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
                        gen(), timeout=20):
                    return "OK"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
        return "CLOSED"

    return list(await asyncio.gather(*(one(i) for i in range(streams))))


@contextmanager
def _fake_nodes(port: int, count: int) -> Iterator[None]:
    """`count` fake nodes, each with an open stream asking for the runtime layer, never ACKing it."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: asyncio.Event | None = None

    async def run() -> None:
        nonlocal stop
        stop = asyncio.Event()
        # the server allows 8 streams per connection: a connection per 8 fake nodes
        channels = [_channel(port) for _ in range((count + 7) // 8)]
        try:
            async def one(i: int) -> None:
                assert stop is not None
                stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channels[i // 8])

                async def gen() -> AsyncIterator[Any]:
                    yield discovery_pb2.DiscoveryRequest(node={"id": f"fake-{i}"}, type_url=RTDS,
                                                         resource_names=["confgen_limits"])
                    await stop.wait()

                call = stub.StreamAggregatedResources(gen(), timeout=120)
                await call.read()  # served, never ACKed
                await stop.wait()
                call.cancel()

            tasks = [asyncio.create_task(one(i)) for i in range(count)]
            ready.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for channel in channels:
                await channel.close()

    thread = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    thread.start()
    ready.wait(30)
    try:
        yield
    finally:
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        loop.close()


def _send(port: int) -> int:
    try:
        return http("POST", f"http://127.0.0.1:{port}/v1/completions",
                    {"model": "sim-model", "prompt": "hi", "max_tokens": 2}, timeout=10)[0]
    except OSError:
        return 0


def test_hostile_ads_clients(tmp_path: Path, campaign: Campaign) -> None:
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["w1", "w2"], max_num_seqs=4), seed=9)) as fleet:
        xds, port = free_port(), free_port()
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)
        text = TOPOLOGY.format(admin=free_port(), port=port, xds=xds, grpc=free_port(), workers=workers)
        topology = tmp_path / "topology.yaml"
        topology.write_text(text)
        with control_plane(topology, xds, tmp_path / "sidecar.log", "--grpc-plaintext-loopback",
                           clean_exit=True) as sidecar:
            assert sidecar.proc is not None
            pid = sidecar.proc.pid
            with ads_envoy(text, tmp_path / "envoy", "envoy-0", any_admin_port=True) as proxy:
                _campaign(sidecar, pid, xds, port, proxy, campaign)
            log = sidecar.log_path.read_text(errors="replace")
            assert "Traceback" not in log, sidecar.log_tail()


def _campaign(sidecar: SidecarProcess, pid: int, xds: int, port: int, proxy: EnvoyProcess,
              campaign: Campaign) -> None:
    assert poll(lambda: sidecar.state()["xds"]["counted_envoys"] == 1, timeout=15), sidecar.state()["xds"]
    assert poll(lambda: _send(port) == 200, timeout=10)
    poll(lambda: False, timeout=1.5)  # a few cycles: the idle size
    idle = rss_kib(pid)
    log = sidecar.log_path

    # 1. Never-reading streams.
    streams, requests, seconds = size(4, 20), size(200, 2000), size(4.0, 15.0)
    before = log.stat().st_size
    with RssPeak(pid) as peak:
        async def never() -> list[int]:
            return list(await asyncio.gather(*(_never_reading(xds, f"reader-{i}", requests, seconds)
                                               for i in range(streams))))
        sent = asyncio.run(never())
    assert peak.peak < 2 * idle, (peak.peak, idle)
    assert _send(port) == 200
    assert asyncio.run(_unknown_names(xds, 5000)) == "RESOURCE_EXHAUSTED"
    campaign.add(Row("ADS: never-reading streams",
                     f"{streams} streams each sending up to {requests} EDS requests padded to ~0.5 MiB, each "
                     f"asking for a new response, for {seconds:g} s, never reading one; a real Envoy served "
                     "beside them; then one subscription to 5,000 names that are not served (refused)",
                     f"{sum(sent)} requests ({sum(sent) // 2} MiB) taken; RSS idle {idle // 1024} MiB, "
                     f"peak {peak.peak // 1024} MiB ({peak.peak / idle:.2f}x); "
                     f"log +{(log.stat().st_size - before) // 1024} KiB",
                     "nothing"))

    # 2. NACK storm on one nonce.
    nacks = size(12, 40)  # beyond an 8 MiB burst the stream is read at 1 MiB/s: ~4 s / ~32 s
    before_log = log.stat().st_size
    before_total = sidecar.state()["xds"]["nacks_total"]
    with RssPeak(pid) as peak:
        storm = asyncio.run(_nack_storm(xds, "nacker", nacks))
    grown = log.stat().st_size - before_log
    counted = sidecar.state()["xds"]["nacks_total"] - before_total
    assert storm == nacks
    assert counted == 1, counted  # the nonce answered once
    assert grown < 64 * 1024, grown
    assert peak.peak < 2 * idle, (peak.peak, idle)
    assert _send(port) == 200
    campaign.add(Row("ADS: NACK storm",
                     f"one stream NACKs the same nonce {nacks} times with 1 MiB of error text each "
                     "(the most a request may carry)",
                     f"{nacks} MiB sent; {counted} NACK recorded; log +{grown // 1024} KiB; "
                     f"RSS peak {peak.peak / idle:.2f}x idle",
                     "nothing"))

    # 3. Huge node ids, then fake nodes.
    huge = size(20, 100)
    before_log = log.stat().st_size
    with RssPeak(pid) as peak:
        big = asyncio.run(_huge_ids(xds, huge, MIB))  # over the 1 MiB message limit: refused by grpc
        codes = asyncio.run(_huge_ids(xds, huge, 64 * 1024))  # within it: refused by the node id check
    grown = log.stat().st_size - before_log
    assert set(big) == {"RESOURCE_EXHAUSTED"}, big
    # refused on the first request; a few may be refused earlier, as streams (REFUSED_STREAM under memory pressure)
    assert "INVALID_ARGUMENT" in codes and set(codes) <= {"INVALID_ARGUMENT", "UNAVAILABLE"}, codes
    state = sidecar.get("/state")[1]
    metrics = sidecar.metrics()
    assert b"hhhhhhhhhh" not in state and "hhhhhhhhhh" not in metrics
    assert grown < 64 * 1024, grown
    fakes = size(100, 300)
    with RssPeak(pid) as peak_fakes, _fake_nodes(xds, fakes):
        assert poll(lambda: len(sidecar.state()["xds"]["nodes"]) == fakes + 1, timeout=30)
        poll(lambda: False, timeout=1.5)  # cycles with the fakes connected
        view = sidecar.state()["xds"]
        assert view["counted_envoys"] == 1, view["counted_envoys"]
        assert "confgen_sidecar_xds_counted_envoys 1.0" in sidecar.metrics()
        assert _send(port) == 200
    assert max(peak.peak, peak_fakes.peak) < 2 * idle
    campaign.add(Row("ADS: huge and fake node ids",
                     f"{huge} streams with a 1 MiB node id, {huge} with a 64 KiB one; then {fakes} fake nodes "
                     "asking for the limits and "
                     "never ACKing them",
                     f"every huge id refused (1 MiB: message too large; 64 KiB: "
                     f"{codes.count('INVALID_ARGUMENT')} INVALID_ARGUMENT, {codes.count('UNAVAILABLE')} streams "
                     "refused), none in /state or /metrics, log "
                     f"+{grown // 1024} KiB; with the fakes connected the limits' count of Envoys stayed 1; "
                     f"RSS peak {max(peak.peak, peak_fakes.peak) / idle:.2f}x idle",
                     "nothing"))
    assert proxy.admin_get("/ready")[0] == 200


def _closed_within(socks: list[socket.socket], timeout: float) -> tuple[int, float]:
    """How many of `socks` the server closed within `timeout`, and when the last one went (s)."""
    started = time.monotonic()
    poller = select.poll()  # (select() stops at descriptor 1024)
    by_fd = {}
    for s in socks:
        s.setblocking(False)
        by_fd[s.fileno()] = s
        poller.register(s, select.POLLIN | select.POLLHUP | select.POLLERR)
    last = 0.0
    closed = 0
    while by_fd and time.monotonic() - started < timeout:
        for fd, _ in poller.poll(200):
            s = by_fd[fd]
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                del by_fd[fd]
                closed += 1
                last = time.monotonic() - started
    return closed, last


def test_hostile_http_clients(tmp_path: Path, campaign: Campaign) -> None:
    """The sidecar's HTTP server (as shipped) against the issue's HTTP abuse: slow headers, thousands
    of idle connections, a 50 MiB chunked body, a 2,000-deep JSON body. RSS < 2x idle, no traceback."""
    xds, listen = free_port(), free_port()
    topology = tmp_path / "topology.yaml"
    topology.write_text(TOPOLOGY.format(admin=free_port(), port=free_port(), xds=xds, grpc=free_port(),
                                        workers=f"      - 127.0.0.1:{free_port()}"))
    sidecar = SidecarProcess(["--topology", str(topology), "--serve-xds", f"127.0.0.1:{xds}",
                              *admin_token_args(tmp_path), "--grpc-plaintext-loopback",
                              "--listen", f"127.0.0.1:{listen}", "--interval", "0.5"],
                             tmp_path / "sidecar.log",
                             listen)
    sidecar.start()
    try:
        assert poll(lambda: _healthz(sidecar), timeout=30), sidecar.log_tail()
        assert sidecar.proc is not None
        pid = sidecar.proc.pid
        poll(lambda: False, timeout=1.0)
        idle = rss_kib(pid)
        slow_n, idle_n = size(300, 300), size(600, 3000)
        with RssPeak(pid) as peak:
            # slow headers: a request head that never ends
            slow = [socket.create_connection(("127.0.0.1", listen), timeout=5) for _ in range(slow_n)]
            for s in slow:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            closed_slow, last_slow = _closed_within(slow, 30.0)
            for s in slow:
                s.close()
            # idle connections beyond the cap: closed at accept; the ones within it by the idle timeout
            held = [socket.create_connection(("127.0.0.1", listen), timeout=5) for _ in range(idle_n)]
            closed_idle, last_idle = _closed_within(held, 30.0)
            for s in held:
                s.close()
            # a 50 MiB chunked body and a 2,000-deep JSON body to /drain, from a client with the token
            # (without it the answer is 403 before a byte of the body is read)
            sent, answer = _chunked_body(listen, 50 * MIB)
            deep = b"[" * 2000 + b"]" * 2000
            status, body = _post(listen, deep)
        assert closed_slow == slow_n and last_slow < 10 + 10, (closed_slow, last_slow)
        assert closed_idle == idle_n and last_idle < 10 + 10, (closed_idle, last_idle)
        assert answer.startswith(b"HTTP/1.1 413") and sent < 4 * MIB, (answer[:60], sent)
        assert status == 400 and json.loads(body)["error"], (status, body)
        assert peak.peak < 2 * idle, (peak.peak, idle)
        assert _healthz(sidecar)
        assert "Traceback" not in sidecar.log_path.read_text(errors="replace")
        campaign.add(Row("HTTP: slow headers, idle connections, big and deep bodies",
                         f"{slow_n} connections sending a request head that never ends; {idle_n} idle "
                         "connections (cap 256); a 50 MiB chunked body and a 2,000-deep JSON body to /drain",
                         f"slow heads all closed, the last after {last_slow:.1f} s (timeout 10 s); idle connections "
                         f"all closed, the last after {last_idle:.1f} s ({idle_n - 256} at accept); chunked: 413 "
                         f"after {sent // 1024} KiB sent; deep JSON: 400; RSS peak {peak.peak / idle:.2f}x idle",
                         "nothing"))
    finally:
        assert sidecar.stop() == 0, sidecar.log_tail()


def _healthz(sidecar: SidecarProcess) -> bool:
    try:
        return sidecar.get("/healthz")[0] == 200
    except OSError:
        return False


_AUTH = f"Authorization: Bearer {ADMIN_TOKEN}\r\n".encode()


def _chunked_body(port: int, total: int) -> tuple[int, bytes]:
    """POST /drain with a chunked body of up to `total` bytes, reading as it sends; (bytes sent, answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /drain HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + _AUTH +
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n" % 65536 + b"[" * 65536 + b"\r\n"
        sent, answer = 0, b""
        sock.setblocking(False)
        deadline = time.monotonic() + 30
        while sent < total and b"\r\n\r\n" not in answer and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 0.5)  # one low descriptor
            if readable:
                try:
                    data = sock.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                answer += data
            elif writable:
                try:
                    sent += sock.send(chunk)
                except (BlockingIOError, OSError):
                    continue
        return sent, answer


def _post(port: int, body: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /drain HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + _AUTH +
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        data = b""
        while True:
            part = sock.recv(65536)
            if not part:
                break
            data += part
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload
