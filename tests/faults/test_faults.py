"""The fault campaign (#10): real Envoy, the real sidecar process, the simulated fleet.

Every case injects one fault under load and checks that nothing is lost: no failed
request, no partial file, nothing Envoy refused (unless the case placed a bad file on
purpose), no spurious health transition. Each adds its row (method, figure, what was lost)
to the campaign table; CONFGEN_FAULTS_FULL=1 runs each case at full size and writes the
table into docs/reliability.md. CI size: the whole tier well under 120 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from confgen.runtime import EnvoyProcess
from tests.faults._campaign import (
    Campaign,
    Load,
    Reader,
    Row,
    envoy_rejections,
    lost,
    size,
    statuses,
    transitions,
)
from tests.sidecar_live.rig import live_rig, poll, worker_specs


def _eds(xds: Path) -> Path:
    return xds / "eds" / "chat" / "endpoints.json"


def test_kill_9_during_writes(tmp_path: Path, campaign: Campaign) -> None:
    """SIGKILL the sidecar at random moments while it rewrites EDS (weights follow the
    load), restart it each time; a reader parses bootstrap/CDS/LDS/EDS in a loop: no
    partial file, Envoy refuses nothing, no request fails, no temp file left behind."""
    kills = size(4, 30)
    rng = random.Random(10)
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4)) as rig:
        files = [rig.xds_dir / name for name in ("bootstrap.json", "cds.json", "lds.json")] + [_eds(rig.xds_dir)]
        rejected_before = envoy_rejections(rig)
        publishes_before = 0
        with Load(rig, threads=3, max_tokens=8) as load, Reader(files) as reader:
            for _ in range(kills):
                time.sleep(rng.uniform(0.2, 1.2))
                assert rig.sidecar.proc is not None
                rig.sidecar.proc.send_signal(signal.SIGKILL)
                rig.sidecar.proc.wait(timeout=10)
                rig.sidecar.proc = None
                rig.sidecar.start()
                rig.sidecar.wait_ready()
            publishes_before = sum(1 for e in rig.sidecar.events() if e.get("event") == "eds.published")
        rejected = envoy_rejections(rig) - rejected_before
        leftovers = [p.name for p in rig.xds_dir.rglob(".*.tmp")]
        campaign.add(Row(
            "sidecar killed (SIGKILL) mid-write",
            f"{kills} kills at random 0.2-1.2 s intervals under load (3 clients), each followed by a restart; "
            "a reader parses every xDS file in a loop",
            f"{reader.reads} file reads, {load.sent} requests, {publishes_before} EDS writes",
            lost(partial_files=len(reader.partial), envoy_rejections=rejected, failed_requests=load.failed,
                 temp_files_left=len(leftovers))))
        assert reader.partial == [] and reader.reads > 0
        assert rejected == 0
        assert load.failed == 0, load.statuses
        assert leftovers == []


def _bad_eds(data: bytes) -> bytes:
    doc = json.loads(data)
    for group in doc["resources"][0]["endpoints"]:
        for lb in group["lb_endpoints"]:
            lb["load_balancing_weight"] = 0  # Envoy refuses a zero weight
    doc["version_info"] = "hand-placed"
    return json.dumps(doc).encode()


def _place(path: Path, data: bytes) -> None:
    tmp = path.with_name(".hand-placed.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_bad_files_placed_by_hand(tmp_path: Path, campaign: Campaign) -> None:
    """Under load, a bad EDS file then a bad CDS file replace the sidecar's: Envoy refuses
    each and keeps its config (no request fails), the sidecar notices the foreign file,
    reports it (metrics, log) and restores its own, which Envoy accepts."""
    rounds = size(2, 10)
    with live_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=4)) as rig:
        eds, cds = _eds(rig.xds_dir), rig.xds_dir / "cds.json"
        restored_s: list[float] = []
        with Load(rig, threads=2) as load:
            for _ in range(rounds):
                for path, bad in ((eds, _bad_eds(eds.read_bytes())), (cds, b'{"version_info": "x", "resources": '
                                  b'[{"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", '
                                  b'"name": "chat", "connect_timeout": "-1s"}]}')):
                    rejected = envoy_rejections(rig)
                    _place(path, bad)
                    placed = time.monotonic()
                    assert poll(lambda n=rejected: envoy_rejections(rig) > n, timeout=10), "Envoy took the bad file"
                    assert poll(lambda p=path, b=bad: p.read_bytes() != b and json.loads(p.read_bytes()) != {},
                                timeout=10), f"{path.name} not restored"
                    restored_s.append(time.monotonic() - placed)
            time.sleep(1.0)
        metrics = rig.sidecar.metrics()
        events = {e.get("event") for e in rig.sidecar.events()}
        campaign.add(Row(
            "bad EDS / CDS file placed by hand",
            f"{rounds} rounds: a zero-weight EDS file, then a CDS file with a negative timeout, each renamed "
            "over the sidecar's under load (2 clients)",
            f"{2 * rounds} bad files refused by Envoy; the sidecar's file back in max "
            f"{max(restored_s):.2f} s; {load.sent} requests",
            lost(failed_requests=load.failed)))
        assert load.failed == 0, load.statuses
        assert "file.changed_on_disk" in events
        assert 'confgen_sidecar_external_changes_total{file="chat"}' in metrics
        assert 'confgen_sidecar_external_changes_total{file="cds.json"}' in metrics
        assert poll(lambda: rig.sidecar.get("/readyz")[0] == 200, timeout=10)


def test_sidecar_stopped_then_restarted(tmp_path: Path, campaign: Campaign) -> None:
    """The sidecar stopped (SIGTERM) for a while under load, then restarted: no request
    fails, and the restart changes no endpoint's health (no spurious transition)."""
    pause_s = size(3, 60)
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=4)) as rig:
        time.sleep(1.5)
        with Load(rig, threads=2) as load:
            before = statuses(rig)
            assert rig.sidecar.stop() == 0
            time.sleep(pause_s)
            mark = len(rig.sidecar.events())
            rig.sidecar.start()
            rig.sidecar.wait_ready()
            time.sleep(2.0)  # four cycles
        after = statuses(rig)
        moved = transitions(rig, mark)
        campaign.add(Row(
            "sidecar stopped, then restarted",
            f"SIGTERM, {pause_s} s without a sidecar under load (2 clients), restart",
            f"{load.sent} requests",
            lost(failed_requests=load.failed, spurious_transitions=len(moved))))
        assert load.failed == 0, load.statuses
        assert after == before and moved == [], (before, after, moved)


