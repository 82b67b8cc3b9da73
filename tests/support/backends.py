"""A tiny HTTP backend on loopback that says who it is (stdlib only, one thread per request)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class TinyBackend:
    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                with backend._lock:
                    backend.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                payload = json.dumps({"worker": backend.name, "path": self.path}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.send_header("x-backend", backend.name)
                self.end_headers()
                self.wfile.write(payload)

            do_GET = _answer
            do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> TinyBackend:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


@contextmanager
def backends(*names: str) -> Iterator[list[TinyBackend]]:
    started: list[TinyBackend] = []
    try:
        for name in names:
            started.append(TinyBackend(name).__enter__())
        yield started
    finally:
        for b in started:
            b.__exit__(None, None, None)
