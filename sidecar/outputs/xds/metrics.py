"""Prometheus families of the control plane, read from `AdsPublisher.view()` at scrape time.

    confgen_sidecar_xds_connected_nodes                 Envoys with an open ADS stream
    confgen_sidecar_xds_resource_version{type,version}  1 for the version served of each type
    confgen_sidecar_xds_node_in_sync{node,type}         1 while an Envoy's last accepted version is the served one
                                                        (no version label: a series per version and Envoy churned
                                                        the TSDB at every change; the versions are in /state)
    confgen_sidecar_xds_node_nacked{node,type,version}  1 while an Envoy refuses a version (it keeps its last ACK)
    confgen_sidecar_xds_nacks_total{node,type}          NACKs by Envoy and type (connected Envoys)
    confgen_sidecar_xds_responses_total{type}           responses sent over all streams
    confgen_sidecar_xds_updates_total{type}             changes of the served resources
    confgen_sidecar_xds_counted_envoys                  Envoys the in-flight limits are shared by
    confgen_sidecar_xds_refused_total{code}             streams refused (identity, bounds), by gRPC code
    confgen_sidecar_xds_logs_suppressed_total           log lines clients caused beyond their budget

Series exist only for connected Envoys (a node that left has none left behind).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sidecar.fleet import XdsView
from sidecar.outputs.xds.cache import SHORT

__all__ = ["XdsCollector", "register_xds"]

_P = "confgen_sidecar_xds_"


class XdsCollector(Collector):
    def __init__(self, view: Callable[[], XdsView]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        connected = GaugeMetricFamily(_P + "connected_nodes", "Envoys with an open ADS stream.")
        served = GaugeMetricFamily(_P + "resource_version", "1 for the version served of each type.",
                                   labels=["type", "version"])
        in_sync = GaugeMetricFamily(_P + "node_in_sync", "1 while the version an Envoy last accepted is the one "
                                    "served (0: it has not accepted the newest yet, or refused it).",
                                    labels=["node", "type"])
        nacked = GaugeMetricFamily(_P + "node_nacked", "1 while an Envoy refuses a version (it keeps its last "
                                   "accepted one).", labels=["node", "type", "version"])
        nacks = CounterMetricFamily(_P + "nacks", "NACKs by Envoy and type.", labels=["node", "type"])
        responses = CounterMetricFamily(_P + "responses", "Responses sent over all streams.", labels=["type"])
        updates = CounterMetricFamily(_P + "updates", "Changes of the served resources.", labels=["type"])
        counted = GaugeMetricFamily(_P + "counted_envoys", "Envoys the in-flight limits are shared by "
                                    "(connected, ACKed the runtime layer, capped).")
        refused = CounterMetricFamily(_P + "refused", "Streams refused (node identity, bounds), by gRPC code.",
                                      labels=["code"])
        suppressed = CounterMetricFamily(_P + "logs_suppressed", "Log lines clients caused beyond their budget.")
        counted.add_metric([], view.counted)
        for code, n in sorted(view.refused.items()):
            refused.add_metric([code], n)
        suppressed.add_metric([], view.logs_suppressed)
        connected.add_metric([], len(view.nodes))
        for kind, version in view.versions.items():
            served.add_metric([kind, version], 1.0)
            responses.add_metric([kind], view.responses.get(kind, 0))
            updates.add_metric([kind], view.updates.get(kind, 0))
        for node in view.nodes:
            for type_url, version in sorted(node.acked.items()):
                kind = SHORT.get(type_url, type_url)
                in_sync.add_metric([node.node, kind], 1.0 if view.versions.get(kind) == version else 0.0)
            for type_url, nack in sorted(node.nacked.items()):
                nacked.add_metric([node.node, SHORT.get(type_url, type_url), nack.version], 1.0)
            for type_url, count in sorted(node.nacks.items()):
                nacks.add_metric([node.node, SHORT.get(type_url, type_url)], count)
        yield from (connected, served, in_sync, nacked, nacks, responses, updates, counted, refused, suppressed)


def register_xds(registry: CollectorRegistry, view: Callable[[], XdsView]) -> XdsCollector:
    collector = XdsCollector(view)
    registry.register(collector)
    return collector
