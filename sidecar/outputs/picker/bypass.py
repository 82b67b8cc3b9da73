"""The share of requests that skip the picker altogether, while it cannot keep up.

The late rule (lateness.py) answers a request that reaches the picker late at once, without a
pick: no request waits on a busy picker. But such a request still makes one round trip through
the queue that made it late (Envoy's ext_proc client, the gRPC transport, the sidecar's loop):
measured at 2,000 req/s on the 2-core bench machine, +26-42 ms at the median, +59-94 ms at P99,
with 36-64 % of the requests answered late. The cure is to send fewer: Envoy skips the picker's
filter for a runtime share of requests (`confgen.envoy.PICKER_BYPASS_RUNTIME_KEY`, drawn on a hash
of the request id) and balances those with least_request at no cost, and the rest reach a picker
that keeps up, on time.

`Bypass.step` sets that share from what the last interval's requests met: "late" here is queued,
read `--picker bypass_wait_s` (5 ms) or more past the floor of ages, or answered late; well before
the late rule's 20 ms, so the picker sheds load while its queue is still short (with the answered-
late share as the signal the share settled where 1-10 % reached it 20 ms late: at 2,000 req/s the
picker's P99 stayed 52-57 ms). Additive-increase multiplicative-decrease turned around (the share
is what is shed, not what is admitted):

- late share over `on` (sustained: `streak` intervals in a row the first time; a burst of late
  requests, a pause of the process, is the late rule's to answer): the share rises so that, had it
  held during the interval, the requests late would have skipped the picker instead:
  1 - (1 - share) * (1 - late share), at least `min_step`.
- late share under `off`: it falls by `step_down` points, probing whether the picker keeps up
  again (it does when its load fell, or when the share overshot);
- in between, or fewer than `min_requests` seen (under 100 req/s: the late rule's round trip is
  cheap there): it holds (too little evidence to move).

It never passes `max_percent`: the picker keeps seeing some requests, so it learns when it keeps up
again (and its prefix index keeps learning where conversations live). And it does not rise while any
of the picker's pools surges (admission on, or requests arriving as fast as the pool serves them:
`Admission.surging`): a request sent past the picker is sent past its admission too, into the engines'
queues, and a surge is when the picker's queue (tens of ms, its late answers refused by admission as
well) costs least against the seconds an unadmitted backlog costs (measured: 12 workers at a 3x spike
on the 2-core bench machine, the share rose in the spike's first second, 429-962 requests went past
the picker, and the spike's last second was shed 20-52 % with admitted P99 5.1-5.4 s, or refused whole
by the daemon's limiter and the picker). Pure: the caller feeds it
each interval's counts and publishes the share (the sidecar's runtime writer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Bypass", "BypassPolicy"]


@dataclass(frozen=True, slots=True)
class BypassPolicy:
    interval_s: float = 0.5  # how often the share is set
    on: float = 0.1  # a late share above this raises the share ...
    streak: int = 2  # ... from 0 only after this many intervals in a row above it
    off: float = 0.01  # a late share below this lowers it
    min_step: int = 5  # points, the least a rise moves it
    step_down: int = 5  # points per interval while the picker keeps up
    max_percent: int = 90  # 0: never bypass
    min_requests: int = 50  # an interval with fewer says nothing either way


class Bypass:
    """The current share (percent of requests that skip the picker) and how it moves."""

    __slots__ = ("_over", "percent", "policy")

    def __init__(self, policy: BypassPolicy | None = None) -> None:
        self.policy = policy or BypassPolicy()
        self.percent = 0
        self._over = 0  # intervals in a row with a late share above `on`

    def step(self, seen: int, late: int, surging: bool = False) -> int:
        """The share for the next interval, from the last one's `seen` requests (those that reached the
        picker), `late` of them answered late; while `surging` (a pool admits, or is offered its capacity)
        it does not rise."""
        p = self.policy
        if seen < p.min_requests:
            return self.percent
        share = min(1.0, max(0.0, late / seen))
        self._over = self._over + 1 if share > p.on else 0
        if share > p.on:
            if not surging and (self.percent > 0 or self._over >= p.streak):  # surging: past it is past admission
                kept = (100 - self.percent) * (1.0 - share)
                wanted = max(100 - math.floor(kept), self.percent + p.min_step)
                self.percent = min(p.max_percent, wanted)
        elif share < p.off:
            self.percent = max(0, self.percent - p.step_down)
        return self.percent
