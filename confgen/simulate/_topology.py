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
    admin: int,
    port: int,
    workers: Sequence[str],
    models: Sequence[str],
    capacity: int,
    pool: Sequence[str] = (),
    tail: Sequence[str] = (),
) -> str:
    """YAML for pool `chat` of `workers` (host:port items) behind listener `public` on
    127.0.0.1:`port`, admin on 127.0.0.1:`admin`. `pool` adds lines to the pool (e.g.
    "balancing: {policy: round_robin}"), `tail` adds top-level lines (e.g. a last_resort)."""
    lines = [
        "version: 1",
        f"name: {name}",
        f"admin: {{address: 127.0.0.1, port: {admin}}}",
        "listeners:",
        f"  - {{name: public, address: 127.0.0.1, port: {port}}}",
        "pools:",
        "  - name: chat",
        "    engine: vllm",
        f"    models: [{', '.join(models)}]",
        f"    capacity: {capacity}",
        *(f"    {line}" for line in pool),
        "    workers:",
        *(f"      - {worker}" for worker in workers),
        *tail,
    ]
    return "\n".join(lines) + "\n"