def test_envoy_restarted_under_the_sidecar(tmp_path: Path, campaign: Campaign) -> None:
    """Envoy restarted under a running sidecar: it comes back with the published weights
    (the EDS file) and the sidecar puts its runtime in-flight limits back."""
    restarts = size(1, 5)
    with live_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=4)) as rig:
        def limits() -> dict[str, str]:
            status, text = rig.envoy.admin_get("/runtime")
            entries = json.loads(text).get("entries", {}) if status == 200 else {}
            return {k: str(v.get("final_value")) for k, v in entries.items() if "circuit_breakers" in k}

        assert poll(lambda: bool(limits()), timeout=10), "no runtime limit set"
        wanted = limits()
        restored: list[float] = []
        first = rig.envoy
        try:
            for _ in range(restarts):
                rig.envoy.stop()
                rig.envoy = EnvoyProcess(rig.xds_dir / "bootstrap.json")
                rig.envoy.start()
                started = time.monotonic()
                assert poll(lambda: limits() == wanted, timeout=15), (limits(), wanted)
                restored.append(time.monotonic() - started)
                weights = {str(p): w for p, w in _weights(rig).items()}
                pa = rig.worker_port("a")
                want = weights[str(pa)]
                assert poll(lambda p=pa, w=want: rig.envoy_host(p).get("weight") == w, timeout=5)
        finally:
            if rig.envoy is not first:
                rig.envoy.stop()
        campaign.add(Row(
            "Envoy restarted under the sidecar",
            f"{restarts} Envoy restart(s) with the sidecar running",
            f"runtime limits back in max {max(restored):.2f} s; weights from the EDS file at start",
            "nothing"))


def _weights(rig: object) -> dict[int, str]:
    from tests.sidecar_live.rig import Rig

    assert isinstance(rig, Rig)
    cla = json.loads(_eds(rig.xds_dir).read_bytes())["resources"][0]
    return {lb["endpoint"]["address"]["socket_address"]["port_value"]: str(lb.get("load_balancing_weight", 1))
            for group in cla["endpoints"] for lb in group["lb_endpoints"]}


