"""Bounded bodies at the edge (issue 26, attacks 6 and 9), on the real Envoy: a body over the
listener's max_request_bytes (default 2 MiB) is answered 413 `request_too_large` before
json_to_metadata parses it and before the endpoint picker (ext_proc, BUFFERED) is sent it; a
prompt under the limit is served. Over HTTP/1 and HTTP/2 alike (the listener's
per-connection buffer limit alone bounded HTTP/1 only; the buffer filter bounds both)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from pathlib import Path

import grpc

from confgen import parse_topology
from confgen.model import DEFAULT_MAX_REQUEST_BYTES
from confgen.runtime import free_port
from tests.support.backends import backends
from tests.support.envoy import request, running_envoy, wait_until

TOPOLOGY = """
version: 1
name: bodies
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
sidecar: {{grpc_port: {grpc}}}
pools:
  - name: chat
    engine: vllm
    models: [m]
    balancing: {{policy: prefix_affinity}}
    health: {{enabled: false}}
    workers: ["127.0.0.1:{a}"]
"""
MB = 1000 * 1000
TICK = os.sysconf("SC_CLK_TCK")
PICKER_STREAMS = "http.public.ext_proc.streams_started"


def integer_array(size: int) -> bytes:
    """`{"model":"m","prompt":[[1,1,...]]}` of `size` bytes: the densest JSON for a parser."""
    head, tail = b'{"model":"m","prompt":[[', b"]]}"
    count = (size - len(head) - len(tail) + 1) // 2
    return head + b",".join([b"1"] * count) + tail


def post_raw(port: int, data: bytes, chunked: bool = False) -> tuple[int, bytes, int]:
    """POST `data` while reading the answer (Envoy may answer, and close, before the body is all
    sent): status, body and the bytes the client got to send."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    framing = b"transfer-encoding: chunked" if chunked else f"content-length: {len(data)}".encode()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n" + framing + b"\r\n\r\n"
    sent = [0]

    def send() -> None:
        try:
            sock.sendall(head)
            for start in range(0, len(data), 65536):
                part = data[start:start + 65536]
                sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n" if chunked else part)
                sent[0] += len(part)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # Envoy answered and closed: the rest is not read

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        body = answer.read()
    finally:
        sock.close()
        sender.join(timeout=30)
    return answer.status, body, sent[0]


def _usage(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) and peak resident MiB (VmHWM) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return (int(fields[11]) + int(fields[12])) / TICK, int(status["VmHWM"].split()[0]) / 1024


def test_an_oversized_body_is_refused_before_envoy_parses_it_or_the_picker_gets_it(tmp_path: Path) -> None:
    """At the default limit, in front of a prefix_affinity pool: an 8 MB dense integer array
    (content-length) and a 7 MB one (chunked: no length to refuse early on; over the picker's
    4 MiB gRPC limit, attack 9) get 413 `request_too_large` in JSON; neither reaches the worker
    or opens a picker stream, and Envoy's peak memory grows by less than 50 MiB. Before (8 MiB
    cap) the 8 MB body was parsed: +694 MiB peak, 0.78-1.44 CPU-s (measured, fresh Envoy); the
    7 MB one waited the picker's 200 ms, then went unpicked. A 1.5 MB text prompt passes."""
    port, admin, grpc = free_port(), free_port(), free_port()
    with backends("a") as (a,):
        text = TOPOLOGY.format(admin=admin, port=port, grpc=grpc, a=a.port)
        topo, _ = parse_topology(text.encode(), "bodies.yaml")
        assert topo.listeners[0].max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 2 * 1024 * 1024
        with running_envoy(text, tmp_path / "out") as proc:
            url = f"http://127.0.0.1:{port}/v1/completions"
            assert wait_until(lambda: request(url, {"model": "m"})[0] == 200)
            served, streams = len(a.requests), proc.stats()[PICKER_STREAMS]
            assert streams >= 1  # the served request opened one (the picker is down: failure_mode_allow)
            cpu0, peak0 = _usage(proc.pid)
            sent = []
            for data, chunked in ((integer_array(8 * MB), False), (integer_array(7 * MB), True)):
                status, body, taken = post_raw(port, data, chunked)
                assert status == 413, (status, body[:200])
                assert json.loads(body)["error"]["code"] == "request_too_large"
                sent.append(taken // 1024)
            cpu1, peak1 = _usage(proc.pid)
            print(f"two refused bodies ({sent} KiB sent): {cpu1 - cpu0:.2f} CPU-s, peak {peak0:.0f} -> {peak1:.0f} MiB")
            assert peak1 - peak0 < 50, (peak0, peak1)
            assert len(a.requests) == served
            assert proc.stats()[PICKER_STREAMS] == streams
            prompt = {"model": "m", "prompt": "x" * (3 * MB // 2)}
            assert post_raw(port, json.dumps(prompt).encode())[0] == 200
            assert len(a.requests) == served + 1


def test_the_limit_holds_over_http2(tmp_path: Path) -> None:
    """grpcio as the HTTP/2 client (prior knowledge, no TLS): a 3 MB request body is answered
    413 `request_too_large` (gRPC status UNKNOWN carrying the JSON), a 1 KB one gets past the
    limit (404 `model_not_found`: it names no model). Before the buffer filter the listener's
    per-connection limit did not hold on HTTP/2: the 3 MB body got 404 like the small one, and
    an 8 MB JSON integer array sent with curl --http2-prior-knowledge was parsed (200, +686
    MiB peak, 0.90 CPU-s)."""
    port, admin, grpc_port = free_port(), free_port(), free_port()
    with backends("a") as (a,):
        text = TOPOLOGY.format(admin=admin, port=port, grpc=grpc_port, a=a.port)
        with running_envoy(text, tmp_path / "out") as proc, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/v1/completions", request_serializer=bytes, response_deserializer=bytes)
            answers = {}
            _, peak0 = _usage(proc.pid)
            for size in (1000, 3 * MB):
                try:
                    call(b"x" * size, timeout=10)
                except grpc.RpcError as err:
                    answers[size] = err.details() or ""
            assert "model_not_found" in answers[1000], answers
            assert "request_too_large" in answers[3 * MB], answers
            assert a.requests == []
            _, peak1 = _usage(proc.pid)
            assert peak1 - peak0 < 50, (peak0, peak1)
