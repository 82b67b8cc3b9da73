"""Each pool's admission state over time: the shedding controller (`saturation.admit`) per pool.

Both in-flight limiters (the file target's, through Envoy's admin runtime; the ADS one,
through RTDS) keep one `Admissions` and differ only in how they learn what is in flight and
where they put the limit. Pure: no I/O; the time is passed in.
"""

from __future__ import annotations

import logging
from typing import Any

from sidecar.decide.saturation import Admission, PoolLoad, SaturationPolicy, admit
from sidecar.logs import log_event

__all__ = ["Admissions"]


class Admissions:
    """The controller's state per pool; `step` is one cycle's decision for one pool."""

    def __init__(self, policy: SaturationPolicy | None, logger: logging.Logger) -> None:
        self._policy = policy or SaturationPolicy()
        self._log = logger
        self._state: dict[str, Admission] = {}

    def previous(self, pool: str) -> Admission | None:
        return self._state.get(pool)

    def shedding(self, pool: str) -> bool:
        """True while the pool's limit follows the controller rather than the safety cap."""
        state = self._state.get(pool)
        return state is not None and state.shedding

    def pools(self) -> tuple[str, ...]:
        """The pools it holds a state for."""
        return tuple(self._state)

    def forget(self, pool: str) -> None:
        self._state.pop(pool, None)

    def step(self, pool: str, load: PoolLoad, in_flight: int | None, refused: bool, ingresses: int, now: float,
             **log_fields: Any) -> int:
        """The pool's limit for this cycle (logs when shedding starts or stops)."""
        previous = self._state.get(pool)
        state = admit(previous, load.saturation, in_flight, refused, load.cap, ingresses, now, self._policy)
        if state.shedding != (previous is not None and previous.shedding):
            log_event(self._log, logging.WARNING if state.shedding else logging.INFO,
                      "shed.start" if state.shedding else "shed.stop", pool=pool, limit=state.limit,
                      cap=load.cap, ingresses=ingresses, **log_fields)
        self._state[pool] = state
        return state.limit
