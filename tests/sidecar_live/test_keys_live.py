"""The sidecar never needs what it does not use (real Envoy, real sidecar process).

- Started without any API key on a topology that has keys, it publishes EDS and stays up;
  LDS (which holds the keys) stays byte-identical, and `confgen render --check` (with the
  key) reports no drift on bootstrap/LDS/CDS after it ran.
- A reload that changes only clusters is applied without keys; one that changes the
  listeners is refused without keys: the running config stays (files byte-identical), and
  the refusal is in the metrics, the log and /readyz.
- Run from another working directory with a relative --xds-dir, it writes no relative
  path (no drift either).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetHandle, FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import FAST_ARGS, REPO, SidecarProcess, poll, topology_text, worker_specs

KEY_ENV = "CONFGEN_TRUST_LIVE_KEY"
KEY = "live-secret-key-123"
AUTH = f"auth:\n  api_keys:\n    - client: web\n      env: {KEY_ENV}\n"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFGEN_")}
    return {**env, **extra}


def _confgen(*args: str | Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "confgen", *map(str, args)], capture_output=True, text=True,
                          timeout=60, check=False, cwd=cwd, env={**env, "PYTHONPATH": str(REPO)})


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class KeyedRig:
    fleet: FleetHandle
    envoy: EnvoyProcess
    sidecar: SidecarProcess
    topology: Path
    xds: Path
    text: str
    admin: int
    port: int

    def drift(self) -> list[str]:
        """`confgen render --check` (with the key) lines about files other than EDS."""
        result = _confgen("render", self.topology, "--check", self.xds, cwd=self.topology.parent,
                          env=_env(**{KEY_ENV: KEY}))
        return [line for line in result.stderr.splitlines() if ": " in line and ": eds/" not in line
                and "differs from what" not in line]


@contextmanager
def keyed_rig(tmp: Path, *, relative: bool = False) -> Iterator[KeyedRig]:
    """`confgen render` with the key, Envoy on it, and the sidecar with NO key in its environment."""
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["a", "b"]), seed=3)) as fleet:
        port, admin, listen = free_port(), free_port(), free_port()
        text = topology_text([f"127.0.0.1:{w.port}" for w in fleet.workers], admin=admin, port=port) + AUTH
        topology = tmp / "topology.yaml"
        topology.write_text(text)
        rendered = _confgen("render", topology, "-o", "envoy", cwd=tmp, env=_env(**{KEY_ENV: KEY}))
        assert rendered.returncode == 0, rendered.stderr
        xds = tmp / "envoy"
        assert KEY.encode() in (xds / "lds.json").read_bytes()
        xds_arg = "envoy" if relative else str(xds)
        args = ["--topology", str(topology), "--xds-dir", xds_arg, "--listen", f"127.0.0.1:{listen}", *FAST_ARGS]
        sidecar = SidecarProcess(args, tmp / "sidecar.log", listen, cwd=tmp if relative else REPO, env=_env())
        with EnvoyProcess(xds / "bootstrap.json") as proxy:
            sidecar.start()
            try:
                sidecar.wait_ready()
                yield KeyedRig(fleet, proxy, sidecar, topology, xds, text, admin, port)
            finally:
                code = sidecar.stop()
            assert code == 0, f"sidecar exited {code}:\n{sidecar.log_tail()}"


def test_sidecar_without_keys_publishes_eds_and_leaves_lds_alone(tmp_path: Path) -> None:
    """No key in the sidecar's environment: it starts, publishes EDS when a worker fails,
    keeps LDS byte-identical (the key still in it) and leaves no drift outside EDS."""
    with keyed_rig(tmp_path) as rig:
        lds_before = (rig.xds / "lds.json").read_bytes()
        rig.fleet.worker("a").set_fault("crash")
        assert poll(lambda: b"UNHEALTHY" in (rig.xds / "eds" / "chat" / "endpoints.json").read_bytes(), timeout=15)
        assert rig.sidecar.proc is not None and rig.sidecar.proc.poll() is None
        assert (rig.xds / "lds.json").read_bytes() == lds_before
        assert rig.drift() == []
        assert any(e.get("event") == "tree.lds_kept" for e in rig.sidecar.events())
        assert not any("Traceback" in line for line in rig.sidecar.log_tail(400).splitlines())


def test_reload_of_clusters_needs_no_key_and_listener_change_keeps_running_config(tmp_path: Path) -> None:
    """A capacity change (CDS only) is applied without keys, LDS untouched; then a new
    listener (LDS) without keys is refused: every file stays byte-identical, the process
    stays up, and the refusal shows in the metrics, the log, /readyz and /state."""
    with keyed_rig(tmp_path) as rig:
        lds_before = (rig.xds / "lds.json").read_bytes()
        cds_before = (rig.xds / "cds.json").read_bytes()
        rig.topology.write_text(rig.text.replace("capacity: 4", "capacity: 9"))
        assert poll(lambda: (rig.xds / "cds.json").read_bytes() != cds_before, timeout=10), rig.sidecar.log_tail()
        assert 'confgen_sidecar_topology_reloads_total{result="ok"} 1.0' in rig.sidecar.metrics()
        assert (rig.xds / "lds.json").read_bytes() == lds_before
        assert rig.drift() == []

        files = _tree(rig.xds)
        extra = f"  - {{name: second, address: 127.0.0.1, port: {free_port()}}}\n"
        changed = rig.text.replace("capacity: 4", "capacity: 9").replace("pools:\n", extra + "pools:\n")
        rig.topology.write_text(changed)
        assert poll(lambda: 'topology_reloads_total{result="needs_keys"} 1.0' in rig.sidecar.metrics(), timeout=10)
        metrics = rig.sidecar.metrics()
        assert "confgen_sidecar_topology_stale 1.0" in metrics
        status, body = rig.sidecar.get("/readyz")
        assert status == 200 and KEY_ENV.encode() in body, body
        assert "keeping the running configuration" in (rig.sidecar.state()["last_reload_error"] or "")
        events = [e for e in rig.sidecar.events() if e.get("event") == "topology.reload_needs_keys"]
        assert events and KEY_ENV in str(events[0]["errors"])
        assert {k: v for k, v in _tree(rig.xds).items() if not k.startswith("eds/")} == {
            k: v for k, v in files.items() if not k.startswith("eds/")}
        assert rig.sidecar.proc is not None and rig.sidecar.proc.poll() is None

        rig.topology.write_text(rig.text)  # back to a topology it can apply: no longer stale
        assert poll(lambda: "confgen_sidecar_topology_stale 0.0" in rig.sidecar.metrics(), timeout=10)
        assert (rig.xds / "lds.json").read_bytes() == lds_before


def test_relative_xds_dir_writes_no_relative_path(tmp_path: Path) -> None:
    """--xds-dir given relative (another working directory): bootstrap.json and cds.json
    keep the absolute paths `confgen render` wrote; render --check finds no drift."""
    with keyed_rig(tmp_path, relative=True) as rig:
        boot = (rig.xds / "bootstrap.json").read_bytes()
        cds = (rig.xds / "cds.json").read_bytes()
        rig.topology.write_text(rig.text.replace("capacity: 4", "capacity: 9"))  # forces a tree write
        assert poll(lambda: 'topology_reloads_total{result="ok"} 1.0' in rig.sidecar.metrics(), timeout=10)
        assert poll(lambda: (rig.xds / "cds.json").read_bytes() != cds, timeout=10)
        assert (rig.xds / "bootstrap.json").read_bytes() == boot
        assert f'"{rig.xds.resolve()}/eds/chat/endpoints.json"'.encode() in (rig.xds / "cds.json").read_bytes()
        assert rig.drift() == []


def test_ads_sidecar_without_keys_stays_up_and_says_why(tmp_path: Path) -> None:
    """--serve-xds serves the listeners, so it needs the keys: without them it stays up,
    /readyz answers 503 naming the missing variable, and no traceback is logged."""
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["a"]), seed=3)) as fleet:
        listen, xds = free_port(), free_port()
        text = topology_text([f"127.0.0.1:{fleet.workers[0].port}"], admin=free_port(), port=free_port())
        text = text.replace("pools:\n", f'envoy:\n  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"]}}\n'
                            f'sidecar: {{grpc_socket_dir: {tmp_path / "sockets"}}}\npools:\n')
        topology = tmp_path / "topology.yaml"
        topology.write_text(text + AUTH)
        args = ["--topology", str(topology), "--serve-xds", f"127.0.0.1:{xds}", "--listen", f"127.0.0.1:{listen}",
                *FAST_ARGS]
        sidecar = SidecarProcess(args, tmp_path / "sidecar.log", listen, env=_env())
        sidecar.start()
        try:
            def says_why() -> bool:
                try:
                    status, body = sidecar.get("/readyz")
                except OSError:
                    return False
                return status == 503 and KEY_ENV.encode() in body

            assert poll(says_why, timeout=15), sidecar.log_tail()
            assert sidecar.proc is not None and sidecar.proc.poll() is None
            assert "Traceback" not in sidecar.log_path.read_text()
            assert any(e.get("event") == "ads.needs_keys" for e in sidecar.events())
        finally:
            assert sidecar.stop() == 0, sidecar.log_tail()
