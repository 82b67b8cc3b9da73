"""How late requests reach the picker, from when the proxy received them.

confgen's render has Envoy send each request's `request.time` (when its first byte arrived)
with the headers message. Its age when the picker reads it is the time the request has
already waited on the picker: in Envoy, in the gRPC transport, in the sidecar's process
before its loop sees it. At a rate the picker cannot keep up with, that queue forms before
its event loop (measured at 2,000 req/s on the 2-core machine: headers 20-200 ms old while the
loop ran on time), so the loop's own lateness cannot see it and every request waited Envoy's
200 ms message timeout. A request this late is answered at once without a pick (the cheapest
answer: the stream ends with it), so the picker sheds its own work and not the client's time.

The two clocks may differ (the picker in a control plane on another host): the age counted
is the age less the least age seen in the last one to two windows (`window_s`), which is the
offset between the clocks plus the transport's floor. The servicer keeps one `Lateness` per
gRPC connection, so Envoys whose clocks differ are each timed on their own, and a connection
that sends a request.time in the future lowers only its own floor. An age past `SANE_S`
beyond the floor is a clock that stepped, not a queue, and counts as on time. Pure: the clock
is passed in.
"""

from __future__ import annotations

import math
from datetime import datetime

__all__ = ["LATE_S", "Lateness", "parse_request_time"]

LATE_S = 0.02  # the default past which a request is late (`--picker late_s`)
SANE_S = 10.0  # later than this past the floor: a clock step (Envoy gives up on a message after 0.2 s)


def parse_request_time(value: str) -> float | None:
    """Seconds since the epoch of an RFC 3339 time as Envoy sends `request.time`
    (`2026-12-05T12:42:00.471307+00:00`); None when it is not one."""
    if not value or len(value) > 64:
        return None
    try:
        stamp = datetime.fromisoformat(value)
    except ValueError:
        return None
    if stamp.tzinfo is None:
        return None
    return stamp.timestamp()


class Lateness:
    """The age of each request on reaching the picker, less the floor of recent ages."""

    __slots__ = ("_current", "_previous", "_started", "window_s")

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._started: float | None = None  # the current window's start
        self._current = math.inf  # least age seen in the current window
        self._previous = math.inf  # ... and in the one before

    def observe(self, sent_at: float, now: float) -> float:
        """Seconds the request reached the picker past the floor (>= 0): `sent_at` when the proxy
        received it, `now` this clock's time (seconds since the epoch, both)."""
        age = now - sent_at
        if self._started is None:
            self._started = now
        elif now - self._started >= self.window_s:
            # a whole window passed: the current becomes the previous (two or more: both forgotten)
            self._previous = self._current if now - self._started < 2 * self.window_s else math.inf
            self._current = math.inf
            self._started = now
        self._current = min(self._current, age)
        late = age - min(self._current, self._previous)
        return late if late <= SANE_S else 0.0

    def since(self, sent_at: float, now: float) -> float:
        """Seconds past the floor for a later message of a request already observed (not counted
        towards the floor: its age includes the picker's own answer to the earlier one)."""
        floor = min(self._current, self._previous)
        if math.isinf(floor):
            return 0.0
        late = now - sent_at - floor
        return late if 0.0 <= late <= SANE_S else 0.0
