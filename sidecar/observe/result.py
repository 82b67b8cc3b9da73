"""What one probe of one endpoint observed: the observe stage's output, the decide stage's input."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sidecar.observe.engines import LoadSample

__all__ = ["Outcome", "ProbeResult"]


class Outcome(StrEnum):
    """How a health probe ended."""

    OK = "ok"  # 2xx health answer, metrics parsed (or none expected)
    HTTP_STATUS = "http_status"  # non-2xx health answer; see ProbeResult.http_status
    TIMEOUT = "timeout"
    REFUSED = "refused"
    RESET = "reset"
    BAD_METRICS = "bad_metrics"  # health 2xx, metrics body unusable: alive, no load info
    LOOP_LATE = "loop_late"  # deadline missed while the sidecar's own event loop ran late: nothing learnt


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe of one endpoint: `at` in seconds on the caller's monotonic clock."""

    at: float
    outcome: Outcome
    health_latency_s: float | None = None
    sample: LoadSample | None = None
    http_status: int | None = None
    health_checked: bool = True  # False: /health skipped, progress in the metrics stood in
    metrics_checked: bool = True  # False: /metrics skipped (quiet engine), `sample` is None by design

    def __post_init__(self) -> None:
        if (self.outcome is Outcome.HTTP_STATUS) != (self.http_status is not None):
            raise ValueError("http_status is set exactly when outcome is HTTP_STATUS")
