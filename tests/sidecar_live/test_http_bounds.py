"""The sidecar's HTTP server under hostile clients, with raw sockets against the shipped process.

`python -m sidecar.main` (control-plane mode on loopback: no Envoy needed beside it), its
default bounds (sidecar.serve.bounds): a connection cap of 256, a 10 s header/idle timeout,
a 5 s body timeout, bodies over 4 KiB refused before being read, JSON depth 8, errors as
JSON. Wall time ~25 s (two timeouts are waited out).
"""

from __future__ import annotations

import errno
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from confgen.runtime import free_port
from sidecar.logs import clip
from tests.sidecar_live.rig import ADMIN_TOKEN, SidecarProcess, admin_token_args, poll
from tests.sidecar_live.rig import http as call

TOPOLOGY = """\
version: 1
name: bounds
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
sidecar: {{grpc_socket_dir: {sockets}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"]}}
pools:
  - name: chat
    engine: vllm
    models: [m]
    workers: ["127.0.0.1:{worker}"]
"""
HEADER_TIMEOUT, BODY_TIMEOUT, CAP, PER_PEER, SEND_TIMEOUT = 10.0, 5.0, 256, 32, 5.0


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    tmp = tmp_path_factory.mktemp("bounds")
    xds, listen = free_port(), free_port()
    topology = tmp / "topology.yaml"
    topology.write_text(TOPOLOGY.format(admin=free_port(), port=free_port(), xds=xds, worker=free_port(),
                                        sockets=tmp / "sockets"))
    proc = SidecarProcess(["--topology", str(topology), "--serve-xds", f"127.0.0.1:{xds}", *admin_token_args(tmp),
                           "--listen", f"127.0.0.1:{listen}", "--interval", "0.5"], tmp / "sidecar.log", listen)
    proc.start()
    try:
        assert poll(lambda: _healthy(proc), timeout=30), proc.log_tail()
        yield proc
        log = proc.log_path.read_text(errors="replace")
        assert "Traceback" not in log, clip(proc.log_tail(), 2000)
    finally:
        assert proc.stop() == 0, proc.log_tail()


def _healthy(proc: SidecarProcess) -> bool:
    try:
        return proc.get("/healthz")[0] == 200
    except OSError:
        return False


def _port(proc: SidecarProcess) -> int:
    return int(proc.url.rsplit(":", 1)[1])


@contextmanager
def _conn(port: int, timeout: float = 10.0) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        yield sock
    finally:
        sock.close()


def _closed(sock: socket.socket, timeout: float) -> bool:
    """True when the server closes `sock` within `timeout` (reads and drops what it answers meanwhile)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:  # reset: closed too
        return True
    return False


def _answer(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict[str, object] | None]:
    """Status and JSON body of the response on `sock` (Content-Length framed; the server closes or not)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    with suppress(ValueError):
        return status, json.loads(body)
    return status, None


def _request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: sidecar", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _from(peer: int, port: int) -> socket.socket:
    """A connection to the sidecar from 127.0.0.<peer> (every 127/8 address is this host's loopback)."""
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(f"127.0.0.{peer}", 0))


