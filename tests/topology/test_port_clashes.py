"""`confgen validate` checks every port the product binds against the others (confgen/_checks.py:_port_clashes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from confgen import parse_topology
from confgen.errors import Severity, TopologyError

ROOT = Path(__file__).resolve().parents[2]
BASE = """\
version: 1
name: t
listeners: [{name: public, port: %(port)s}]
pools: [{name: p, engine: vllm, models: [m], workers: ['10.0.0.1:8000'], balancing: {policy: %(policy)s}}]
%(extra)s
"""


def clashes(port: int, policy: str = "least_request", extra: str = "") -> list[str]:
    """The port-clash errors of a topology, as `file:line:col: path: message`."""
    text = BASE % {"port": port, "policy": policy, "extra": extra}
    try:
        parse_topology(text.encode(), "t.yaml")
    except TopologyError as exc:
        return [str(d) for d in exc.diagnostics
                if d.severity is Severity.ERROR and "address already in use" in d.message]
    return []


@pytest.mark.parametrize(("port", "policy", "extra", "expected"), [
    # a listener on the sidecar's HTTP port (it passed validate --envoy; the sidecar died at start)
    (9109, "least_request", "", ["t.yaml:3:34: listeners[0].port: port 9109 is also the sidecar's HTTP server "
                                 "(sidecar.port)"]),
    # on its gRPC port, where the picker runs
    (9110, "prefix_affinity", "", ["t.yaml:3:34: listeners[0].port: port 9110 is also the sidecar's gRPC services "
                                   "(sidecar.grpc_port)"]),
    # a listener on a moved sidecar port, on another address: the sidecar binds beside Envoy (every address in a pod)
    (9200, "least_request", "sidecar: {port: 9200}\nadmin: {address: 127.0.0.1}",
     ["t.yaml:3:34: listeners[0].port: port 9200 is also the sidecar's HTTP server (sidecar.port)"]),
    # Envoy's admin on the sidecar's port: said at both, one of them is where the file wrote it
    (8080, "least_request", "sidecar: {port: 9901}",
     ["t.yaml:1:1: admin.port: port 9901 is also the sidecar's HTTP server (sidecar.port)",
      "t.yaml:5:17: sidecar.port: port 9901 is also Envoy's admin (admin.port)"]),
    # ADS on loopback: the control plane's port is on Envoy's host
    (18000, "least_request", "envoy: {xds: {mode: ads, servers: ['127.0.0.1:18000', '127.0.0.1:18001']}}",
     ["t.yaml:3:34: listeners[0].port: port 18000 is also the control plane's ADS port (127.0.0.1:18000)"]),
    # the control plane serves the picker and ADS: one port for both
    (8080, "prefix_affinity", "sidecar: {grpc_port: 18000, grpc_tls: {cert: /c, key: /k, ca: /a}}\n"
     "envoy: {xds: {mode: ads, servers: ['cp-0.svc:18000', 'cp-1.svc:18000']}}",
     ["t.yaml:6:36: envoy.xds.servers[0]: port 18000 is also the sidecar's gRPC services (sidecar.grpc_port)",
      "t.yaml:6:54: envoy.xds.servers[1]: port 18000 is also the sidecar's gRPC services (sidecar.grpc_port)"]),
])
def test_a_port_bound_twice_is_an_error_at_its_place(port: int, policy: str, extra: str, expected: list[str]) -> None:
    """Each clash is an error pinned to file:line:col, naming the other binding and why it fails."""
    found = clashes(port, policy, extra)
    assert [f.split(": both bind")[0] for f in found] == expected, found


@pytest.mark.parametrize(("port", "policy", "extra"), [
    (9110, "least_request", ""),  # no picker, no global limit: the sidecar binds no gRPC port
    (18000, "least_request", "envoy: {xds: {mode: ads, servers: ['cp-0.svc:18000', 'cp-1.svc:18000']}}"),  # remote
    (9109, "least_request", "envoy: {xds: {mode: ads, servers: ['cp-0.svc:18000', 'cp-1.svc:18000']}}"),  # no sidecar
    (8080, "least_request", "envoy: {xds: {mode: ads, servers: ['127.0.0.1:18000', '127.0.0.1:18001']}}"),
])
def test_ports_on_different_hosts_or_unbound_do_not_clash(port: int, policy: str, extra: str) -> None:
    """A port clashes only where two programs bind it on one host: a control plane elsewhere (remote servers),
    no sidecar beside Envoy in mode ads, a gRPC port nobody serves."""
    assert clashes(port, policy, extra) == []


def test_validate_refuses_a_listener_on_the_sidecars_port(tmp_path: Path) -> None:
    """The command line: exit 1 with file:line:col, before any real Envoy runs."""
    topo = tmp_path / "t.yaml"
    topo.write_text(BASE % {"port": 9109, "policy": "least_request", "extra": ""})
    done = subprocess.run([sys.executable, "-m", "confgen", "validate", str(topo)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 1
    assert f"{topo}:3:34: listeners[0].port: port 9109 is also the sidecar's HTTP server" in done.stderr


def test_every_example_binds_each_port_once() -> None:
    """No shipped example or golden input trips the check."""
    for path in sorted([*(ROOT / "examples").glob("*.yaml"), *(ROOT / "tests/golden/inputs").glob("*.yaml")]):
        parse_topology(path.read_bytes(), str(path))  # raises TopologyError on any error
