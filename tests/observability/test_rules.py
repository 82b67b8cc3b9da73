"""The shipped alert rules and dashboard, checked by Debian's promtool (never skipped)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from confgen.deploy._observability import alert_rules, dashboard
from sidecar.outputs.picker.admission import Pressure
from sidecar.outputs.picker.metrics import PickerMetrics
from sidecar.outputs.ratelimit.service import METRIC_NAMES as RATELIMIT_METRICS
from sidecar.serve.metrics import METRIC_NAMES
from tests.observability.promtools import tool

HERE = Path(__file__).resolve().parent
RULES = HERE.parents[1] / "confgen" / "deploy" / "assets" / "alerts.yaml"
ALERTS = {"ConfgenPickerFallingBack", "ConfgenPickerBehind", "ConfgenPickerBypassed", "ConfgenWorkerDown",
          "ConfgenPoolWithoutHealthyCapacity", "ConfgenFleetSaturated",
          "ConfgenEdsUpdateRejected", "ConfgenProbeErrors", "ConfgenSidecarStale", "ConfgenSidecarDown",
          "ConfgenSidecarAbsent", "ConfgenXdsNack", "ConfgenTopologyEditRefused", "ConfgenWriteFailures",
          "ConfgenErrorBudgetBurnFast", "ConfgenErrorBudgetBurnSlow", "ConfgenTtftBudgetBurnFast",
          "ConfgenSustainedShedding", "ConfgenRateLimitStoreDown", "ConfgenRateLimitFailingOpen",
          "ConfgenRateLimitChecksFailingOpen"}


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def picker_metric_names() -> set[str]:
    """Every series name the endpoint picker's metrics can export, from a real scrape of them."""
    registry = CollectorRegistry()
    metrics = PickerMetrics(registry, lambda: {}, lambda: {"p": Pressure()})
    metrics.picks.labels(pool="p", reason="load").inc()
    metrics.unpicked.labels(reason="no_body").inc()
    metrics.refused.labels(pool="p", **{"class": "standard"}).inc()
    metrics.observe_finish("p", 1.0, 1.1)
    metrics.budget_checks.labels(code="ok").inc()
    metrics.held.labels(pool="p", outcome="slot").inc()
    names = {f.name for f in registry.collect() if f.type in ("gauge", "unknown")}  # gauges: family = series name
    text = generate_latest(registry).decode()
    return names | {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


def grafana_free(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced by plain PromQL."""
    return expr.replace("$__rate_interval", "1m").replace('"$pool"', '".*"')


def test_promtool_checks_the_shipped_rules() -> None:
    """`promtool check rules` accepts the shipped rule file: every expression parses, every
    alert has a severity, a summary and a description; the documented alerts exist."""
    done = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = [r for g in alert_rules()["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_promtool_unit_tests_of_every_alert_pass() -> None:
    """`promtool test rules` runs tests/observability/alerts.test.yaml: each alert fires on the
    series it is for (two proxy replicas reporting the same workers) after its `for:`, and
    not on the near misses (one replica's view, draining, a spike, a few errors)."""
    cases = yaml.safe_load((HERE / "alerts.test.yaml").read_text())
    tested = {t["alertname"] for case in cases["tests"] for t in case.get("alert_rule_test", [])}
    assert tested == ALERTS
    done = subprocess.run([tool("promtool"), "test", "rules", "alerts.test.yaml"], capture_output=True, text=True,
                          cwd=HERE, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_has_a_stable_uid_a_datasource_variable_and_valid_queries(tmp_path: Path) -> None:
    """The Grafana dashboard: uid `confgen-fleet`, a Prometheus datasource variable every
    panel uses, the per-pool panels the runbook names, and every query valid PromQL
    (promtool checks them as recording rules) naming only metrics the sidecar exports or
    Envoy's own."""
    board = dashboard()
    assert board["uid"] == "confgen-fleet"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), sorted(ids)  # Grafana keys panels (links, edits) by id
    titles = " | ".join(p["title"] for p in panels)
    for needed in ("Healthy workers", "weight", "Queue depth", "Saturation", "429", "P50 / P99", "EDS publishes",
                   "hit ratio", "Picks per second by pool and reason", "Fallbacks", "Pick latency",
                   "Admitted and refused per second per key", "Tokens charged per second per key and unit",
                   "Floor decisions per key", "checks failed open per pool, ceiling refusals"):
        assert needed in titles, needed
    exprs = dashboard_exprs()
    group: dict[str, Any] = {"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": grafana_free(e)}
                                                           for i, e in enumerate(exprs)]}
    (tmp_path / "exprs.yaml").write_text(yaml.safe_dump({"groups": [group]}))
    done = subprocess.run([tool("promtool"), "check", "rules", str(tmp_path / "exprs.yaml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    names = (*METRIC_NAMES, *RATELIMIT_METRICS)
    ours = set(names) | {n + s for n in names for s in ("_bucket", "_count", "_sum")} | picker_metric_names()
    # metric names: label values ("confgen_ceiling", a stat prefix) are not
    words = {w for e in exprs for w in re.findall(r"\b(llm_[a-z_]+|confgen_[a-z_]+|envoy_[a-z_]+)\b",
                                                  re.sub(r'"[^"]*"', '""', e))}
    assert {w for w in words if not w.startswith("envoy_")} <= ours
    assert json.loads(json.dumps(board)) == board


def test_no_two_dashboard_panels_share_a_place_on_the_grid() -> None:
    """Every panel has its own rectangle on the dashboard's 24-column grid: two panels at one
    place are stacked by Grafana in whatever order it likes (the store panel once sat on
    "Requests per second per pool")."""
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (panel["title"], cells[(x, y)])
                cells[(x, y)] = panel["title"]
