"""Connected Envoys by node id, and what each one accepted or refused, per resource type.

A node may hold several streams (a reconnect overlapping the old stream's end); it counts
as connected while any is open and leaves every view when its last one closes. A NACK is
kept with Envoy's error_detail until the node ACKs a later version of that type: the
version it last accepted stays in force in that Envoy meanwhile.

Bounded: at most `max_nodes` distinct node ids at once (a new one beyond is refused by the
server). `counted()` is how many Envoys share the fleet for the in-flight limits: only nodes
that ACKed the runtime layer (RTDS), and at most `per_credential` of them per credential
(the connection's proof of who it is: one client certificate identity, or "unix" / "plaintext"
for the local transports), at most `max_nodes` in all. A node id is a name the client chose;
only a credential is proved. So a client that connects and never applies the limits does not
shrink the share of those that do, and neither do a hundred node ids behind one certificate
(a group certificate `<name>/<anything>`) or one local socket: each credential counts as many
Envoys as it is known to stand for (`per_credential`: 1, or the replicas that share a
certificate), never more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.fleet import Nack, NodeView
from sidecar.outputs.xds.cache import RTDS

__all__ = ["Nack", "NodeView", "Nodes"]


@dataclass(slots=True)
class _Node:
    cluster: str
    protocol: str  # "sotw" | "delta"
    credential: str  # what the first stream's connection proved (see `credential_of`)
    streams: int = 0
    acked: dict[str, str] = field(default_factory=dict)  # type_url -> version
    nacked: dict[str, Nack] = field(default_factory=dict)
    nacks: Counter[str] = field(default_factory=Counter)


class Nodes:
    """The fleet of Envoys as the control plane sees it; `on_change` runs when the set of nodes changes."""

    def __init__(self, clock: Callable[[], float], on_change: Callable[[], None] | None = None,
                 max_nodes: int = 1000, per_credential: int = 1) -> None:
        if per_credential < 1:
            raise ValueError(f"per_credential must be >= 1, got {per_credential}")
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._on_change = on_change
        self.max_nodes = max_nodes
        self.per_credential = per_credential
        self.nacks_total = 0

    def connect(self, node: str, cluster: str, protocol: str, credential: str = "plaintext") -> bool:
        """A stream of `node` opened over a connection that proved `credential`; False (nothing
        recorded) when it would exceed `max_nodes`. A node keeps the credential of its first stream."""
        entry = self._nodes.get(node)
        if entry is None:
            if len(self._nodes) >= self.max_nodes:
                return False
            entry = self._nodes[node] = _Node(cluster, protocol, credential)
        entry.streams += 1
        if entry.streams == 1 and self._on_change is not None:
            self._on_change()
        return True

    def disconnect(self, node: str) -> None:
        entry = self._nodes.get(node)
        if entry is None:
            return
        entry.streams -= 1
        if entry.streams <= 0:
            del self._nodes[node]
            if self._on_change is not None:
                self._on_change()

    def ack(self, node: str, type_url: str, version: str) -> None:
        entry = self._nodes.get(node)
        if entry is not None:
            entry.acked[type_url] = version
            entry.nacked.pop(type_url, None)

    def nack(self, node: str, type_url: str, version: str, message: str) -> None:
        entry = self._nodes.get(node)
        if entry is not None:
            entry.nacked[type_url] = Nack(version, message, self._clock())
            entry.nacks[type_url] += 1
            self.nacks_total += 1

    def __len__(self) -> int:
        return len(self._nodes)

    def counted(self) -> int:
        """Envoys that share the fleet's limits: connected nodes that ACKed RTDS, at most
        `per_credential` per credential, at most `max_nodes` in all."""
        per: Counter[str] = Counter(n.credential for n in self._nodes.values() if RTDS in n.acked)
        return min(self.max_nodes, sum(min(self.per_credential, count) for count in per.values()))

    def view(self) -> tuple[NodeView, ...]:
        return tuple(
            NodeView(name, n.cluster, n.protocol, n.streams, dict(n.acked), dict(n.nacked), dict(n.nacks))
            for name, n in sorted(self._nodes.items())
        )
