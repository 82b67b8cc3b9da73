"""Render a topology for nginx under a temp prefix and run the real nginx on it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from confgen import nginx, parse_topology
from confgen.runtime import NginxProcess
from confgen.verify import loopback_ports


@dataclass(frozen=True)
class Running:
    proc: NginxProcess
    url: str
    status_url: str
    prefix: Path


def write_files(files: Mapping[str, bytes], prefix: Path) -> None:
    for rel, data in files.items():
        target = prefix / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


@contextmanager
def running_nginx(topology_yaml: str, prefix: Path, secrets: Mapping[str, str] | None = None) -> Iterator[Running]:
    """nginx serving `topology_yaml` (first listener) on a free loopback port."""
    topo, _ = parse_topology(topology_yaml.encode(), "test-topology.yaml")
    ports = loopback_ports(topo)
    port, status = ports[topo.listeners[0].name], ports[nginx.STATUS]
    files = nginx.render_for_test(topo, prefix=str(prefix), ports=ports, secrets=secrets)
    write_files(files, prefix)
    with NginxProcess(files["nginx.conf"].decode(), wait_port=port, prefix=prefix) as proc:
        yield Running(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{status}", prefix)
