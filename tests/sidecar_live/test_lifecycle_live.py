"""The sidecar's lifecycle against the real Envoy: restart, topology reload, rejected writes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.sidecar_live.rig import (
    FAST_ARGS,
    Rig,
    configmap_publish,
    live_rig,
    now,
    poll,
    topology_text,
    worker_specs,
)


def _eds(rig: Rig) -> Path:
    return rig.xds_dir / "eds" / "chat" / "endpoints.json"


def _envoy_counters(rig: Rig) -> dict[str, Any]:
    stats = rig.envoy.stats()
    names = ("cluster.chat.update_attempt", "cluster_manager.cds.update_attempt", "listener_manager.lds.update_attempt")
    return {name: stats.get(name) for name in names}


def _settled(rig: Rig, quiet_s: float = 1.6, timeout: float = 10.0) -> None:
    """Wait until the EDS file has not changed for `quiet_s` (weights converged)."""
    last = (_eds(rig).stat().st_ino, _eds(rig).read_bytes())
    since = now()
    end = now() + timeout
    while now() < end:
        time.sleep(0.1)
        current = (_eds(rig).stat().st_ino, _eds(rig).read_bytes())
        if current != last:
            last, since = current, now()
        elif now() - since >= quiet_s:
            return
    raise AssertionError("EDS file never settled")


def test_sidecar_restart_changes_nothing(tmp_path: Path) -> None:
    """SIGTERM exits 0; a new sidecar adopts the published EDS (statuses and weights), so
    after its first cycles the file is the same inode with the same bytes and Envoy saw no
    update of any kind."""
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4)) as rig:
        _settled(rig)
        before_file = (_eds(rig).stat().st_ino, _eds(rig).read_bytes())
        before_envoy = _envoy_counters(rig)
        before_clusters = rig.envoy.clusters_text()
        assert rig.sidecar.stop() == 0
        log_mark = len(rig.sidecar.events())
        rig.sidecar.start()
        rig.sidecar.wait_ready()
        # three cycles of the restarted sidecar (counted, not slept: a loaded machine runs fewer a second)
        assert poll(lambda: rig.sidecar.state()["cycles"] >= 3, timeout=15)
        assert (_eds(rig).stat().st_ino, _eds(rig).read_bytes()) == before_file
        assert _envoy_counters(rig) == before_envoy
        weights = [line for line in before_clusters.splitlines() if "::weight::" in line or "health_flags" in line]
        after = rig.envoy.clusters_text().splitlines()
        assert all(line in after for line in weights)
        second_run = rig.sidecar.events()[log_mark:]
        changes = [e for e in second_run if e["event"] in ("endpoint.status", "eds.published", "tree.written")]
        assert changes == []
        assert any(e["event"] == "startup.adopted" and e["endpoints"] == 3 for e in second_run)


def test_topology_edit_reaches_envoy_and_broken_edit_keeps_old_config(tmp_path: Path) -> None:
    """A ConfigMap-style symlink swap that adds worker c and removes a is re-rendered and
    reaches Envoy (CDS/EDS), and a's series leave /metrics; a broken edit is reported (log,
    metric, /state) while Envoy keeps serving the last good config."""
    workers = worker_specs(["a", "b", "c"], max_num_seqs=4)
    with live_rig(tmp_path, workers, listed=2, configmap=True) as rig:
        pa, pc = rig.worker_port("a"), rig.worker_port("c")
        assert rig.envoy_host(pc) == {}
        assert f'address="127.0.0.1:{pa}"' in rig.sidecar.metrics()
        edited = topology_text([f"127.0.0.1:{rig.worker_port(n)}" for n in ("b", "c")], admin=rig.admin,
                               port=rig.port, capacity=8)
        configmap_publish(tmp_path / "cm", edited)
        assert poll(lambda: rig.envoy_host(pc).get("health_flags") == "healthy", timeout=5, interval=0.1)
        assert poll(lambda: rig.envoy_host(pa) == {}, timeout=3)
        # the tree is written file by file (EDS before CDS, envoy.layout.write_rank): Envoy may show
        # c from the new EDS a moment before cds.json is replaced (CI read the old cap, 32, there)
        def cap() -> int:
            cds = json.loads((rig.xds_dir / "cds.json").read_text())
            chat = next(c for c in cds["resources"] if c["name"] == "chat")
            return int(chat["circuit_breakers"]["thresholds"][0]["max_requests"])

        assert poll(lambda: cap() == 64, timeout=5), cap()  # safety cap: 4 x (2 x 8)
        assert poll(lambda: {name for _, name in (rig.send() for _ in range(6))} == {"b", "c"}, timeout=5)
        metrics = rig.sidecar.metrics()
        assert f'address="127.0.0.1:{pa}"' not in metrics
        assert 'confgen_sidecar_topology_reloads_total{result="ok"} 1.0' in metrics

        files_before = {p: p.read_bytes() for p in rig.xds_dir.rglob("*.json")}
        configmap_publish(tmp_path / "cm", edited.replace("engine: vllm", "engine: not-an-engine"))
        assert poll(lambda: 'topology_reloads_total{result="error"} 1.0' in rig.sidecar.metrics(), timeout=5)
        failures = [e for e in rig.sidecar.events() if e["event"] == "topology.reload_failed"]
        assert failures and failures[-1]["level"] == "error"
        assert any("pools[0].engine" in line for line in failures[-1]["errors"])
        assert "engine" in (rig.sidecar.state()["last_reload_error"] or "")
        time.sleep(0.6)
        assert {p: p.read_bytes() for p in rig.xds_dir.rglob("*.json")}.keys() == files_before.keys()
        assert (rig.xds_dir / "cds.json").read_bytes() == files_before[rig.xds_dir / "cds.json"]
        assert {name for _, name in (rig.send() for _ in range(6))} <= {"b", "c"}
        assert rig.envoy_host(pc).get("health_flags") == "healthy"


_REJECTING_WRAPPER = '''\
"""Run the sidecar with an EDS renderer that, while FLAG exists, writes weight 0 (Envoy
rejects the whole file): a fault the real renderer cannot produce."""
import re
import sys
from pathlib import Path

import sidecar.outputs.files.publisher as publish
from sidecar.main import main

FLAG = Path(sys.argv.pop())  # the last argument
_real = publish.render_eds


def _bad(cluster, endpoints):
    data = _real(cluster, endpoints)
    if FLAG.exists():
        data = re.sub(rb'"load_balancing_weight": ?\\d+', b'"load_balancing_weight":0', data, count=1)
    return data


publish.render_eds = _bad
raise SystemExit(main())
'''


def test_rejected_eds_update_is_detected_and_reported(tmp_path: Path) -> None:
    """When Envoy refuses an EDS write (seen only in its stats), the sidecar logs an error
    event, counts it in confgen_sidecar_eds_rejected_total and lists it as a problem (/readyz's
    body, /state, confgen_sidecar_problems) while /readyz stays 200: the refusal is the same on
    every replica and Envoy serves its last good config, so readiness must not empty the
    Service. The next good write clears it."""
    flag = tmp_path / "inject-reject"
    wrapper = tmp_path / "rejecting_sidecar.py"
    wrapper.write_text(_REJECTING_WRAPPER)
    args = (*FAST_ARGS, str(flag))
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4), sidecar_args=args,
                  wrapper=wrapper) as rig:
        pb = rig.worker_port("b")
        flag.touch()
        rig.fleet.worker("b").crash()  # a real change, so the sidecar writes
        assert poll(lambda: bool(json.loads(rig.sidecar.get("/readyz")[1])["problems"]), timeout=5)
        status, body = rig.sidecar.get("/readyz")
        assert status == 200 and json.loads(body)["problems"] == ["last chat update rejected by Envoy"], body
        assert json.loads(rig.sidecar.get("/state")[1])["problems"] == ["last chat update rejected by Envoy"]
        assert "confgen_sidecar_problems 1.0" in rig.sidecar.metrics()
        assert 'confgen_sidecar_eds_rejected_total{pool="chat"} 1.0' in rig.sidecar.metrics()
        rejected = [e for e in rig.sidecar.events() if e["event"] == "eds.rejected"]
        assert rejected and rejected[0]["level"] == "error" and rejected[0]["pool"] == "chat"
        assert int(rig.envoy.stats()["cluster.chat.update_rejected"]) >= 1
        # Why it must be loud: Envoy kept the old file, the dead worker is still "healthy" there.
        assert "failed_eds_health" not in rig.envoy_host(pb)["health_flags"]
        assert b'"load_balancing_weight":0' in (rig.xds_dir / "eds" / "chat" / "endpoints.json").read_bytes()
        flag.unlink()
        rig.fleet.worker("b").revive()
        rig.fleet.worker("a").crash()  # another real change: a good write
        assert poll(lambda: json.loads(rig.sidecar.get("/readyz")[1])["problems"] == [], timeout=5)
        assert "confgen_sidecar_problems 0.0" in rig.sidecar.metrics()
        assert poll(lambda: "failed_eds_health" in rig.envoy_host(rig.worker_port("a"))["health_flags"], timeout=3)
