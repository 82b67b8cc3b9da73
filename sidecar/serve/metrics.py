"""The sidecar's Prometheus metrics, read from the daemon's snapshot at scrape time.

A custom Collector registered on a registry passed in (no module-global metrics): each
scrape yields families built from the current `Snapshot`, so a worker that left the
topology has no series left behind, and counters come from the daemon's own tallies.

Names: one prefix, `confgen_sidecar_`, besides the design's autoscaling signal
`llm_queue_depth`; base units (seconds), `_ratio` for 0..1 values, `_total` for counters,
a histogram for probe durations and a `confgen_sidecar_build_info`.

`llm_queue_depth{pool,worker}` is reported once per worker (not summed per pool): every
proxy replica's sidecar probes the same workers, so a rule that sums over scraped series
would count each worker's queue once per replica. `max by (pool, worker)` collapses the
replicas and `sum by (pool)` of that is the pool's queue, the same figure with 1 or N
proxy replicas (the prometheus-adapter rule and the KEDA query render exactly that).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from confgen import __version__
from sidecar.decide.state import Status
from sidecar.fleet import Snapshot

__all__ = ["METRIC_NAMES", "SidecarCollector", "register", "without_created"]

_EP = ["pool", "worker", "address"]
_PREFIX = "confgen_sidecar_"

# Every family this collector can yield (the nginx publisher adds its own three).
METRIC_NAMES = (
    "llm_queue_depth",
    _PREFIX + "build_info",
    _PREFIX + "ready",
    _PREFIX + "engine_time_to_first_token_seconds",
    _PREFIX + "engine_time_per_output_token_seconds",
    _PREFIX + "engine_output_tokens_total",
    _PREFIX + "problems",
    _PREFIX + "probe_cycles_total",
    _PREFIX + "pool_saturation_ratio",
    _PREFIX + "inflight_limit",
    _PREFIX + "pool_saturated",
    _PREFIX + "pool_shedding",
    _PREFIX + "pool_queue_per_slot",
    _PREFIX + "pool_inflight_past_batch",
    _PREFIX + "shed_requests_total",
    _PREFIX + "sheddable_refused_ratio",
    _PREFIX + "endpoint_health",
    _PREFIX + "endpoint_serving",
    _PREFIX + "endpoint_failing",
    _PREFIX + "endpoint_running_requests",
    _PREFIX + "endpoint_waiting_requests",
    _PREFIX + "endpoint_kv_cache_usage_ratio",
    _PREFIX + "endpoint_weight",
    _PREFIX + "probe_duration_seconds",
    _PREFIX + "probe_errors_total",
    _PREFIX + "eds_publishes_total",
    _PREFIX + "eds_rejected_total",
    _PREFIX + "topology_reloads_total",
    _PREFIX + "topology_stale",
    _PREFIX + "write_failures_total",
    _PREFIX + "external_changes_total",
)


class SidecarCollector(Collector):
    """Yields every family from `snapshot()` when scraped."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        build = GaugeMetricFamily(_PREFIX + "build_info", "1, labelled with the sidecar's version.",
                                  labels=["version", "python_version"])
        build.add_metric([__version__, platform.python_version()], 1.0)
        queue = GaugeMetricFamily("llm_queue_depth", "Requests waiting in the worker's engine (the autoscaling "
                                  "signal; sum by pool of max by (pool, worker) is the pool's queue).",
                                  labels=["pool", "worker"])
        saturation = GaugeMetricFamily(_PREFIX + "pool_saturation_ratio", "Pool saturation: 1 is full, above 1 "
                                       "requests queue (max of slot use and KV use / knee).", labels=["pool"])
        health = GaugeMetricFamily(_PREFIX + "endpoint_health", "1 for the endpoint's published EDS status.",
                                   labels=[*_EP, "state"])
        serving = GaugeMetricFamily(_PREFIX + "endpoint_serving", "1 while the endpoint is in rotation and not "
                                    "known to be failing (0: failing, drained, or kept in only by the ejection "
                                    "cap); what the alerts count, not the published status.", labels=_EP)
        failing = GaugeMetricFamily(_PREFIX + "endpoint_failing", "1 while the endpoint's probes say it fails "
                                    "(UNHEALTHY in the health state machine, not drained), whatever is published: "
                                    "with a whole pool failing the sidecar stands back and publishes none of it "
                                    "UNHEALTHY.", labels=_EP)
        running = GaugeMetricFamily(_PREFIX + "endpoint_running_requests", "Sequences running (last sample).",
                                    labels=_EP)
        waiting = GaugeMetricFamily(_PREFIX + "endpoint_waiting_requests", "Requests waiting (last sample).",
                                    labels=_EP)
        kv = GaugeMetricFamily(_PREFIX + "endpoint_kv_cache_usage_ratio", "KV cache use, 0..1 (last sample).",
                               labels=_EP)
        weight = GaugeMetricFamily(_PREFIX + "endpoint_weight", "EDS weight last published.", labels=_EP)
        durations = HistogramMetricFamily(_PREFIX + "probe_duration_seconds",
                                          "Duration of each probe (health and metrics) of the pool's endpoints.",
                                          labels=["pool"])
        errors = CounterMetricFamily(_PREFIX + "probe_errors", "Failed probes by kind.", labels=[*_EP, "kind"])
        publishes = CounterMetricFamily(_PREFIX + "eds_publishes", "EDS files written.", labels=["pool"])
        rejected = CounterMetricFamily(_PREFIX + "eds_rejected", "EDS writes Envoy refused.", labels=["pool"])
        reloads = CounterMetricFamily(_PREFIX + "topology_reloads", "Topology reloads by result.", labels=["result"])
        cycles = CounterMetricFamily(_PREFIX + "probe_cycles", "Probe cycles completed (stalls when the loop does).")
        ready = GaugeMetricFamily(_PREFIX + "ready", "1 when /readyz answers 200.")
        problems = GaugeMetricFamily(_PREFIX + "problems", "What the proxy does not run of the sidecar's decisions "
                                     "now (updates refused, writes failing; listed in /state): not a readiness "
                                     "failure, alerted on.")
        write_failures = CounterMetricFamily(_PREFIX + "write_failures", "xDS file writes that failed (read-only "
                                             "or full disk...), by pool or tree.", labels=["target"])
        external = CounterMetricFamily(_PREFIX + "external_changes", "Files the sidecar wrote that someone else "
                                       "replaced (restored), by pool or file.", labels=["file"])
        stale = GaugeMetricFamily(_PREFIX + "topology_stale", "1 while the running configuration is older than "
                                  "the topology file (its last reload was invalid or needed API keys).")
        limit = GaugeMetricFamily(_PREFIX + "inflight_limit", "Requests in flight to the pool before this Envoy "
                                  "answers 429 (circuit-breaker override Envoy confirmed): the safety cap "
                                  "unless the pool is saturated.", labels=["pool"])
        saturated = GaugeMetricFamily(_PREFIX + "pool_saturated", "1 while the pool is saturated "
                                      "(sidecar.decide.saturation: the pool's standing queue per slot, per-worker "
                                      "queue, trend and KV use, or this Envoy's in-flight past the batch; fresh "
                                      "metrics only).", labels=["pool"])
        shedding = GaugeMetricFamily(_PREFIX + "pool_shedding", "1 while this Envoy's limit for the pool follows "
                                     "the shedding controller (saturated, or releasing), 0 at the safety cap.",
                                     labels=["pool"])
        signal = GaugeMetricFamily(_PREFIX + "pool_queue_per_slot", "The detector's signal: the pool's waiting "
                                   "requests per declared slot over the workers with fresh metrics (saturated at "
                                   ">= 1.0 for 2 s or >= 2.5 at once by default).", labels=["pool"])
        past = GaugeMetricFamily(_PREFIX + "pool_inflight_past_batch", "The in-flight watch's signal (Envoy target): "
                                 "this Envoy's requests in flight x ingresses / the batch the engines can run - 1 "
                                 "(saturated at >= 1.0 for 2.5 s or >= 2.5 at once by default).", labels=["pool"])
        shed = CounterMetricFamily(_PREFIX + "shed_requests", "Requests this Envoy answered 429 for the pool, as "
                                   "seen in its overflow counter: reason saturated (the controller's limit; class "
                                   "standard: Envoy's DEFAULT priority, standard traffic and the sheddable requests "
                                   "the shed share let through) or cap (the render's safety cap; class any); and "
                                   "reason share, class sheddable: sheddable requests refused at once by the pool's "
                                   "shed share (Envoy's per-pool local_ratelimit.shed counter; file mode only); "
                                   "reason picker, by class: requests the endpoint picker refused at once, their "
                                   "predicted delay past their class's budget.",
                                   labels=["pool", "reason", "class"])
        share = GaugeMetricFamily(_PREFIX + "sheddable_refused_ratio", "Share of the pool's sheddable requests this "
                                  "Envoy answers 429 at once (confirmed in Envoy), before its circuit breaker; "
                                  "only for pools with sheddable traffic.", labels=["pool"])
        engine_labels = ["pool", "model", "worker", "address"]
        ttft = HistogramMetricFamily(_PREFIX + "engine_time_to_first_token_seconds", "The engine's own time to "
                                     "first token histogram, as last scraped (DP engines summed): per pool, its "
                                     "model and endpoint; every proxy replica reports it, dedupe with max by.",
                                     labels=engine_labels)
        tpot = HistogramMetricFamily(_PREFIX + "engine_time_per_output_token_seconds", "The engine's time per "
                                     "output token (inter-token latency; TGI: per-request mean) histogram, as "
                                     "last scraped.", labels=engine_labels)
        output_tokens = CounterMetricFamily(_PREFIX + "engine_output_tokens", "Tokens the engine generated, as "
                                            "last scraped (tokens/s: rate).", labels=engine_labels)
        for pool in snap.pools:
            for ep in pool.endpoints:
                if ep.sample is None:
                    continue
                labels = [pool.name, pool.model, ep.key.worker, f"{ep.key.address}:{ep.key.port}"]
                for family, kept in ((ttft, ep.sample.ttft), (tpot, ep.sample.tpot)):
                    if kept is not None:
                        family.add_metric(labels, [(_le(b), n) for b, n in kept.buckets], kept.total)
                if ep.sample.output_tokens is not None:
                    output_tokens.add_metric(labels, ep.sample.output_tokens)
        for pool in snap.pools:
            saturated.add_metric([pool.name], 1.0 if pool.saturated else 0.0)
            shedding.add_metric([pool.name], 1.0 if pool.shedding else 0.0)
            if pool.queue_per_slot is not None:
                signal.add_metric([pool.name], pool.queue_per_slot)
            if pool.inflight_past_batch is not None:
                past.add_metric([pool.name], pool.inflight_past_batch)
            for reason, traffic in (("saturated", "standard"), ("cap", "any")):
                shed.add_metric([pool.name, reason, traffic], pool.shed.get(reason, 0))
            if pool.sheddable_share is not None:
                shed.add_metric([pool.name, "share", "sheddable"], pool.shed.get("share", 0))
                share.add_metric([pool.name], pool.sheddable_share / 100)
            for (service, where, traffic), n in sorted(snap.refused.items()):
                if where == pool.name:
                    shed.add_metric([pool.name, service, traffic], n)
            saturation.add_metric([pool.name], pool.saturation)
            publishes.add_metric([pool.name], pool.publishes)
            rejected.add_metric([pool.name], pool.rejections)
            if pool.inflight_limit is not None:
                limit.add_metric([pool.name], pool.inflight_limit)
            if pool.probe_durations is not None:
                hist = pool.probe_durations
                durations.add_metric([pool.name], [(_le(b), float(n)) for b, n in hist.buckets], hist.total)
            per_worker: dict[str, float] = {}
            for ep in pool.endpoints:
                labels = [pool.name, ep.key.worker, f"{ep.key.address}:{ep.key.port}"]
                for state in Status:
                    health.add_metric([*labels, state.value.lower()], 1.0 if ep.status == state.value else 0.0)
                serving.add_metric(labels, 1.0 if ep.serving else 0.0)
                failing.add_metric(labels, 1.0 if ep.failing else 0.0)
                if ep.sample is not None:
                    running.add_metric(labels, ep.sample.running)
                    waiting.add_metric(labels, ep.sample.waiting)
                    per_worker[ep.key.worker] = per_worker.get(ep.key.worker, 0.0) + ep.sample.waiting
                    if ep.sample.kv_usage is not None:
                        kv.add_metric(labels, ep.sample.kv_usage)
                if ep.weight is not None:
                    weight.add_metric(labels, ep.weight)
                for kind, count in sorted(ep.errors.items()):
                    errors.add_metric([*labels, kind], count)
            for worker, depth in sorted(per_worker.items()):
                queue.add_metric([pool.name, worker], depth)
        for result in ("ok", "error", "needs_keys"):
            reloads.add_metric([result], snap.reloads.get(result, 0))
        stale.add_metric([], 0.0 if snap.last_reload_error is None else 1.0)
        for target, count in sorted({"tree": 0, **snap.write_failures}.items()):
            write_failures.add_metric([target], count)
        for name, count in sorted(snap.external_changes.items()):
            external.add_metric([name], count)
        cycles.add_metric([], snap.cycles)
        ready.add_metric([], 0.0 if snap.not_ready else 1.0)
        problems.add_metric([], float(len(snap.problems)))
        yield from (build, queue, saturation, health, serving, failing, running, waiting, kv, weight, durations,
                    errors, publishes, rejected, reloads, cycles, ready, problems, stale, write_failures, external,
                    limit, saturated, ttft, tpot, output_tokens, shedding, signal, past, shed, share)

class _WithoutCreated(Collector):
    """`registry`'s families with their `<name>_created` samples left out."""

    def __init__(self, registry: Collector) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            if not any(s.name == created for s in family.samples):
                yield family
                continue
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [s for s in family.samples if s.name != created]
            yield copy


def without_created(registry: Collector) -> Collector:
    """What to expose of `registry`: every family without the `_created` series prometheus_client
    writes for each Counter and Histogram child (one extra series per labelled child, a
    timestamp no dashboard or alert reads). Per registry, unlike prometheus_client's
    process-wide `disable_created_metrics()`; the collectors built from snapshots write none."""
    return _WithoutCreated(registry)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def register(registry: CollectorRegistry, snapshot: Callable[[], Snapshot]) -> SidecarCollector:
    collector = SidecarCollector(snapshot)
    registry.register(collector)
    return collector
