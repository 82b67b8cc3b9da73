"""Envoy's admin on its Unix socket (the default; confgen.envoy.admin): the real Envoy binds it 0600,
answers on it, and another local user cannot connect, where a loopback port would let any local user
stop Envoy or change its runtime (the in-flight limits, the picker's bypass share). The sidecar reaches it
there with no flag (its /envoy relay and its runtime writes); `--admin-loopback` and admin.address/port
put it on TCP."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from confgen import envoy
from confgen.errors import DeployError
from confgen.model import admin_on_loopback
from confgen.runtime import EnvoyProcess, free_port
from confgen.topology import parse
from tests.sidecar_live.rig import live_rig, worker_specs
from tests.support.envoy import wait_until

TOPOLOGY = """\
version: 1
name: adm
listeners: [{name: public, address: 127.0.0.1, port: PORT}]
pools:
  - {name: chat, engine: vllm, models: [m], workers: ["127.0.0.1:9"]}
"""

# Connect to a Unix socket as the user `nobody` (65534); prints "connected" or the errno's name.
_AS_NOBODY = """\
import errno, os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    print("connected")
except OSError as exc:
    print(errno.errorcode.get(exc.errno, exc.errno))
"""


@pytest.fixture()
def open_dir() -> Iterator[Path]:
    """A directory every local user may enter (0755 all the way down from /tmp), so only the socket's
    own mode decides who connects (pytest's tmp_path sits in a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="confgen-admin-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for child in sorted(path.rglob("*"), reverse=True):
            child.unlink() if not child.is_dir() else child.rmdir()
        path.rmdir()


def _render(directory: Path, text: str = TOPOLOGY) -> Path:
    topo, _ = parse(text.replace("PORT", str(free_port())).encode())
    out = directory / "out"
    out.mkdir()
    for rel, data in envoy.render(topo, config_dir=str(out)).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return out


def _as_nobody(path: Path) -> str:
    done = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(path)], capture_output=True, text=True,
                          timeout=20, check=True)
    return done.stdout.strip()


def test_the_default_admin_is_a_0600_socket_beside_the_files_that_another_user_cannot_connect_to(
        open_dir: Path) -> None:
    out = _render(open_dir)
    boot = json.loads((out / "bootstrap.json").read_text())
    sock = out / "envoy-admin.sock"
    assert boot["admin"] == {"address": {"pipe": {"path": str(sock), "mode": 0o600}}}
    with EnvoyProcess(out / "bootstrap.json") as proc:
        assert proc.admin_url == f"unix:{sock}"
        assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
        status, body = proc.admin_get("/stats?filter=^server.live$")
        assert (status, body.strip()) == (200, "server.live: 1")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user (the suite's CI runs as root)")
def test_another_local_user_cannot_connect_to_the_admin_socket(open_dir: Path) -> None:
    out = _render(open_dir)
    sock = out / "envoy-admin.sock"
    with EnvoyProcess(out / "bootstrap.json"):
        assert _as_nobody(sock) == "EACCES"
        sock.chmod(0o666)  # the check itself: with the mode opened, that user gets in
        assert _as_nobody(sock) == "connected"


def test_admin_address_port_and_the_pods_flag_put_it_on_tcp(open_dir: Path) -> None:
    topo, _ = parse(TOPOLOGY.replace("PORT", "8080").encode())
    tcp = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9901}}}
    assert envoy.render(admin_on_loopback(topo), config_dir="/x")["bootstrap.json"] == \
        envoy.render(parse((TOPOLOGY + "admin: {port: 9901}\n").replace("PORT", "8080").encode())[0],
                     config_dir="/x")["bootstrap.json"]
    assert json.loads(envoy.render(admin_on_loopback(topo), config_dir="/x")["bootstrap.json"])["admin"] == tcp
    own = parse((TOPOLOGY + "admin: {socket: /run/e/admin.sock}\n").replace("PORT", "8080").encode())[0]
    assert json.loads(envoy.render(own, config_dir="/x")["bootstrap.json"])["admin"]["address"]["pipe"]["path"] \
        == "/run/e/admin.sock"
    with pytest.raises(DeployError, match=r"admin\.socket"):
        envoy.render(topo, config_dir="/" + "d" * 100)  # no room left in sun_path for the socket's name


def test_the_sidecar_reaches_the_admin_socket_with_no_flag(tmp_path: Path) -> None:
    """The live rig renders the product's default (admin on its socket) and starts the sidecar without
    --envoy-admin: its /envoy relay answers from Envoy, and the runtime value it writes at start (the
    picker's bypass share, 0) is in Envoy's runtime: a write through the socket, read back."""
    with live_rig(tmp_path, worker_specs(["a"]), policy="prefix_affinity") as rig:
        assert rig.admin is None and rig.envoy.admin_url == f"unix:{rig.xds_dir}/envoy-admin.sock"
        assert "--envoy-admin" not in rig.sidecar.args
        assert rig.sidecar.get("/envoy/ready") == (200, b"LIVE\n")
        status, stats = rig.sidecar.get("/envoy/stats")
        assert status == 200 and b"envoy_server_live{} 1" in stats

        def written() -> bool:
            status, body = rig.envoy.admin_get("/runtime")
            entry = json.loads(body)["entries"].get(envoy.PICKER_BYPASS_RUNTIME_KEY, {}) if status == 200 else {}
            return entry.get("final_value") == "0"

        assert wait_until(written, timeout=10)
        with socket.create_connection(("127.0.0.1", rig.port), timeout=5):
            pass  # the data listener is up beside it
