"""One pool's `server` lines, in a file of their own: `upstreams/<pool>.conf`.

nginx's main config includes one such file per upstream block, so a sidecar can replace
one pool's servers (write a temp file, rename it into place, `nginx -s reload`) without
touching anything else. `render` writes the first version from the topology; a sidecar
calls `render_upstream` with the servers it measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from ._guard import bare
from ._templates import Templates

UPSTREAM_DIR = "upstreams"
MAX_WEIGHT = 128
# An upstream block needs at least one server; this one never takes traffic.
PLACEHOLDER = "127.0.0.1:1"


def upstream_path(pool: str) -> str:
    """Path of a pool's server list, relative to the config directory."""
    return str(PurePosixPath(UPSTREAM_DIR, f"{bare(pool)}.conf"))


def upstream_name(pool: str) -> str:
    """The nginx upstream block a pool becomes."""
    return f"pool_{pool}"


@dataclass(frozen=True, order=True)
class UpstreamServer:
    """One worker as nginx should see it: IP literal or DNS name, port, weight, flags."""

    address: str
    port: int
    weight: int = 1
    down: bool = False
    backup: bool = False
    worker: str = ""  # the worker as written in the topology, for humans (a comment)

    def __post_init__(self) -> None:
        if not 1 <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"weight {self.weight} outside 1..{MAX_WEIGHT}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port {self.port} outside 1..65535")
        if self.down and self.backup:
            raise ValueError("a server cannot be both down and backup")

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def render_upstream(
    pool: str,
    servers: Sequence[UpstreamServer],
    *,
    max_fails: int = 3,
    fail_timeout: str = "30s",
    hashing: bool = False,
    templates: Templates | None = None,
) -> bytes:
    """The content of `upstreams/<pool>.conf`: one `server` line per worker.

    `max_fails`/`fail_timeout` are nginx's passive health check (0 max_fails turns it
    off). `hashing` says the upstream uses hash or random balancing, where nginx refuses
    `backup` servers. With no server at all a placeholder marked `down` keeps the config
    valid (every request then fails over like an empty pool does in Envoy). `templates`:
    the caller's compiled templates when it renders more than one file (else compiled here).
    """
    if hashing and any(s.backup for s in servers):
        raise ValueError("nginx refuses backup servers in a hash or random upstream")
    if max_fails < 0:
        raise ValueError("max_fails must be >= 0")
    ordered = sorted(servers, key=lambda s: (s.backup, s.address, s.port))
    text = (templates or Templates()).render("nginx/upstream.conf.j2", {
        "pool": pool, "servers": ordered, "max_fails": max_fails, "fail_timeout": fail_timeout,
        "placeholder": PLACEHOLDER,
    })
    return text.encode()
