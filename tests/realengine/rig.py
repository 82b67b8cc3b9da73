"""Real llama-servers behind confgen's rendered Envoy and the sidecar as shipped.

The same rig as tests/sidecar_live (the sidecar runs as `python -m sidecar.main`, Envoy
serves the unmodified render), with real engines instead of the simulator. The sidecar is
started WITHOUT `--listen`: it listens where the topology's `sidecar.port` says, which is
where the rendered Envoy asks it for `/v1/models` (one source for both).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import fleet_topology
from tests.realengine.servers import MODEL_ALIAS, LlamaServer, http
from tests.sidecar_live.rig import FAST_ARGS, SidecarProcess


@dataclass
class RealRig:
    servers: list[LlamaServer]
    envoy: EnvoyProcess
    sidecar: SidecarProcess
    port: int
    sidecar_port: int

    def url(self, path: str = "/v1/completions") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, body: dict[str, Any], path: str = "/v1/completions", timeout: float = 30.0) -> tuple[int, bytes]:
        try:
            status, _, raw = http("POST", self.url(path), {"model": MODEL_ALIAS, **body}, timeout=timeout)
        except OSError as exc:
            return 0, str(exc).encode()
        return status, raw

    def endpoint(self, server: LlamaServer) -> dict[str, Any]:
        for ep in self.sidecar.state()["pools"]["chat"]["endpoints"]:
            if ep["port"] == server.port:
                return dict(ep)
        raise KeyError(server.port)


def topology(workers: Sequence[str], *, port: int, admin: int, sidecar_port: int, capacity: int,
             policy: str = "least_request", grpc_port: int | None = None, sockets: Path | None = None) -> str:
    link = f"port: {sidecar_port}" + (f", grpc_port: {grpc_port}" if grpc_port is not None else "")
    link += f", grpc_socket_dir: {sockets}" if sockets is not None else ""
    return fleet_topology(
        name="real", admin=admin, port=port, workers=workers, models=[MODEL_ALIAS], capacity=capacity,
        engine="llamacpp",
        pool=[f"balancing: {{policy: {policy}}}", "health: {enabled: false}", "outlier_detection: {enabled: false}"],
        tail=[f"sidecar: {{{link}}}"],
    )  # fmt: skip


@contextlib.contextmanager
def real_rig(tmp: Path, servers: list[LlamaServer], *, capacity: int = 4, policy: str = "least_request",
             sidecar_args: Sequence[str] = FAST_ARGS) -> Iterator[RealRig]:
    """`policy` prefix_affinity: the sidecar's endpoint picker (gRPC on the topology's
    sidecar.grpc_port, a free port here) picks each request's server."""
    port, admin, sidecar_port = free_port(), free_port(), free_port()
    grpc_port = free_port() if policy == "prefix_affinity" else None
    text = topology([s.address for s in servers], port=port, admin=admin, sidecar_port=sidecar_port,
                    capacity=capacity, policy=policy, grpc_port=grpc_port, sockets=tmp / "sockets")
    topo_path = tmp / "topology.yaml"
    topo_path.write_text(text)
    xds = tmp / "envoy"
    topo, _ = parse_topology(text.encode())
    write_tree(envoy.render(topo, config_dir=str(xds)), xds, rank=envoy.layout.write_rank)
    args = ["--topology", str(topo_path), "--xds-dir", str(xds), *sidecar_args]
    sidecar = SidecarProcess(args, tmp / "sidecar.log", sidecar_port)
    with EnvoyProcess(xds / "bootstrap.json") as proxy:
        sidecar.start()
        try:
            sidecar.wait_ready()
            yield RealRig(servers, proxy, sidecar, port, sidecar_port)
        finally:
            code = sidecar.stop()
        assert code == 0, f"sidecar exited {code} on SIGTERM:\n{sidecar.log_tail()}"


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of a `text/event-stream` body, without the final `[DONE]`."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            out.append(json.loads(line[6:]))
    return out
