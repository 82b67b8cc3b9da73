"""The observability kit shipped in the package: alert rules and a Grafana dashboard.

    assets/alerts.yaml      Prometheus rule groups (promtool-checked and unit-tested)
    assets/dashboard.json   Grafana dashboard, uid `confgen-fleet`, a `datasource` variable

`kubernetes_objects` wraps them for the Prometheus Operator and Grafana's dashboard sidecar:
a ServiceMonitor (the sidecar's /metrics and Envoy's stats relayed at /envoy/stats), a
PrometheusRule and a ConfigMap labelled `grafana_dashboard: "1"`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import yaml

__all__ = ["alert_rules", "dashboard", "dashboard_text", "kubernetes_objects"]

Obj = dict[str, Any]


def _asset(name: str) -> str:
    return resources.files("confgen.deploy").joinpath("assets", name).read_text(encoding="utf-8")


def alert_rules() -> Obj:
    """The rule file's content: {"groups": [...]}."""
    data: Obj = yaml.safe_load(_asset("alerts.yaml"))
    return data


def dashboard_text() -> str:
    return _asset("dashboard.json")


def dashboard() -> Obj:
    data: Obj = json.loads(dashboard_text())
    return data


def kubernetes_objects(meta: Callable[[str, str], Obj], base: str, selector: dict[str, str],
                       labels: dict[str, str] | None = None, *, relay: bool = True) -> list[Obj]:
    """ServiceMonitor (of the Service `selector` picks), PrometheusRule and the dashboard
    ConfigMap for one proxy Deployment; `labels` (kubernetes.monitoring_labels) go on all three,
    after confgen's own, so the Prometheus and Grafana that select by label find them. `relay`: the
    sidecar serves its Envoy's stats at /envoy/stats (file mode; an ADS control plane has no Envoy)."""

    def monitoring_meta(name: str) -> Obj:
        data = meta(name, "monitoring")
        data["labels"] = {**data["labels"], **(labels or {})}
        return data

    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": monitoring_meta(base),
        "spec": {
            "selector": {"matchLabels": selector},
            # both scrapes share port, job and instance: the path as a label keeps their `up` series apart
            "endpoints": [
                {"port": "metrics", "path": path, "interval": "15s",
                 "relabelings": [{"sourceLabels": ["__metrics_path__"], "targetLabel": "metrics_path"}]}
                for path in ("/metrics", *(["/envoy/stats"] if relay else []))
            ],
        },
    }
    rules = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": monitoring_meta(f"{base}-alerts"),
        "spec": alert_rules(),
    }
    board = monitoring_meta(f"{base}-dashboard")
    board["labels"]["grafana_dashboard"] = "1"
    dash = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": board,
        "data": {"confgen-fleet.json": dashboard_text()},
    }
    return [monitor, rules, dash]
