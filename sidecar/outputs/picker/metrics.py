"""The picker's metrics (Prometheus), registered in the sidecar's registry.

    confgen_picker_picks_total{pool,reason}     reason: prefix (the best prefix holder), spill (a prefix
                                                holder was passed over for load), load (no prefix known),
                                                only (one candidate), unavailable (503 for a subset hint)
    confgen_picker_unpicked_total{reason}       left to the proxy's own balancer: not_ours (another
                                                pool), none_ready, no_body (GET), timeout (no body in
                                                time), stream_timeout (past max_stream_s, after the
                                                pick), body_too_large (over the body cap), busy (over
                                                max_open_streams), behind (the request reached the picker
                                                late_s late, or the loop ran behind_s late: answered at once,
                                                before the proxy's 200 ms timeout)
    confgen_picker_streams_total                ext_proc streams opened (one per request)
    confgen_picker_stream_errors_total{reason}  streams ended for breaking the protocol (INVALID_ARGUMENT):
                                                order (a message out of order for the stream's mode),
                                                late_config, after_close, unknown
    confgen_picker_open_streams                 ext_proc streams open and tracked now
    confgen_picker_prefix_blocks_total{kind}    requested / matched prompt blocks at the chosen endpoint:
                                                matched/requested estimates the prefix-cache hit ratio
    confgen_picker_pick_seconds                 time to choose (parse, hash, score), histogram
    confgen_picker_refused_total{pool,class}    requests refused (429 `overloaded`): their predicted delay (queue,
                                                slower worker) past their class's budget (never critical), at
                                                once, after waiting in the lobby, or unread (late or over the
                                                stream cap, by the pool's last prediction)
    confgen_picker_predicted_seconds_total{pool} / confgen_picker_observed_seconds_total{pool}
                                                predicted and observed time from the pick to the response's
                                                end, summed over the requests whose stream ended without an
                                                error (a client that went away mid-answer is among them: the
                                                proxy's stream does not tell); their ratio (rate over rate)
                                                is the predictor's bias
    confgen_picker_prediction_ratio{pool}       observed / predicted per request, histogram (1 = exact)
    confgen_picker_in_flight{pool,endpoint}     requests in flight through the picker, per endpoint
    confgen_picker_index_blocks                 prompt block hashes held in all the indexes
    confgen_picker_learned_*{pool,endpoint}     what the predictor learned of each endpoint from its engine's
                                                counters (predict.Learner; absent until measured):
                                                _token_seconds (the recent time per output token), _batch
                                                (the running batch it was measured at),
                                                _prefill_seconds_per_token (per uncached prompt token),
                                                _output_tokens (a request generates, on average),
                                                _bounded_share (of requests that ran to their max_tokens)
    confgen_picker_pressure_seconds{pool}       the pool's best predicted start, smoothed (admission.Pressure)
    confgen_picker_admitting{pool}              1 while per-request admission is on in the pool: its pressure
                                                or a spike holds, or the daemon's saturation verdict
    confgen_picker_offered_load{pool}           requests arriving (through every picker sharing the pool,
                                                smoothed alike) over what the pool serves: 1 = full; the
                                                pressure does not close at hold_ratio or more
    confgen_picker_peer_placements_total{kind}  placements shared with the peer replicas (peers.py): sent
                                                (per peer), dropped (per peer, its queue full while its
                                                stream was down), applied (received, into an index),
                                                skipped (received, naming an endpoint this replica does not hold)
    confgen_picker_peers_connected              peer replicas this picker streams to now (of --picker-peer)
    confgen_picker_held_total{pool,outcome}     requests held in the picker (`hold`, lobby.py) while every slot
                                                was taken, by what ended the wait: slot (one freed), open
                                                (admission opened: placed or refused with the wait counted),
                                                deadline (hold_max_s: placed into an engine's queue),
                                                gone (a topology reload removed the pool: left to the
                                                proxy at once), reset (the stream ended while it waited)
    confgen_picker_held_seconds                 how long each held request waited, histogram
    confgen_picker_lobby{pool}                  requests waiting in the picker now
    confgen_picker_budget_checks_total{code}    global budgets decided in the picker's call (budgets.py): ok,
                                                over_limit (answered 429 here); a request it did not check
                                                is checked by Envoy's rate limit filter

Envoy counts what the picker cannot see (its calls that failed or timed out and fell back
to Envoy's own balancer): ext_proc's `failure_mode_allowed` statistic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .admission import Pressure
from .datastore import Endpoint
from .predict import Learner
from .scheduling import Pick

__all__ = ["PickerMetrics"]

_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
_QUEUE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)  # bypass_wait_s 5 ms, late_s 20 ms
_HELD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


# confgen_picker_learned_<name>: its help, and how it is read off the endpoint's Learner (None: not measured yet)
_LEARNED: tuple[tuple[str, str, Callable[[Learner], float | None]], ...] = (
    ("token_seconds", "The endpoint's recent time per output token, learned from its engine's counters",
     lambda lr: lr.itl),
    ("batch", "The running batch that time per token was measured at",
     lambda lr: lr.batch if lr.itl is not None else None),
    ("prefill_seconds_per_token", "The endpoint's prefill time per uncached prompt token, learned",
     lambda lr: lr.k),
    ("output_tokens", "Tokens a request generates on average at the endpoint, learned", lambda lr: lr.out),
    ("bounded_share", "The share of the endpoint's requests that ran to their max_tokens (the engine's finish "
     "reasons): how far a request's max_tokens predicts its answer", lambda lr: lr.bound),
)


class _Live(Collector):
    def __init__(self, pools: Callable[[], Mapping[str, Sequence[Endpoint]]],
                 pressure: Callable[[], Mapping[str, Pressure]] | None,
                 admitting: Callable[[str], bool] | None = None) -> None:
        self._pools = pools
        self._pressure = pressure
        self._admitting_of = admitting

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("confgen_picker_in_flight", "Requests in flight through the picker",
                                      labels=["pool", "endpoint"])
        blocks = GaugeMetricFamily("confgen_picker_index_blocks", "Prompt block hashes held in the prefix indexes")
        learned = [(GaugeMetricFamily(f"confgen_picker_learned_{name}", doc, labels=["pool", "endpoint"]), read)
                   for name, doc, read in _LEARNED]
        total = 0
        for pool, endpoints in self._pools().items():
            for e in endpoints:
                in_flight.add_metric([pool, e.address], e.in_flight)
                total += len(e.index)
                for family, read in learned:
                    value = read(e.learner)
                    if value is not None:
                        family.add_metric([pool, e.address], value)
        blocks.add_metric([], total)
        yield in_flight
        yield blocks
        yield from (family for family, _ in learned)
        if self._pressure is not None:
            level = GaugeMetricFamily("confgen_picker_pressure_seconds", "The pool's best predicted start, "
                                      "smoothed over the picker's pressure_s", labels=["pool"])
            held = GaugeMetricFamily("confgen_picker_admitting", "1 while per-request admission is on in the "
                                     "pool (its pressure or a spike, or the saturation verdict)", labels=["pool"])
            offered = GaugeMetricFamily("confgen_picker_offered_load", "Requests arriving at the pool (through "
                                        "every picker sharing it, smoothed over pressure_s) over what it serves: "
                                        "1 = full", labels=["pool"])
            for pool, p in sorted(self._pressure().items()):
                level.add_metric([pool], p.level_s)
                on = self._admitting_of(pool) if self._admitting_of is not None else p.held
                held.add_metric([pool], 1.0 if on else 0.0)
                offered.add_metric([pool], p.offered)
            yield level
            yield held
            yield offered


class PickerMetrics:
    def __init__(self, registry: CollectorRegistry | None,
                 pools: Callable[[], Mapping[str, Sequence[Endpoint]]] | None = None,
                 pressure: Callable[[], Mapping[str, Pressure]] | None = None,
                 admitting: Callable[[str], bool] | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.picks = Counter("confgen_picker_picks", "Picks by reason", ["pool", "reason"], registry=reg)
        self.unpicked = Counter("confgen_picker_unpicked", "Requests answered without a pick, by reason: left to "
                                "the proxy's own balancer (behind and busy: or refused by admission, then in "
                                "confgen_picker_refused too)", ["reason"], registry=reg)
        self.streams = Counter("confgen_picker_streams", "ext_proc streams opened", registry=reg)
        self.blocks = Counter("confgen_picker_prefix_blocks", "Prompt blocks requested / matched at the chosen "
                              "endpoint", ["kind"], registry=reg)
        self.stream_errors = Counter("confgen_picker_stream_errors", "ext_proc streams ended for breaking the "
                                     "protocol", ["reason"], registry=reg)
        self.open_streams = Gauge("confgen_picker_open_streams", "ext_proc streams open and tracked", registry=reg)
        self.bypass = Gauge("confgen_picker_bypass_percent", "Percent of requests Envoy sends past the picker "
                            "(it could not keep up), as the Envoys hold it", registry=reg)
        self.latency = Histogram("confgen_picker_pick_seconds", "Time to choose an endpoint", buckets=_BUCKETS,
                                 registry=reg)
        self.queued = Histogram("confgen_picker_queue_seconds", "How late each request's headers reached the "
                                "picker: its age from Envoy's request.time past the floor of recent ages (the "
                                "picker's own queue, in Envoy, the transport and the process)", buckets=_QUEUE_BUCKETS,
                                registry=reg)
        self.refused = Counter("confgen_picker_refused", "Requests refused (429 overloaded): predicted delay past "
                               "their class's budget, at once, after the lobby, or unread (late, busy)",
                               ["pool", "class"], registry=reg)
        self.predicted = Counter("confgen_picker_predicted_seconds", "Predicted seconds from pick to response end, "
                                 "requests whose stream ended without an error (clients that went away "
                                 "included: the proxy's stream does not tell)", ["pool"], registry=reg)
        self.observed = Counter("confgen_picker_observed_seconds", "Observed seconds from pick to response end, "
                                "the same requests", ["pool"], registry=reg)
        self.ratio = Histogram("confgen_picker_prediction_ratio", "Observed / predicted time per request",
                               ["pool"], buckets=_RATIO_BUCKETS, registry=reg)
        self.peer_placements = Counter("confgen_picker_peer_placements", "Placements shared with the picker's "
                                       "peer replicas: sent, dropped, applied, skipped", ["kind"], registry=reg)
        self.peers_connected = Gauge("confgen_picker_peers_connected", "Peer replicas this picker streams to",
                                     registry=reg)
        self.budget_checks = Counter("confgen_picker_budget_checks", "Global budgets decided in the picker's "
                                     "call, by answer", ["code"], registry=reg)
        self.held = Counter("confgen_picker_held", "Requests held in the picker while every slot was taken, by "
                            "what ended the wait: slot, open (admission opened), deadline, gone (pool removed), reset",
                            ["pool", "outcome"],
                            registry=reg)
        self.held_seconds = Histogram("confgen_picker_held_seconds", "How long each held request waited in the "
                                      "picker", buckets=_HELD_BUCKETS, registry=reg)
        self.lobby = Gauge("confgen_picker_lobby", "Requests waiting in the picker now", ["pool"], registry=reg)
        self._requested = self.blocks.labels(kind="requested")
        self._matched = self.blocks.labels(kind="matched")
        if pools is not None:
            reg.register(_Live(pools, pressure, admitting))

    def observe_pick(self, pool: str, pick: Pick, seconds: float) -> None:
        self.picks.labels(pool=pool, reason=pick.reason).inc()
        self._requested.inc(pick.prompt_blocks)
        self._matched.inc(pick.matched_blocks)
        self.latency.observe(seconds)

    def refusals(self) -> dict[tuple[str, str], int]:
        """What `refused` counted so far, by (pool, class)."""
        return {(s.labels["pool"], s.labels["class"]): int(s.value)
                for family in self.refused.collect() for s in family.samples if s.name.endswith("_total")}

    def observe_peer_batch(self, applied: int, skipped: int) -> None:
        self.peer_placements.labels(kind="applied").inc(applied)
        if skipped:
            self.peer_placements.labels(kind="skipped").inc(skipped)

    def observe_finish(self, pool: str, predicted_s: float, observed_s: float) -> None:
        self.predicted.labels(pool=pool).inc(predicted_s)
        self.observed.labels(pool=pool).inc(observed_s)
        if predicted_s > 0:
            self.ratio.labels(pool=pool).observe(observed_s / predicted_s)
