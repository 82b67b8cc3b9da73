"""`python -m sidecar.drain`: drain the Envoy next to us before the pod stops (a preStop hook).

    1. POST /healthcheck/fail   Envoy's /ready turns 503 (the pod leaves the Service's
                                endpoints; load balancers that health-check stop sending)
    2. wait --settle seconds    for those to notice
    3. POST /drain_listeners?graceful   HTTP/1 answers get `Connection: close`, HTTP/2 a GOAWAY
    4. poll the active downstream requests of every listener (admin's own excluded) until
       none is left or --deadline passes; long streams get until the deadline
    5. touch --marker            the Envoy container's preStop hook waits for it, so Envoy is
                                sent SIGTERM only now

Exit 0 in every case the pod should go on stopping (Envoy already gone included); the
deadline is kept below terminationGracePeriodSeconds by the renderer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["active_requests", "drain", "main"]

_REQUEST_TIMEOUT_S = 2.0


def _call(url: str, method: str = "GET") -> bytes | None:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not an http(s) URL: {url!r}")
    request = urllib.request.Request(url, method=method)  # noqa: S310 - scheme checked above
    try:
        with urllib.request.urlopen(request, timeout=_REQUEST_TIMEOUT_S) as resp:  # noqa: S310
            body: bytes = resp.read(16 << 20)
            return body
    except (urllib.error.URLError, TimeoutError, OSError):
        return None


def active_requests(admin: str) -> int | None:
    """Requests in flight on the data listeners (http.<listener>.downstream_rq_active)."""
    body = _call(f"{admin}/stats?format=json&filter=" + urllib.parse.quote(r"^http\..*\.downstream_rq_active$"))
    if body is None:
        return None
    try:
        stats = json.loads(body).get("stats", [])
    except (ValueError, AttributeError):
        return None
    return sum(int(s.get("value", 0)) for s in stats
               if isinstance(s, dict) and not str(s.get("name", "")).startswith("http.admin."))


def drain(admin: str, *, deadline_s: float, settle_s: float, marker: Path | None,
          clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] = print) -> int:
    """Run the sequence; the number of requests still active at the end (0 when drained)."""
    admin = admin.rstrip("/")
    end = clock() + deadline_s
    if _call(f"{admin}/healthcheck/fail", "POST") is None:
        log("envoy admin unreachable; nothing to drain")
        left = 0
    else:
        time.sleep(max(0.0, min(settle_s, end - clock())))
        _call(f"{admin}/drain_listeners?graceful", "POST")
        left = active_requests(admin) or 0
        while left and clock() < end:
            time.sleep(0.5)
            now_active = active_requests(admin)
            left = 0 if now_active is None else now_active  # Envoy gone: nothing left to wait for
        log(f"drained: {left} request(s) still active")
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return left


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sidecar.drain", description="Drain the local Envoy (preStop).")
    p.add_argument("--admin", default="http://127.0.0.1:9901", help="Envoy's admin URL")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds to wait for active requests at most")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds between failing health and draining listeners (endpoint propagation)")
    p.add_argument("--marker", type=Path, help="file to create when done (Envoy's preStop waits for it)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    drain(args.admin, deadline_s=args.deadline, settle_s=args.settle, marker=args.marker)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
