"""The sidecar's Prometheus metrics, read from the daemon's snapshot at scrape time.

A custom Collector registered on a registry passed in (no module-global metrics): each
scrape yields families built from the current `Snapshot`, so a worker that left the
topology has no series left behind, and counters come from the daemon's own tallies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sidecar.daemon import Snapshot
from sidecar.state import Status

__all__ = ["SidecarCollector", "register"]

_EP = ["pool", "worker", "address"]
_PREFIX = "confgen_sidecar_"


class SidecarCollector(Collector):
    """Yields every family from `snapshot()` when scraped."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        queue = GaugeMetricFamily("llm_queue_depth", "Requests waiting across the pool's workers "
                                  "(the autoscaling signal).", labels=["pool"])
        saturation = GaugeMetricFamily("llm_fleet_saturation", "Pool saturation: 1.0 is full, above 1 "
                                       "requests queue (max of slot use and KV use / knee).", labels=["pool"])
        health = GaugeMetricFamily(_PREFIX + "endpoint_health", "1 for the endpoint's published EDS status.",
                                   labels=[*_EP, "state"])
        running = GaugeMetricFamily(_PREFIX + "endpoint_running", "Sequences running (last sample).", labels=_EP)
        waiting = GaugeMetricFamily(_PREFIX + "endpoint_waiting", "Requests waiting (last sample).", labels=_EP)
        kv = GaugeMetricFamily(_PREFIX + "endpoint_kv_usage", "KV cache use, 0..1 (last sample).", labels=_EP)
        weight = GaugeMetricFamily(_PREFIX + "endpoint_weight", "EDS weight last published.", labels=_EP)
        latency = GaugeMetricFamily(_PREFIX + "endpoint_probe_latency_seconds",
                                    "Duration of the last probe (health and metrics).", labels=_EP)
        errors = CounterMetricFamily(_PREFIX + "probe_errors", "Failed probes by kind.", labels=[*_EP, "kind"])
        publishes = CounterMetricFamily(_PREFIX + "eds_publishes", "EDS files written.", labels=["pool"])
        rejected = CounterMetricFamily(_PREFIX + "eds_rejected", "EDS writes Envoy refused.", labels=["pool"])
        reloads = CounterMetricFamily(_PREFIX + "topology_reloads", "Topology reloads by result.", labels=["result"])
        ready = GaugeMetricFamily(_PREFIX + "ready", "1 when /readyz answers 200.")
        limit = GaugeMetricFamily(_PREFIX + "inflight_limit", "Requests in flight to the pool before this Envoy "
                                  "answers 429 (circuit-breaker override Envoy confirmed): the safety cap "
                                  "unless the pool is saturated.", labels=["pool"])
        saturated = GaugeMetricFamily(_PREFIX + "pool_saturated", "1 while the engines report the pool saturated "
                                      "(sidecar.saturation: waiting queue per slot, its trend, KV use; fresh "
                                      "metrics only).", labels=["pool"])
        for pool in snap.pools:
            queue.add_metric([pool.name], pool.queue_depth)
            saturated.add_metric([pool.name], 1.0 if pool.saturated else 0.0)
            saturation.add_metric([pool.name], pool.saturation)
            publishes.add_metric([pool.name], pool.publishes)
            rejected.add_metric([pool.name], pool.rejections)
            if pool.inflight_limit is not None:
                limit.add_metric([pool.name], pool.inflight_limit)
            for ep in pool.endpoints:
                labels = [pool.name, ep.key.worker, f"{ep.key.address}:{ep.key.port}"]
                for state in Status:
                    health.add_metric([*labels, state.value.lower()], 1.0 if ep.status == state.value else 0.0)
                if ep.sample is not None:
                    running.add_metric(labels, ep.sample.running)
                    waiting.add_metric(labels, ep.sample.waiting)
                    if ep.sample.kv_usage is not None:
                        kv.add_metric(labels, ep.sample.kv_usage)
                if ep.weight is not None:
                    weight.add_metric(labels, ep.weight)
                if ep.probe_latency_s is not None:
                    latency.add_metric(labels, ep.probe_latency_s)
                for kind, count in sorted(ep.errors.items()):
                    errors.add_metric([*labels, kind], count)
        for result in ("ok", "error"):
            reloads.add_metric([result], snap.reloads.get(result, 0))
        ready.add_metric([], 0.0 if snap.not_ready else 1.0)
        yield from (queue, saturation, health, running, waiting, kv, weight, latency, errors, publishes,
                    rejected, reloads, ready, limit, saturated)


def register(registry: CollectorRegistry, snapshot: Callable[[], Snapshot]) -> SidecarCollector:
    collector = SidecarCollector(snapshot)
    registry.register(collector)
    return collector