def test_connection_cap(sidecar: SidecarProcess) -> None:
    """At most CAP connections at once, however many addresses they come from (PER_PEER each here)."""
    port = _port(sidecar)
    held: list[socket.socket] = []
    try:
        for i in range(CAP + 40):
            held.append(_from(10 + i // PER_PEER, port))
        # the ones beyond the cap are closed at accept (in order), the ones within it stay open
        assert _closed(held[-1], 5.0)
        open_ = sum(not _closed(s, 0.01) for s in held)
        assert CAP - 10 <= open_ <= CAP, open_  # (a slot or two may still be held by an earlier request)
        assert not any(_closed(s, 0.01) for s in held[:CAP - 10])
    finally:
        for s in held:
            s.close()
    assert poll(lambda: _healthy(sidecar), timeout=10)


def test_one_address_holds_at_most_its_share_and_the_others_are_answered(sidecar: SidecarProcess) -> None:
    """Found by review: one client holding all 256 slots kept /healthz from the kubelet unanswered (its
    liveness probe would restart the sidecar). One address gets PER_PEER; beyond, closed at accept; another
    address is still answered meanwhile."""
    port = _port(sidecar)
    held = [_from(7, port) for _ in range(PER_PEER + 8)]
    try:
        assert all(_closed(s, 5.0) for s in held[PER_PEER:])
        assert not any(_closed(s, 0.01) for s in held[:PER_PEER])
        with _from(8, port) as other:
            other.sendall(_request("GET", "/healthz", {}))
            assert _answer(other)[0] == 200
    finally:
        for s in held:
            s.close()


def test_a_client_that_never_reads_its_answers_is_cut_after_the_send_timeout(sidecar: SidecarProcess) -> None:
    """Found by review: requests pipelined on a connection that never reads its answers held the slot for
    good (the header/idle timeout does not run while answers are being written). Once its answers stop
    moving for SEND_TIMEOUT the connection is aborted (a reset), whatever the route."""
    port = _port(sidecar)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind(("127.0.0.9", 0))
    sock.settimeout(5)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(_request("GET", "/metrics", {}) * 400)
        started = time.monotonic()

        def reset() -> bool:  # the pending error, read without reading (and so draining) the answers
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in (errno.ECONNRESET, errno.EPIPE)

        assert poll(reset, timeout=SEND_TIMEOUT + 10)
        assert time.monotonic() - started >= SEND_TIMEOUT - 0.5
    finally:
        sock.close()
    assert poll(lambda: _healthy(sidecar), timeout=10)


def test_requests_it_cannot_parse_cost_a_bounded_log(sidecar: SidecarProcess) -> None:
    """Found by review: aiohttp logged each unparsable request at ERROR with a traceback and the client's
    bytes (a 460,000-character line; 200 connections wrote 24 MB in 0.04 s). Now clipped, no traceback, at
    most a burst a minute: 100 such requests of 200 KB add a few kilobytes."""
    port = _port(sidecar)
    before = sidecar.log_path.stat().st_size
    for i in range(100):
        with _from(50 + i // 25, port) as sock:
            sock.sendall(b"a" * 200_000 + b"\r\n\r\n")
            _closed(sock, 5.0)
    grown = sidecar.log_path.stat().st_size - before
    assert grown < 20 * 1024, grown
    traceback_logged = "Traceback" in sidecar.log_path.read_text(errors="replace")
    assert not traceback_logged
    assert poll(lambda: _healthy(sidecar), timeout=10)


def test_slow_header_and_idle_connections_closed_within_the_timeout(sidecar: SidecarProcess) -> None:
    port = _port(sidecar)
    slow = [_from(40 + i // 25, port) for i in range(50)]  # within each address's share
    idle = _from(45, port)
    try:
        for s in slow:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
        idle.sendall(_request("GET", "/healthz", {}))
        assert _answer(idle)[0] == 200  # kept alive, then idle
        started = time.monotonic()
        assert all(_closed(s, HEADER_TIMEOUT + 10) for s in slow)
        assert _closed(idle, HEADER_TIMEOUT + 10)
        waited = time.monotonic() - started
        assert waited < HEADER_TIMEOUT + 10, waited
    finally:
        for s in [*slow, idle]:
            s.close()


def test_bodies_refused_before_being_read(sidecar: SidecarProcess) -> None:
    port = _port(sidecar)
    json_headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"}
    # Content-Length over the limit: answered from the head, the body never sent
    with _conn(port) as sock:
        sock.sendall(_request("POST", "/drain", {**json_headers, "Content-Length": str(50 * 1024 * 1024)}))
        status, body = _answer(sock)
        assert status == 413 and body is not None and "error" in body
    # chunked: answered after just past the limit, not after 50 MiB. `sent` counts what the
    # kernel took, so this socket's send buffer is fixed small: left to autotune (up to
    # tcp_wmem's 4 MiB) it held 4.5 MiB while the loaded server had read next to nothing
    with _conn(port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.sendall(_request("POST", "/drain", {**json_headers, "Transfer-Encoding": "chunked"}))
        chunk = b"%x\r\n" % 65536 + b"[" * 65536 + b"\r\n"
        sent = 0
        sock.settimeout(0.0)
        answer = b""
        while sent < 50 * 1024 * 1024 and b"\r\n\r\n" not in answer:
            with suppress(BlockingIOError):
                answer += sock.recv(65536)
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                time.sleep(0.001)  # the server stopped reading: its answer is on its way
            except OSError:
                break
        assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
        assert sent < 4 * 1024 * 1024, sent
    # a body that never completes: 408 within the body timeout
    with _conn(port) as sock:
        started = time.monotonic()
        sock.sendall(_request("POST", "/drain", {**json_headers, "Content-Length": "100"}, b'{"pool": '))
        status, _ = _answer(sock, timeout=BODY_TIMEOUT + 10)
        assert status == 408 and time.monotonic() - started < BODY_TIMEOUT + 10


def test_errors_are_json_answers(sidecar: SidecarProcess) -> None:
    port = _port(sidecar)
    deep = b"[" * 2000 + b"]" * 2000
    token = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"}
    for method, path, headers, body, expected in [
        ("POST", "/drain", token, deep, 400),
        ("POST", "/drain", token, b'{"pool": ' + b"[" * 2000, 400),
        ("POST", "/drain", token, b"{not json", 400),
        ("POST", "/drain", {"Content-Type": "application/json"}, b"{}", 401),  # no token
        ("GET", "/no-such-path", {}, b"", 404),
        ("DELETE", "/metrics", {}, b"", 405),
        ("POST", "/", {"Content-Type": "application/json"}, b"{}", 405),  # the status page is read-only
    ]:
        with _conn(port) as sock:
            sock.sendall(_request(method, path, {**headers, "Content-Length": str(len(body))}, body))
            status, answer = _answer(sock)
            assert status == expected, (path, status, answer)
            assert isinstance(answer, dict) and isinstance(answer.get("error"), str), (path, answer)
    assert _healthy(sidecar)


def test_the_status_page_of_the_shipped_process_forbids_scripts(sidecar: SidecarProcess) -> None:
    """GET / of `python -m sidecar.main` (control-plane mode): HTML under a CSP that allows no script,
    no frame, no form; read-only (POST is 405 above); the same server, so the same bounds."""
    status, headers, body = call("GET", sidecar.url + "/")
    assert status == 200 and headers["content-type"].startswith("text/html"), (status, headers)
    csp = headers["content-security-policy"]
    assert csp.startswith("default-src 'none';") and "frame-ancestors 'none'" in csp and "script" not in csp
    assert b"<script" not in body and b"bounds" in body  # the topology's name
    assert b'data-pool="chat"' in body


def test_json_depth() -> None:
    from sidecar.serve.guard import json_depth

    assert json_depth(b'{"a": "[[[[{{{{"}') == 1
    assert json_depth(b'{"a": "\\"[[[["}') == 1
    assert json_depth(b"[[[]]]") == 3
    assert json_depth(b"[" * 2000) == 2000
    assert json_depth(b"") == 0


def test_envoy_lists_models_within_the_sidecars_share_for_one_address() -> None:
    """Envoy beside the sidecar asks it for /v1/models from loopback, one address: its cluster opens at most
    half of what the sidecar accepts from one address (a burst of listings queues in Envoy), so a burst never
    meets the per-address cap, and a local client still has connections left."""
    from confgen.envoy._clusters import SIDECAR_MAX_CONNECTIONS
    from sidecar.serve.bounds import HttpBounds

    assert HttpBounds().max_per_peer // 2 >= SIDECAR_MAX_CONNECTIONS
