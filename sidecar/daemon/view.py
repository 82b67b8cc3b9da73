"""The fleet view's rows (`sidecar.fleet.PoolView`) built from the daemon's tracker and its outputs' status."""

from __future__ import annotations

from confgen.model import Pool
from sidecar.daemon.tracked import Tracker
from sidecar.decide.weights import pool_saturation, queue_depth
from sidecar.fleet import PoolView
from sidecar.outputs.contract import PoolStatus

__all__ = ["pool_view"]


def pool_view(pool: Pool, tracker: Tracker, outputs: PoolStatus) -> PoolView:
    """One EDS pool as the fleet view shows it: its endpoints, signals, and what its outputs report
    (`outputs`: every output's status of the pool, combined). Saturated, and why: the engines'
    rules as of the last cycle, else an output's (the in-flight watch, which also runs between cycles)."""
    members = tracker.by_key(pool.name)
    samples = {k: t.sample for k, t in members.items()}
    verdict = tracker.verdicts.get(pool.name)
    reason = verdict.reason if verdict is not None and verdict.saturated else outputs.saturated
    return PoolView(
        name=pool.name,
        engine=pool.engine,
        model=pool.models[0],
        saturation=pool_saturation(samples, {k: t.capacity for k, t in members.items()}),
        queue_depth=queue_depth(samples),
        publishes=outputs.publishes,
        rejections=outputs.rejections,
        rejected=outputs.rejected,
        endpoints=tracker.endpoints(pool.name),
        inflight_limit=outputs.inflight_limit,
        saturated=bool(reason) or (verdict is not None and verdict.saturated),
        saturated_reason=reason,
        queue_per_slot=tracker.watches[pool.name].signal if pool.name in tracker.watches else None,
        inflight_past_batch=outputs.inflight_past_batch,
        shed=dict(outputs.shed),
        shedding=outputs.shedding,
        sheddable_share=outputs.sheddable_share,
        probe_durations=tracker.durations(pool.name),
    )
