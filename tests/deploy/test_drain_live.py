"""The preStop drain (`python -m sidecar.drain`) and the sidecar's read-only Envoy relay,
against the real Envoy, the sidecar and the simulated fleet on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sidecar.drain import active_requests, drain
from tests.sidecar_live.rig import REPO, http, live_rig, poll, worker_specs


def test_drain_fails_health_waits_for_requests_within_its_deadline_and_marks_done(tmp_path: Path) -> None:
    """Before: Envoy's /ready (relayed by the sidecar at /envoy/ready) is 200 and its stats
    come through /envoy/stats. The drain turns /ready 503 at once, waits for a short request
    to finish, gives up on a long one at its deadline (reporting it), and a second drain with
    a longer deadline returns as soon as the long one completes; both requests complete
    with 200 (nothing cut) and the marker Envoy's preStop waits for exists."""
    # the pod's Envoy has its admin on the pod's loopback (render --admin-loopback), where this runs
    with live_rig(tmp_path, worker_specs(["a", "b"], decode_ms=20.0), admin_port=True) as rig:
        admin = f"http://127.0.0.1:{rig.admin}"
        assert rig.sidecar.get("/envoy/ready")[0] == 200
        status, stats = rig.sidecar.get("/envoy/stats")
        assert status == 200 and b"envoy_cluster_upstream_rq_total" in stats
        body = {"model": "sim-model", "prompt": "drain me"}
        with ThreadPoolExecutor(max_workers=2) as pool:
            short = pool.submit(http, "POST", rig.url, {**body, "max_tokens": 30}, 30.0)  # ~0.6 s
            long = pool.submit(http, "POST", rig.url, {**body, "max_tokens": 400}, 30.0)  # ~8 s
            assert poll(lambda: active_requests(admin) == 2, timeout=5)
            marker = tmp_path / "lifecycle" / "envoy-drained"
            started = time.monotonic()
            left = drain(admin, deadline_s=4.0, settle_s=0.1, marker=marker, log=lambda _: None)
            took = time.monotonic() - started
            assert rig.sidecar.get("/envoy/ready")[0] == 503
            assert short.done() and short.result()[0] == 200
            assert left == 1 and 3.9 <= took < 20, (left, took)  # waited up to the deadline, no longer
            assert marker.exists()
            done = subprocess.run([sys.executable, "-m", "sidecar.drain", "--admin", admin, "--deadline", "20",
                                   "--settle", "0", "--marker", str(marker)], capture_output=True, text=True,
                                  timeout=30, cwd=REPO)
            assert done.returncode == 0 and "0 request(s) still active" in done.stdout, done.stdout + done.stderr
            assert long.done() and long.result()[0] == 200
        assert active_requests(admin) == 0


def test_drain_without_an_envoy_returns_at_once_and_marks_done(tmp_path: Path) -> None:
    """With Envoy already gone (nothing listens on the admin port) the hook returns at once
    and still creates the marker, so the pod goes on stopping."""
    from confgen.runtime import free_port

    marker = tmp_path / "m"
    started = time.monotonic()
    assert drain(f"http://127.0.0.1:{free_port()}", deadline_s=30, settle_s=5, marker=marker,
                 log=lambda _: None) == 0
    assert time.monotonic() - started < 5 and marker.exists()