def _mount_small_fs(path: Path) -> None:
    """A 1 MiB tmpfs at `path` (root only: the campaign's read-only and full cases)."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(path)], check=True, timeout=30)


def _umount(path: Path) -> None:
    result = subprocess.run(["umount", str(path)], capture_output=True, timeout=30, check=False)
    if result.returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=True, timeout=30)


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")
def test_xds_dir_read_only_then_full(tmp_path: Path, campaign: Campaign) -> None:
    """The xDS directory on a 1 MiB tmpfs, made read-only, then full, while a worker
    crashes and the topology is reloaded (EDS and CDS must be written): the sidecar stays
    up, the old files stay intact (Envoy keeps serving from them), the failure is counted
    and /readyz's body says why while it stays 200 (every replica would fail alike); when the
    disk is back both are published."""
    xds = tmp_path / "envoy"
    try:
        with live_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=4), prepare_xds=_mount_small_fs) as rig:
            time.sleep(1.0)
            figures = []
            failed = 0
            for mode in ("read-only", "full"):
                if mode == "read-only":
                    subprocess.run(["mount", "-o", "remount,ro", str(xds)], check=True, timeout=30)
                else:
                    filler = xds / "filler"
                    with filler.open("wb") as out, contextlib.suppress(OSError):  # ENOSPC: full
                        while True:
                            out.write(b"\0" * 65536)
                            out.flush()
                before = {p: p.read_bytes() for p in xds.rglob("*.json")}  # nothing can change them now
                answers = [rig.send()[0] for _ in range(size(10, 50))]  # served from the old files
                failed += sum(1 for status in answers if status != 200)
                failures = _metric(rig.sidecar.metrics(), "confgen_sidecar_write_failures_total")
                rig.fleet.worker("a").set_fault("crash")
                # and a topology reload, whose tree write (CDS) fails too
                rig.topology_path.write_text(rig.topology_path.read_text().replace("capacity: 4", "capacity: 5"))
                assert poll(lambda f=failures: _metric(rig.sidecar.metrics(),
                                                       "confgen_sidecar_write_failures_total") > f, timeout=15)
                status, body = rig.sidecar.get("/readyz")
                assert status == 200 and b"write failing" in body, body
                assert rig.sidecar.proc is not None and rig.sidecar.proc.poll() is None
                assert {p: p.read_bytes() for p in xds.rglob("*.json")} == before
                if mode == "read-only":
                    subprocess.run(["mount", "-o", "remount,rw", str(xds)], check=True, timeout=30)
                else:
                    (xds / "filler").unlink()
                assert poll(lambda: "UNHEALTHY" in statuses(rig).values(), timeout=15), rig.sidecar.log_tail()
                assert poll(lambda: b"write failing" not in rig.sidecar.get("/readyz")[1], timeout=10)
                old_cds = before[xds / "cds.json"]
                assert poll(lambda c=old_cds: (xds / "cds.json").read_bytes() != c, timeout=15), "reload not written"
                rig.topology_path.write_text(rig.topology_path.read_text().replace("capacity: 5", "capacity: 4"))
                rig.fleet.worker("a").set_fault("none")
                assert poll(lambda: "UNHEALTHY" not in statuses(rig).values(), timeout=15)
                assert poll(lambda c=old_cds: (xds / "cds.json").read_bytes() == c, timeout=15)
                figures.append(f"{mode}: {len(answers)} requests served from the old files")
            campaign.add(Row(
                "xDS directory read-only, then full",
                "xDS dir on a 1 MiB tmpfs: remounted read-only, then filled to ENOSPC, while a worker crashes "
                "and the topology is reloaded (a CDS change)",
                "; ".join(figures) + "; write failures counted and listed in /readyz's body (still 200) until the "
                "disk is back, then the crash published",
                lost(failed_requests=failed)))
            assert failed == 0
    finally:
        _umount(xds)


def test_hostile_health_and_metrics_answers(tmp_path: Path, campaign: Campaign) -> None:
    """Workers that answer health slowly, metrics as garbage, truncated or HTML: every
    probe ends within its deadline and the loop keeps its pace (cycles keep coming)."""
    seconds = size(4, 30)
    with live_rig(tmp_path, worker_specs(["a", "b", "c", "d"], max_num_seqs=4)) as rig:
        rig.fleet.worker("a").set_fault("slow_health", delay_s=30)
        rig.fleet.worker("b").set_fault("garbage_metrics")
        rig.fleet.worker("c").set_fault("truncated_metrics", how="abort")
        rig.fleet.worker("d").set_fault("html_metrics")
        start_cycles = _metric(rig.sidecar.metrics(), "confgen_sidecar_probe_cycles_total")
        worst = 0.0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for ep in rig.sidecar.state()["pools"]["chat"]["endpoints"]:
                worst = max(worst, ep["probe_latency_s"] or 0.0)
            time.sleep(0.25)
        cycles = _metric(rig.sidecar.metrics(), "confgen_sidecar_probe_cycles_total") - start_cycles
        deadline = 0.4  # FAST_ARGS --probe-deadline; a metrics-only fallback may take two
        campaign.add(Row(
            "slow-loris, garbage, truncated and HTML answers",
            f"4 workers: health answering after 30 s, garbage metrics, metrics cut mid-body, HTML; {seconds} s",
            f"slowest probe {worst:.2f} s (deadline {deadline} s); {cycles:.0f} cycles at a 0.5 s interval",
            "nothing"))
        # Bounds with room for a loaded machine; a probe without its deadline would take 30 s
        # (the slow health) and the loop would stall.
        assert worst <= 2 * deadline + 2.0
        assert cycles >= seconds / 0.5 * 0.25


def test_sse_streams_through_eds_churn_and_topology_reloads(tmp_path: Path, campaign: Campaign) -> None:
    """Concurrent SSE streams while the sidecar rewrites EDS (weights, a worker removed and
    added back) and the topology is reloaded (capacity: CDS changes): every stream ends
    with all its tokens and `[DONE]`, none is cut, none is refused."""
    import threading

    from tests.integration._stack import stream
    from tests.sidecar_live.rig import topology_text

    seconds = size(8, 60)
    tokens = 40
    with live_rig(tmp_path, worker_specs(["a", "b", "c"], max_num_seqs=8)) as rig:
        ports = [rig.worker_port(n) for n in ("a", "b", "c")]
        results: list[tuple[int, bool, int, bool]] = []
        lock = threading.Lock()
        stop = time.monotonic() + seconds

        def client() -> None:
            while time.monotonic() < stop:
                got = stream(rig.port, {"model": "sim-model", "prompt": "tell me", "max_tokens": tokens}, timeout=15)
                with lock:
                    results.append((got.status, got.complete, len(got.events),
                                    bool(got.events) and got.events[-1] == "[DONE]"))

        threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        reloads = 0
        publishes_before = sum(1 for e in rig.sidecar.events() if e.get("event") == "eds.published")
        while time.monotonic() < stop - 0.5:
            listed = ports if reloads % 2 else ports[:2]
            text = topology_text([f"127.0.0.1:{p}" for p in listed], admin=rig.admin, port=rig.port,
                                 capacity=4 + reloads % 3)
            rig.topology_path.write_text(text)
            reloads += 1
            time.sleep(0.7)
        for t in threads:
            t.join(timeout=30)
        applied = sum(1 for e in rig.sidecar.events() if e.get("event") == "topology.reloaded")
        publishes = sum(1 for e in rig.sidecar.events() if e.get("event") in ("eds.published", "tree.written"))
        bad = [r for r in results if r != (200, True, tokens + 1, True)]
        campaign.add(Row(
            "SSE streams through EDS rewrites and topology reloads",
            f"4 clients streaming {tokens}-token answers for {seconds} s while the topology is rewritten every "
            "0.7 s (a worker removed / added back, capacity 4-6: EDS and CDS change)",
            f"{len(results)} streams; {applied} reloads applied, {publishes - publishes_before} file writes",
            lost(truncated_or_failed_streams=len(bad))))
        assert results and bad == [], bad[:5]
        assert applied >= 2


_DNS_WRAPPER = '''\
"""Run the sidecar with a resolver that fails (EAI_AGAIN) while FLAG exists: a DNS outage,
which a shared test machine cannot have for real."""
import socket
import sys
from pathlib import Path

from sidecar.main import main

FLAG = Path(sys.argv.pop())  # the last argument
_real = socket.getaddrinfo


def _flaky(*args, **kwargs):
    if FLAG.exists():
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    return _real(*args, **kwargs)


socket.getaddrinfo = _flaky
raise SystemExit(main())
'''


def test_dns_failure_keeps_the_last_good_answer(tmp_path: Path, campaign: Campaign) -> None:
    """Workers named `localhost:<port>`; every lookup fails for a while (EAI_AGAIN): the
    published endpoints stay (last good answer), no request fails, and after the outage
    nothing changed."""
    outage_s = size(3, 30)
    flag = tmp_path / "dns-down"
    wrapper = tmp_path / "dns_sidecar.py"
    wrapper.write_text(_DNS_WRAPPER)
    from tests.sidecar_live.rig import FAST_ARGS

    with live_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=4), worker_item=lambda p: f"localhost:{p}",
                  wrapper=wrapper, sidecar_args=(*FAST_ARGS, str(flag))) as rig:
        assert poll(lambda: len(statuses(rig)) == 2, timeout=10)
        before = statuses(rig)
        with Load(rig, threads=2) as load:
            flag.touch()
            time.sleep(outage_s)
            failed_lookups = sum(1 for e in rig.sidecar.events() if e.get("event") == "dns.failed")
            during = statuses(rig)
            flag.unlink()
            time.sleep(1.5)
        after = statuses(rig)
        campaign.add(Row(
            "DNS failure",
            f"workers named localhost:PORT; every lookup fails (EAI_AGAIN) for {outage_s} s under load (2 clients)",
            f"{failed_lookups} failed lookups; {load.sent} requests",
            lost(endpoints=len(before) - len(during), failed_requests=load.failed)))
        assert failed_lookups > 0
        assert during == before and after == before, (before, during, after)
        assert load.failed == 0, load.statuses
