"""A fixed-bucket histogram of durations, kept by the daemon and read by the collector.

No prometheus_client metric objects live in the daemon (the registry is passed in at
start-up and the collector builds families from snapshots); this tally is the daemon's
own state, copied into each snapshot as an immutable `HistogramView`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["PROBE_BUCKETS_S", "DurationHistogram", "HistogramView"]

# A probe is one health GET and one metrics GET on loopback/cluster network: milliseconds
# when healthy, up to the probe deadline (1 s by default) when not.
PROBE_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True, slots=True)
class HistogramView:
    """Cumulative counts per upper bound (the last is +Inf), the sum and the count."""

    buckets: tuple[tuple[float, int], ...]
    total: float
    count: int


@dataclass(slots=True)
class DurationHistogram:
    bounds: tuple[float, ...] = PROBE_BUCKETS_S
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds
        self.count += 1

    def view(self) -> HistogramView:
        running, out = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return HistogramView(tuple(out), self.total, self.count)
