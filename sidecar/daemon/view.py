"""The fleet view (`sidecar.fleet.Snapshot`) built from the daemon's tracker and its outputs."""

from __future__ import annotations

from confgen.model import Pool
from sidecar.daemon.publish import Publishing
from sidecar.daemon.tracked import Tracker
from sidecar.decide.weights import pool_saturation, queue_depth
from sidecar.fleet import PoolView

__all__ = ["pool_view"]


def pool_view(pool: Pool, tracker: Tracker, outputs: Publishing) -> PoolView:
    """One EDS pool as the fleet view shows it: its endpoints, signals, and what its outputs did."""
    members = tracker.by_key(pool.name)
    samples = {k: t.sample for k, t in members.items()}
    saturated, reason = outputs.saturated(pool.name, tracker)
    publisher, limiter = outputs.publisher, outputs.limiter
    return PoolView(
        name=pool.name,
        engine=pool.engine,
        model=pool.models[0],
        saturation=pool_saturation(samples, {k: t.capacity for k, t in members.items()}),
        queue_depth=queue_depth(samples),
        publishes=publisher.publishes[pool.name],
        rejections=publisher.rejections[pool.name],
        rejected=pool.name in publisher.rejected,
        endpoints=tracker.endpoints(pool.name),
        inflight_limit=limiter.in_force.get(pool.name),
        saturated=saturated,
        saturated_reason=reason,
        queue_per_slot=tracker.watches[pool.name].signal if pool.name in tracker.watches else None,
        inflight_past_batch=limiter.inflight_signal(pool.name),
        shed=dict(limiter.shed.get(pool.name, {})),
        shedding=limiter.shedding(pool.name),
        sheddable_share=limiter.sheddable_share.get(pool.name),
        probe_durations=tracker.durations(pool.name),
    )
