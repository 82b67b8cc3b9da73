"""API key rotation over ADS under load: the keys travel apart from the listeners (ECDS).

A real Envoy on the control plane (`python -m sidecar.main --serve-xds`, loopback), two client
threads sending without pause with the key in force. The rotation, as an operator does it:
add the new key (a second api_keys entry), move the clients to it, remove the old one. Checked:
0 failed requests throughout; Envoy never modified its listener (only the ECDS resource
changed); the old key is refused as soon as the Envoy has ACKed the publish that removed it.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from confgen.runtime import free_port
from confgen.simulate import FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import ads_envoy, control_plane, poll, worker_specs

PHASE = 300  # requests sent in each phase: old key alone, both, new key alone
OLD, NEW = "sk-old-key-0123456789abcdef", "sk-new-key-fedcba9876543210"

TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
auth:
  api_keys:
{keys}
sidecar: {{grpc_socket_dir: {sockets}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"], protocol: delta}}
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 8
    health: {{enabled: false}}
    outlier_detection: {{enabled: false}}
    workers:
{workers}
"""


def _send(port: int, key: str) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 1}).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


class Load:
    """`threads` clients sending with `self.key` until stopped (bounded in count and time)."""

    def __init__(self, port: int, key: str, threads: int = 2, max_requests: int = 20_000,
                 max_seconds: float = 120.0) -> None:
        self.port, self.key = port, key
        self.statuses: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._budget, self._deadline = max_requests, time.monotonic() + max_seconds
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            with self._lock:
                if self._budget <= 0:
                    return
                self._budget -= 1
                key = self.key
            status = _send(self.port, key)
            with self._lock:
                self.statuses[status] += 1

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def test_key_rotation_under_load_fails_no_request_and_rewrites_no_listener(tmp_path: Path) -> None:
    old_file, new_file = tmp_path / "old-key", tmp_path / "new-key"
    for path, key in ((old_file, OLD), (new_file, NEW)):
        path.write_text(key)
        path.chmod(0o600)
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["w1", "w2"], max_num_seqs=8), seed=11)) as fleet:
        xds, port = free_port(), free_port()
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)

        def text(*entries: tuple[str, Path]) -> str:
            keys = "\n".join(f"    - {{client: {client}, file: {path}}}" for client, path in entries)
            return TOPOLOGY.format(admin=free_port(), port=port, keys=keys, xds=xds, workers=workers,
                                   sockets=tmp_path / "sockets")  # ADS over its Unix socket

        topology = tmp_path / "topology.yaml"
        topology.write_text(text(("team", old_file)))

        def rewrite(body: str) -> None:
            tmp = topology.with_suffix(".tmp")
            tmp.write_text(body)
            os.replace(tmp, topology)

        with control_plane(topology, xds, tmp_path / "sidecar.log", clean_exit=True) as sidecar:
            with ads_envoy(text(("team", old_file)), tmp_path / "envoy", "envoy-0", any_admin_port=True) as proxy:
                assert poll(lambda: _send(port, OLD) == 200, timeout=10)
                stats = proxy.stats()
                modified = stats.get("listener_manager.listener_modified", "0")
                lds = sidecar.state()["xds"]["versions"]["lds"]

                def acked(kind: str) -> bool:
                    view = sidecar.state()["xds"]
                    return view["nodes"].get("envoy-0", {}).get("acked", {}).get(kind) == view["versions"][kind]

                with Load(port, OLD) as load:
                    assert poll(lambda: sum(load.statuses.values()) >= PHASE, timeout=60)
                    # 1. both keys valid
                    rewrite(text(("team", old_file), ("team-next", new_file)))
                    assert poll(lambda: _send(port, NEW) == 200, timeout=10)
                    # 2. the clients move to the new key
                    load.key = NEW
                    before = sum(load.statuses.values())
                    assert poll(lambda: sum(load.statuses.values()) >= before + PHASE, timeout=60)
                    # 3. the old key removed: refused once the Envoy has taken that publish
                    ecds = sidecar.state()["xds"]["versions"]["ecds"]
                    rewrite(text(("team-next", new_file)))
                    assert poll(lambda: sidecar.state()["xds"]["versions"]["ecds"] != ecds, timeout=10)
                    assert poll(lambda: acked("ecds"), timeout=10)
                    assert _send(port, OLD) == 401
                    before = sum(load.statuses.values())
                    assert poll(lambda: sum(load.statuses.values()) >= before + PHASE, timeout=60)
                total = sum(load.statuses.values())
                assert load.statuses == {200: total}, load.statuses  # 0 failed requests
                assert total >= 3 * PHASE, total
                # no listener was rewritten: the same LDS version served, Envoy modified none
                assert sidecar.state()["xds"]["versions"]["lds"] == lds
                assert proxy.stats().get("listener_manager.listener_modified", "0") == modified
                assert int(proxy.stats().get(
                    "extension_config_discovery.http_filter.envoy.filters.http.api_key_auth.config_reload",
                    "0")) >= 3
            log = sidecar.log_path.read_text(errors="replace")
            assert OLD not in log and NEW not in log
