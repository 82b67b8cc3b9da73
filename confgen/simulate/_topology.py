"""The topology of a simulated fleet on loopback: one pool behind one loopback listener.

What `confgen demo` serves and what the live tests run, from one template, so the two
cannot drift apart in the parts they share.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fleet_topology"]


def fleet_topology(
    *,
    name: str,
    admin: int | None,
    port: int,
    workers: Sequence[str],
    models: Sequence[str],
    capacity: int,
    engine: str = "vllm",
    pool: Sequence[str] = (),
    tail: Sequence[str] = (),
    sidecar_port: int | None = None,
    listener: str = "",
) -> str:
    """YAML for pool `chat` of `workers` (host:port items) behind listener `public` on
    127.0.0.1:`port`, admin on 127.0.0.1:`admin` (None: on its Unix socket, the default). `pool`
    adds lines to the pool (e.g. "balancing: {policy: round_robin}"), `engine` is the pool's engine kind, `tail` adds
    top-level lines (e.g. a last_resort), `listener` more keys of the listener's flow mapping
    (e.g. "trusted_headers: {...}"). `sidecar_port`: where the sidecar listens (the rendered
    Envoy asks it there for /v1/models; a sidecar started without --listen listens there)."""
    lines = [
        "version: 1",
        f"name: {name}",
        *([f"admin: {{address: 127.0.0.1, port: {admin}}}"] if admin is not None else []),
        "listeners:",
        f"  - {{name: public, address: 127.0.0.1, port: {port}{', ' + listener if listener else ''}}}",
        "pools:",
        "  - name: chat",
        f"    engine: {engine}",
        f"    models: [{', '.join(models)}]",
        f"    capacity: {capacity}",
        *(f"    {line}" for line in pool),
        "    workers:",
        *(f"      - {worker}" for worker in workers),
        *tail,
        *([f"sidecar: {{port: {sidecar_port}}}"] if sidecar_port is not None else []),
    ]
    return "\n".join(lines) + "\n"
