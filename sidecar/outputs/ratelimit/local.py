"""The local floor: the decision script's semantics in this process, for a store that is away.

While Redis cannot be reached, a sidecar decides on its own with the same modes as the
script (store.py), each budget's amount cut to this Envoy's share (confgen.limits.floor_amount):
the fleet then admits at most the budget per window from its floors, never unlimited.
Counters live one window, reservations until their deadline, as in Redis; everything is in
memory (a restarted sidecar starts its floor from zero) and bounded (`max_keys`; past it
the floor refuses new keys rather than grow).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.outputs.ratelimit.store import Decision, Op

__all__ = ["LocalCounter"]


@dataclass(slots=True)
class _Reservations:
    held: dict[str, tuple[int, float]] = field(default_factory=dict)  # request id -> (estimate, deadline)
    expires: float = 0.0

    def total(self, now: float) -> int:
        for rid in [rid for rid, (_, deadline) in self.held.items() if deadline < now]:
            del self.held[rid]
        return sum(est for est, _ in self.held.values())


class LocalCounter:
    """Decides ops like RedisCounter.decide, synchronously, in memory (see the module)."""

    def __init__(self, max_keys: int = 50_000) -> None:
        self._counts: dict[str, tuple[int, float]] = {}  # key -> (count, expiry)
        self._reservations: dict[str, _Reservations] = {}
        self._max_keys = max_keys
        self._prune_at = 0.0

    def __len__(self) -> int:
        return len(self._counts) + sum(len(r.held) for r in self._reservations.values())

    def _prune(self, now: float) -> None:
        if now < self._prune_at and len(self) < self._max_keys:
            return
        self._prune_at = now + 1.0
        self._counts = {k: v for k, v in self._counts.items() if v[1] >= now}
        for key in [k for k, r in self._reservations.items() if r.expires < now or not r.total(now)]:
            del self._reservations[key]

    def _count(self, key: str, now: float) -> int:
        found = self._counts.get(key)
        return found[0] if found is not None and found[1] >= now else 0

    def holds(self, reservations: str, request_id: str, now: float) -> bool:
        """Whether this floor holds the reservation (the request was admitted here)."""
        found = self._reservations.get(reservations)
        return found is not None and request_id in found.held and found.held[request_id][1] >= now

    def decide(self, ops: list[Op], now: float) -> Decision:
        """The decision on one request's descriptors, with the script's modes (store.py)."""
        self._prune(now)
        current = [self._count(op.key, now) for op in ops]
        held = [self._reservations[op.reservations].total(now)
                if op.mode == "r" and op.reservations in self._reservations else 0 for op in ops]
        over = any((op.mode == "a" and c + op.cost > op.limit) or (op.mode == "c" and c >= op.limit)
                   or (op.mode == "r" and c + h >= op.limit) for op, c, h in zip(ops, current, held, strict=True))
        full = len(self) >= self._max_keys
        over = over or (full and any(op.mode in ("a", "r") for op in ops))
        out_counts, out_held, out_added = [], [], []
        for op, c, h in zip(ops, current, held, strict=True):
            add = op.cost
            if op.mode == "d" and op.request_id:
                add = self._release(op.reservations, op.request_id, now) or 0
            value = c
            applied = 0
            if add > 0 and (op.mode in ("f", "d") or (op.mode == "a" and not over)):
                value, applied = c + add, add
                previous = self._counts.get(op.key)
                expiry = previous[1] if previous is not None and previous[1] >= now else now + op.ttl_s
                self._counts[op.key] = (value, expiry)
            if op.mode == "r" and not over and op.estimate > 0:
                bucket = self._reservations.setdefault(op.reservations, _Reservations())
                bucket.held[op.request_id] = (op.estimate, now + op.hold_s)
                bucket.expires = max(bucket.expires, now + op.hold_s)
                h += op.estimate
            elif op.mode == "f" and op.request_id:
                self._release(op.reservations, op.request_id, now)
            out_counts.append(value)
            out_held.append(h)
            out_added.append(applied)
        return Decision(out_counts, out_held, over, out_added)

    def _release(self, reservations: str, request_id: str, now: float) -> int | None:
        """Drop a reservation; its estimate if it was held and not past its deadline."""
        bucket = self._reservations.get(reservations)
        if bucket is None or request_id not in bucket.held:
            return None
        est, deadline = bucket.held.pop(request_id)
        return est if deadline >= now else None

    def release(self, reservations: str, request_id: str, now: float) -> int | None:
        """Settle a reservation this floor held (its answer ended): its estimate, or None."""
        return self._release(reservations, request_id, now)
