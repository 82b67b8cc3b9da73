"""Deployment targets: Kubernetes manifests and Docker Compose from the same topology."""

from __future__ import annotations

import copy
import dataclasses
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from confgen import load_topology, parse_topology
from confgen.deploy import render_compose, render_kubernetes, topology_yaml
from confgen.deploy.kubernetes import dns_label
from confgen.errors import DeployError
from confgen.model import Topology
from sidecar.config import from_argv, listen_mismatch
from tests.deploy.pss import violations
from tests.deploy.test_kustomize import ADS
from tests.support.envoy import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
DNS_1123_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CORE_KINDS = {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


def monitored(topo: Topology) -> Topology:
    return dataclasses.replace(topo, kubernetes=dataclasses.replace(topo.kubernetes, monitoring=True))


def docs_of(files: dict[str, bytes], name: str = "kubernetes.yaml") -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(files[name]) if d is not None]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    return pod


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_canonical_topology_round_trips(example: Path) -> None:
    """The topology a ConfigMap carries reloads to exactly the model it was written from."""
    topo, _ = load_topology(example)
    again, _ = parse_topology(topology_yaml(topo).encode(), "canonical.yaml")
    assert again == topo


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_kubernetes_manifests_pass_schemas_and_pod_security_restricted(example: Path) -> None:
    """Every core object of every example (monitoring on) validates strictly (no unknown
    field) against the Kubernetes 1.30 schemas, every name is a valid DNS-1123 name, and
    the pod meets Pod Security "restricted" on every container (init included)."""
    topo, _ = load_topology(example)
    files = render_kubernetes(monitored(topo))
    docs = docs_of(files)
    if "autoscaling/prometheus-adapter-rules.yaml" in files:
        docs += docs_of(files, "autoscaling/prometheus-adapter-rules.yaml")
    for doc in docs:
        name = doc["metadata"]["name"]
        assert DNS_1123_SUBDOMAIN.fullmatch(name) and len(name) <= 253, name
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
    assert DNS_1123_LABEL.fullmatch(by_kind(docs, "Service")[0]["metadata"]["name"])
    assert [d["kind"] for d in docs][:5] == ["ConfigMap", "Deployment", "Service", "Service", "PodDisruptionBudget"]
    assert {"ServiceMonitor", "PrometheusRule"} <= {d["kind"] for d in docs}
    pod = pod_of(docs)
    assert violations(pod) == []
    assert [c["name"] for c in pod["containers"]] == ["envoy", "sidecar"]
    assert pod["initContainers"][0]["command"][:2] == ["confgen", "render"]


def test_pod_security_check_catches_each_restricted_rule() -> None:
    """The restricted check is not vacuous: removing each hardening setting from a rendered
    pod is reported, naming the container and the rule."""
    topo, _ = load_topology(EXAMPLES[1])
    pod = pod_of(docs_of(render_kubernetes(topo)))
    breaks = {
        "allowPrivilegeEscalation": lambda c: c["securityContext"].pop("allowPrivilegeEscalation"),
        "capabilities.drop": lambda c: c["securityContext"]["capabilities"].update(drop=[]),
        "capabilities.add": lambda c: c["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
        "seccompProfile": lambda c: c["securityContext"]["seccompProfile"].update(type="Unconfined"),
        "runAsNonRoot": lambda c: c["securityContext"].update(runAsNonRoot=False),
        "privileged": lambda c: c["securityContext"].update(privileged=True),
        "hostPort": lambda c: c.setdefault("ports", [{}])[0].update(hostPort=80),
    }
    for rule, mutate in breaks.items():
        broken = copy.deepcopy(pod)
        mutate(broken["containers"][1])
        assert any(v.startswith("sidecar:") and rule.split(".")[0] in v for v in violations(broken)), rule
    broken = copy.deepcopy(pod)
    broken["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert any("hostPath" in v for v in violations(broken))


def test_every_container_has_resources_probes_and_a_drain_on_stop() -> None:
    """Requests and limits on every container; Envoy ready on its own /ready (relayed by the
    sidecar), the sidecar on /readyz; preStop hooks drain Envoy within the grace period:
    the sidecar's hook fails Envoy's health, drains and waits (deadline below the grace
    period), Envoy's hook waits for the sidecar's marker; a PDB keeps one pod at a time."""
    topo, _ = load_topology(EXAMPLES[4])
    docs = docs_of(render_kubernetes(topo))
    pod = pod_of(docs)
    for c in [*pod["initContainers"], *pod["containers"]]:
        assert set(c["resources"]) == {"requests", "limits"}, c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
    envoy, sidecar = pod["containers"]
    # by number: the kubelet resolves a probe's port name in the probed container's ports only, and
    # `metrics` is the sidecar container's (a name here left Envoy never Ready)
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/envoy/ready", "port": topo.sidecar.port}
    assert {p["name"] for p in envoy["ports"]}.isdisjoint({"metrics"})
    for c in pod["containers"]:  # every named probe port is the probed container's own
        names = {p["name"] for p in c.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe"):
            port = next(iter(c.get(probe, {}).values()), {}).get("port") if probe in c else None
            assert not isinstance(port, str) or port in names, (c["name"], probe, port)
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    grace = pod["terminationGracePeriodSeconds"]
    assert grace == topo.kubernetes.termination_grace_seconds
    drain = sidecar["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[:3] == ["python", "-m", "sidecar.drain"]
    assert float(drain[drain.index("--deadline") + 1]) < grace
    marker = drain[drain.index("--marker") + 1]
    wait = envoy["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[:2] == ["/bin/sh", "-c"] and marker in wait[2]
    assert int(re.search(r"-lt (\d+)", wait[2]).group(1)) < grace  # type: ignore[union-attr]
    public, metrics = by_kind(docs, "Service")
    pdb = by_kind(docs, "PodDisruptionBudget")[0]["spec"]
    assert pdb == {"maxUnavailable": 1, "selector": {"matchLabels": public["spec"]["selector"]}}
    template = by_kind(docs, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert public["spec"]["selector"].items() <= template.items()  # the proxy pods: the budget's and clients'
    assert public["spec"]["selector"]["app.kubernetes.io/component"] == "proxy"
    assert "metrics" not in [p["name"] for p in public["spec"]["ports"]]  # clients never reach the sidecar
    assert metrics["spec"] == {"clusterIP": "None", "selector": public["spec"]["selector"],
                               "ports": [{"name": "metrics", "port": 9109, "targetPort": "metrics"}]}
    assert "livenessProbe" in envoy and envoy["livenessProbe"]["exec"]["command"][0] == "/bin/bash"
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} == {"topology.kubernetes.io/zone",
                                                                            "kubernetes.io/hostname"}
    assert all(c["labelSelector"]["matchLabels"] == public["spec"]["selector"] and
               c["whenUnsatisfiable"] == "ScheduleAnyway" for c in pod["topologySpreadConstraints"])
    labels = by_kind(docs, "Deployment")[0]["metadata"]["labels"]
    assert {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
            "app.kubernetes.io/part-of", "app.kubernetes.io/version", "app.kubernetes.io/managed-by"} <= set(labels)


def test_hpa_adapter_rule_and_keda_overlay_share_one_deduplicated_queue_signal() -> None:
    """A pool with autoscale gets an HPA on llm_queue_depth{pool} at 80 % of the tolerated
    queue per worker (20 % headroom: 4 -> 3.2); the prometheus-adapter rule serving it takes
    each worker once (max by pool, worker) before summing, so N proxy replicas count a
    worker once; the KEDA overlay replaces the HPAs with ScaledObjects on the same query."""
    topo, _ = load_topology(EXAMPLES[4])
    files = render_kubernetes(topo)
    hpas = by_kind(docs_of(files), "HorizontalPodAutoscaler")
    assert len(hpas) == 1
    spec = hpas[0]["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "vllm-70b"}
    metric = spec["metrics"][0]["external"]
    assert metric["metric"] == {"name": "llm_queue_depth", "selector": {"matchLabels": {"pool": "llama-70b"}}}
    assert metric["target"] == {"type": "AverageValue", "averageValue": "3200m"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (3, 12)
    adapter = docs_of(files, "autoscaling/prometheus-adapter-rules.yaml")[0]
    rule = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"][0]
    assert rule["name"]["as"] == "llm_queue_depth"
    assert rule["metricsQuery"] == "sum by (pool) (max by (pool, worker) (<<.Series>>{<<.LabelMatchers>>}))"
    scaled = docs_of(files, "keda/scaledobjects.yaml")
    assert [s["kind"] for s in scaled] == ["ScaledObject"]
    trigger = scaled[0]["spec"]["triggers"][0]
    # the namespace's series only (the adapter's <<.LabelMatchers>> carry it for the HPA): a same-named pool of
    # another namespace must not scale this one
    assert trigger["metadata"]["query"] == ('sum by (pool) (max by (pool, worker) '
                                            '(llm_queue_depth{pool="llama-70b",namespace="inference"}))')
    assert trigger["metadata"]["threshold"] == "3.2" and trigger["metricType"] == "AverageValue"
    # the HPA KEDA makes moves like the base's (KEDA's default scales down 100 % every 15 s)
    assert scaled[0]["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == spec["behavior"]
    assert "cooldownPeriod" not in scaled[0]["spec"]  # it acts only to and from zero replicas
    assert scaled[0]["spec"]["scaleTargetRef"]["name"] == "vllm-70b"
    overlay = yaml.safe_load(files["keda/kustomization.yaml"])
    assert overlay["resources"] == ["kubernetes.yaml", "scaledobjects.yaml"]
    kept = docs_of(files, "keda/kubernetes.yaml")
    assert hpas[0] not in kept and [d for d in docs_of(files) if d != hpas[0]] == kept
    assert yaml.safe_load(files["kustomization.yaml"])["resources"] == ["kubernetes.yaml"]


def test_keys_come_from_a_secret_env_or_mounted_file_and_render_needs_none(tmp_path: Path) -> None:
    """API keys reach the pod only through the Secret: env keys as secretKeyRef (never a
    value) in the render step and the sidecar, file keys mounted at the topology's path
    (the Secret entry named like the file); `confgen render --target kubernetes` works with
    no key in its environment."""
    topo, _ = load_topology(EXAMPLES[4])
    pod = pod_of(docs_of(render_kubernetes(topo)))
    for c in (pod["initContainers"][0], pod["containers"][1]):
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
        assert refs["CONFGEN_KEY_TEAM_SEARCH"] == {"name": "confgen-api-keys", "key": "CONFGEN_KEY_TEAM_SEARCH"}
        assert all("value" not in e for e in c["env"])
    topo4, _ = load_topology(EXAMPLES[3])
    pod4 = pod_of(docs_of(render_kubernetes(topo4)))
    mount = [m for m in pod4["initContainers"][0]["volumeMounts"] if m["name"] == "api-keys"]
    assert mount == [{"name": "api-keys", "mountPath": "/run/secrets/batch-jobs-key", "subPath": "batch-jobs-key",
                      "readOnly": True}]
    secret = next(v for v in pod4["volumes"] if v["name"] == "api-keys")["secret"]
    assert secret["secretName"] == "confgen-multi-model-api-keys"
    env = {"PATH": "/usr/bin:/bin"}  # no CONFGEN_KEY_* at all
    done = subprocess.run([sys.executable, "-m", "confgen", "render", str(EXAMPLES[4]), "-o", str(tmp_path / "k"),
                           "--target", "kubernetes"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "k" / "kubernetes.yaml").is_file()


def test_names_with_underscores_map_to_valid_names_and_collisions_are_refused(tmp_path: Path) -> None:
    """A topology or listener name with '_' gives DNS-1123 object and port names; two pools
    scaling the same workload would give two HPAs one name: refused with file:line:col."""
    text = """\
version: 1
name: my_fleet_with_a_rather_long_name_that_goes_past_the_limit_of_63
listeners: [{name: public_api, port: 8080}]
pools:
  - name: chat_a
    engine: vllm
    models: [m1]
    workers: ["10.0.0.1:8000"]
    autoscale: {target: deployment/vllm-a}
  - name: chat_b
    engine: vllm
    models: [m2]
    workers: ["10.0.0.2:8000"]
    autoscale: {target: deployment/vllm-a}
"""
    topo, _ = parse_topology(text.encode(), "t.yaml")
    with pytest.raises(DeployError) as err:
        render_kubernetes(topo)
    assert "HorizontalPodAutoscaler" in str(err.value)
    fine = text.replace("deployment/vllm-a}\n  - name: chat_b", "deployment/vllm-x}\n  - name: chat_b")
    topo, _ = parse_topology(fine.encode(), "t.yaml")
    docs = docs_of(render_kubernetes(topo))
    for doc in docs:
        assert DNS_1123_SUBDOMAIN.fullmatch(doc["metadata"]["name"]), doc["metadata"]["name"]
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    service = by_kind(docs, "Service")[0]
    assert len(service["metadata"]["name"]) <= 63 and DNS_1123_LABEL.fullmatch(service["metadata"]["name"])
    assert dns_label("a_b") == "a-b" and dns_label("9x") == "x-9x"
    assert dns_label("y" * 80) != dns_label("y" * 81) and len(dns_label("y" * 80)) == 63
    path = tmp_path / "t.yaml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "confgen", "render", str(path), "-o", str(tmp_path / "k"),
                           "--target", "kubernetes"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert re.search(rf"{re.escape(str(path))}:\d+:\d+: pools: .*HorizontalPodAutoscaler", done.stderr), done.stderr
    assert not (tmp_path / "k").exists()


def test_a_listener_named_as_one_of_confgens_ports_gets_another_port_name() -> None:
    """Found by review: a listener named grpc gave Envoy's container a port named grpc beside the sidecar's,
    and the pickers' Service (targetPort: grpc) reached Envoy's listener. Every port name in a pod is its own."""
    text = """\
version: 1
name: ports
listeners: [{name: grpc, port: 8080}, {name: metrics, port: 8081}, {name: xds, port: 8082}]
sidecar: {grpc_tls: {cert: /etc/tls/tls.crt, key: /etc/tls/tls.key, ca: /etc/tls/ca.crt}}
pools:
  - name: chat
    engine: vllm
    models: [m1]
    balancing: {policy: prefix_affinity}
    workers: ["10.0.0.1:8000"]
"""
    topo, _ = parse_topology(text.encode(), "t.yaml")
    for doc in docs_of(render_kubernetes(topo)):
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod:
            names = [p["name"] for c in pod["containers"] for p in c.get("ports", [])]
            assert len(names) == len(set(names)), names
            envoy = next(c for c in pod["containers"] if c["name"] == "envoy")
            assert not {p["name"] for p in envoy.get("ports", [])} & {"grpc", "metrics", "xds", "redis"}


def test_monitoring_objects_carry_the_shipped_rules_and_dashboard() -> None:
    """With kubernetes.monitoring the render adds a ServiceMonitor scraping the sidecar's
    /metrics and Envoy's relayed /envoy/stats on the metrics Service (selected by its labels,
    not the clients' Service), a PrometheusRule with the shipped rule groups and the dashboard
    ConfigMap for Grafana's sidecar; kubernetes.monitoring_labels go on all three."""
    from confgen.deploy._observability import alert_rules, dashboard_text

    topo, _ = load_topology(EXAMPLES[1])
    assert not by_kind(docs_of(render_kubernetes(topo)), "ServiceMonitor")
    docs = docs_of(render_kubernetes(monitored(topo)))
    monitor = by_kind(docs, "ServiceMonitor")[0]["spec"]
    assert [(e["port"], e["path"]) for e in monitor["endpoints"]] == [("metrics", "/metrics"),
                                                                       ("metrics", "/envoy/stats")]
    # the two scrapes share port, job and instance: the path labels their `up` series apart (the sidecar-down
    # alert counts /metrics only)
    for endpoint in monitor["endpoints"]:
        assert endpoint["relabelings"] == [{"sourceLabels": ["__metrics_path__"], "targetLabel": "metrics_path"}]
    # an ADS control plane relays no Envoy's stats: its /envoy/stats would be a 404, `up` 0 for good
    ads, _ = parse_topology(ADS.encode(), "t.yaml")
    ads_monitor = by_kind(docs_of(render_kubernetes(ads)), "ServiceMonitor")[0]["spec"]
    assert [e["path"] for e in ads_monitor["endpoints"]] == ["/metrics"]
    public, metrics = by_kind(docs, "Service")
    assert monitor["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    assert not monitor["selector"]["matchLabels"].items() <= public["metadata"]["labels"].items()
    assert by_kind(docs, "PrometheusRule")[0]["spec"] == alert_rules()
    labelled = dataclasses.replace(topo, kubernetes=dataclasses.replace(
        topo.kubernetes, monitoring=True, monitoring_labels={"release": "kube-prometheus-stack"}))
    objects = [d for d in docs_of(render_kubernetes(labelled)) if d["metadata"]["labels"].get(
        "release") == "kube-prometheus-stack"]
    assert sorted(d["kind"] for d in objects) == ["ConfigMap", "PrometheusRule", "ServiceMonitor"]
    board = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert board[0]["data"]["confgen-fleet.json"] == dashboard_text()


def test_compose_runs_render_then_envoy_and_sidecar() -> None:
    """The compose file renders once, then runs Envoy and the sidecar on the shared volume,
    next to a copy of the canonical topology; it has no YAML anchors to trip up tools; with
    host networking the sidecar binds loopback only (Prometheus on the host reaches it)."""
    topo, _ = load_topology(EXAMPLES[3])
    files = render_compose(topo)
    text = files["compose.yaml"].decode()
    assert "&id" not in text and "*id" not in text
    services = yaml.safe_load(text)["services"]
    assert set(services) == {"render", "sidecar", "envoy"}
    assert services["envoy"]["depends_on"]["render"]["condition"] == "service_completed_successfully"
    command = services["sidecar"]["command"]
    assert command[command.index("--listen") + 1] == "127.0.0.1:9109"
    assert parse_topology(files["topology.yaml"], "t.yaml")[0] == topo


def test_a_listener_below_1024_gets_only_net_bind_service_and_stays_restricted() -> None:
    """Envoy binding port 80 as a non-root user needs NET_BIND_SERVICE, the one capability
    Pod Security "restricted" allows; it is added to Envoy alone and only then."""
    text = """\
version: 1
name: edge
listeners: [{name: http, port: 80}]
pools: [{name: chat, engine: vllm, models: [m], workers: ["10.0.0.1:8000"]}]
"""
    topo, _ = parse_topology(text.encode(), "t.yaml")
    pod = pod_of(docs_of(render_kubernetes(topo)))
    caps = {c["name"]: c["securityContext"]["capabilities"] for c in [*pod["initContainers"], *pod["containers"]]}
    assert caps == {"render": {"drop": ["ALL"]}, "envoy": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                    "sidecar": {"drop": ["ALL"]}}
    assert violations(pod) == []
    topo, _ = load_topology(EXAMPLES[1])
    assert "add" not in pod_of(docs_of(render_kubernetes(topo)))["containers"][0]["securityContext"]["capabilities"]


def test_the_sidecars_mutating_endpoints_get_a_token_from_a_secret_when_asked() -> None:
    """Bound on the pod's address the sidecar's POST /drain and /undrain are off unless it has
    a token: with kubernetes.admin_token_secret it reads one from that Secret's `token` entry
    (never a value in the manifest); without, no token flag at all."""
    topo, _ = load_topology(EXAMPLES[1])
    sidecar = pod_of(docs_of(render_kubernetes(topo)))["containers"][1]
    assert "--admin-token-env" not in sidecar["args"]
    asked = dataclasses.replace(topo, kubernetes=dataclasses.replace(topo.kubernetes, admin_token_secret="drain-token"))
    pod = pod_of(docs_of(render_kubernetes(asked)))
    sidecar = pod["containers"][1]
    name = sidecar["args"][sidecar["args"].index("--admin-token-env") + 1]
    assert {"name": name, "valueFrom": {"secretKeyRef": {"name": "drain-token", "key": "token"}}} in sidecar["env"]
    assert violations(pod) == []
    config = from_argv(sidecar["args"])  # the sidecar's own parser takes the rendered flags
    assert (config.admin_token_env, config.listen_host, config.listen_port) == (name, "0.0.0.0", 9109)


def test_the_sidecar_listens_where_the_rendered_envoy_asks_it() -> None:
    """A topology's sidecar.port is where the rendered Envoy asks the sidecar for /v1/models:
    the Kubernetes and Compose renders start the sidecar on that port (it was a constant
    9109, so `sidecar: {port: 9200}` gave an Envoy asking a port nobody listened on), and the
    sidecar's own check finds no disagreement in either render."""
    topo, _ = load_topology(EXAMPLES[1])
    moved = dataclasses.replace(topo, sidecar=dataclasses.replace(topo.sidecar, port=9200))
    docs = docs_of(render_kubernetes(moved))
    sidecar = pod_of(docs)["containers"][1]
    config = from_argv(sidecar["args"])
    assert (config.listen_host, config.listen_port) == ("0.0.0.0", 9200)
    assert sidecar["ports"] == [{"name": "metrics", "containerPort": 9200}]
    assert listen_mismatch(config, moved) is None
    compose = yaml.safe_load(render_compose(moved)["compose.yaml"])
    config = from_argv(compose["services"]["sidecar"]["command"])
    assert (config.listen_host, config.listen_port) == ("127.0.0.1", 9200)
    assert listen_mismatch(config, moved) is None


GLOBAL_LIMITS = ROOT / "tests/golden/inputs/global-limits.yaml"


def _with_store(address: str, redis: bool = True) -> Topology:
    topo, _ = load_topology(GLOBAL_LIMITS)
    store = dataclasses.replace(topo.limits.store, redis=address)  # type: ignore[type-var]
    return dataclasses.replace(topo, limits=dataclasses.replace(topo.limits, store=store),
                               kubernetes=dataclasses.replace(topo.kubernetes, redis=redis))


def test_kubernetes_renders_a_redis_for_the_global_limits_when_asked() -> None:
    """kubernetes.redis: a Redis Deployment (restricted, no persistence), its Service named as
    limits.store says, and a NetworkPolicy letting only the proxy pods in; the proxy pod is
    unchanged (its sidecar serves the rate limit service on loopback)."""
    docs = docs_of(render_kubernetes(_with_store("confgen-global-limits-redis:6379")))
    redis = [d for d in docs if d["metadata"]["name"] == "confgen-global-limits-redis"]
    assert [d["kind"] for d in redis] == ["Deployment", "Service", "NetworkPolicy"]
    for doc in redis:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    pod = redis[0]["spec"]["template"]["spec"]
    assert violations(pod) == []
    assert "--save" in pod["containers"][0]["args"]
    admitted = redis[2]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert admitted["app.kubernetes.io/component"] == "proxy"
    # no version label: during a confgen upgrade's rollout the old pods, still serving, keep their Redis
    assert "app.kubernetes.io/version" not in admitted
    assert [c["name"] for c in pod_of(docs)["containers"]] == ["envoy", "sidecar"]
    without = docs_of(render_kubernetes(_with_store("redis.example:6379", redis=False)))
    assert not [d for d in without if d["metadata"]["name"].endswith("-redis")]  # an existing Redis, by address


def test_a_rendered_redis_must_be_the_store_the_topology_names() -> None:
    with pytest.raises(DeployError) as info:
        render_kubernetes(_with_store("redis.example:6379"))
    assert info.value.problems[0][0] == "limits.store.redis"
    assert "confgen-global-limits-redis:6379" in info.value.problems[0][1]
    with pytest.raises(DeployError) as info:
        render_compose(_with_store("redis.example:6379"))
    assert "write 127.0.0.1:6379" in info.value.problems[0][1]


def test_compose_runs_redis_on_the_hosts_loopback() -> None:
    doc = yaml.safe_load(render_compose(_with_store("127.0.0.1:6390"))["compose.yaml"])
    redis = doc["services"]["redis"]
    assert redis["network_mode"] == "host"
    assert redis["command"][:5] == ["redis-server", "--bind", "127.0.0.1", "--port", "6390"]


def _with_password(address: str) -> Topology:
    topo = _with_store(address)
    store = dataclasses.replace(topo.limits.store, password_env="GL_REDIS_PASSWORD")  # type: ignore[union-attr]
    return dataclasses.replace(topo, limits=dataclasses.replace(topo.limits, store=store))  # type: ignore[arg-type]


def test_the_redis_password_reaches_the_sidecars_and_the_rendered_redis() -> None:
    """limits.store.password_env: Kubernetes gives the sidecar the variable from the keys Secret's entry of
    that name and the rendered Redis the same as its requirepass (the kubelet expands $(NAME) in args);
    the init render (which needs no Redis) does not get it."""
    docs = docs_of(render_kubernetes(_with_password("confgen-global-limits-redis:6379")))
    ref = {"name": "GL_REDIS_PASSWORD",
           "valueFrom": {"secretKeyRef": {"name": "confgen-global-limits-api-keys", "key": "GL_REDIS_PASSWORD"}}}
    pod = pod_of(docs)
    assert ref in pod["containers"][1]["env"] and ref not in pod["initContainers"][0]["env"]
    redis = next(d for d in docs if d["metadata"]["name"] == "confgen-global-limits-redis")
    kubernetes_validate.validate(redis, "1.30.0", strict=True)
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert container["env"] == [ref] and container["args"][-2:] == ["--requirepass", "$(GL_REDIS_PASSWORD)"]


def test_compose_gives_its_loopback_redis_the_password(tmp_path: Path) -> None:
    """On the host's loopback every local user reaches the compose Redis: with password_env its command
    (run here as compose hands it to the container: `$$` is a literal `$`) starts the real redis-server with
    that requirepass."""
    from confgen.runtime import find_redis, free_port, stop_process

    port = free_port()
    doc = yaml.safe_load(render_compose(_with_password(f"127.0.0.1:{port}"))["compose.yaml"])
    redis, sidecar = doc["services"]["redis"], doc["services"]["sidecar"]
    assert redis["environment"] == ["GL_REDIS_PASSWORD"] and "GL_REDIS_PASSWORD" in sidecar["environment"]
    argv = [word.replace("$$", "$") for word in redis["command"]]
    argv[2] = argv[2].replace("exec redis-server", f"exec {find_redis()}", 1) + f" --dir {tmp_path}"
    proc = subprocess.Popen(argv, env={"GL_REDIS_PASSWORD": "pw-from-the-env", "PATH": "/usr/bin:/bin"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    answers: list[bytes] = []

    def asked() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                reader = sock.makefile("rb")
                answers[:] = []
                for line in (b"PING", b"AUTH pw-from-the-env", b"PING"):
                    sock.sendall(line + b"\r\n")
                    answers.append(reader.readline().split(b" ")[0].rstrip())
                return True
        except OSError:
            return False

    try:
        assert wait_until(asked, timeout=10), "the compose Redis did not start"
        assert answers == [b"-NOAUTH", b"+OK", b"+PONG"]
    finally:
        stop_process(proc)


@pytest.mark.parametrize("replicas", [1, 2, 5])
def test_each_sidecar_takes_its_envoys_share_of_the_limit_from_the_replica_count(replicas: int) -> None:
    """N proxy pods (file mode, one sidecar per Envoy) start each sidecar with `--ingresses N`, so each Envoy
    takes 1/N of the shedding budget (the render passed nothing: each took all of it, N times the batch in
    all); ADS passes no such flag, the control plane counts the Envoys connected to it."""
    topo, _ = load_topology(EXAMPLES[1])
    topo = dataclasses.replace(topo, kubernetes=dataclasses.replace(topo.kubernetes, replicas=replicas))
    docs = docs_of(render_kubernetes(topo))
    assert by_kind(docs, "Deployment")[0]["spec"]["replicas"] == replicas
    config = from_argv(pod_of(docs)["containers"][1]["args"])
    assert config.ingresses == replicas
    ads, _ = parse_topology(ADS.encode(), "ads.yaml")
    control_plane = by_kind(docs_of(render_kubernetes(ads)), "StatefulSet")[0]["spec"]["template"]["spec"]
    assert "--ingresses" not in control_plane["containers"][0]["args"]


def test_the_control_plane_replicas_pickers_are_each_others_peers() -> None:
    """ADS with a picker pool: every control-plane pod lists every replica as --picker-peer on the
    picker's port (the mTLS of --grpc-tls-*; a picker ends the link to itself), and the NetworkPolicy
    admits that port from the control plane's own pods. Without a picker pool: no peers."""
    two = ADS.replace("servers: [confgen-fleet-xds-0.confgen-fleet-xds.inference.svc:18000]",
                      "servers: [confgen-fleet-xds-0.confgen-fleet-xds.inference.svc:18000, "
                      "confgen-fleet-xds-1.confgen-fleet-xds.inference.svc:18000]")
    ads, _ = parse_topology(two.encode(), "ads.yaml")
    docs = docs_of(render_kubernetes(ads))
    args = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    config = from_argv(args)
    port = ads.sidecar.grpc_port
    assert config.picker_peers == (f"confgen-fleet-xds-0.confgen-fleet-xds.inference.svc:{port}",
                                   f"confgen-fleet-xds-1.confgen-fleet-xds.inference.svc:{port}")
    (policy,) = by_kind(docs, "NetworkPolicy")
    peers = [rule for rule in policy["spec"]["ingress"]
             if rule["from"][0].get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
             == "control-plane"]
    assert [r["ports"] for r in peers] == [[{"protocol": "TCP", "port": port}]]
    plain, _ = parse_topology(two.replace("engine: vllm", "engine: openai").encode(), "ads.yaml")
    args = by_kind(docs_of(render_kubernetes(plain)), "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--picker-peer" not in args["args"]


def _confgen(*argv: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "confgen", *map(str, argv)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_a_loopback_redis_is_refused_for_kubernetes_with_its_place_in_the_file(tmp_path: Path) -> None:
    """In a pod 127.0.0.1 is the pod: `render --target kubernetes` of a topology whose limits.store.redis is
    loopback exits 1 with file:line:col and writes nothing (it rendered silently, and every global limit
    failed open); `validate` warns when the file writes a `kubernetes:` section and says nothing without one
    (loopback is right beside a local Envoy); with the rendered Redis's Service the render works."""
    out = tmp_path / "k"
    refused = _confgen("render", GLOBAL_LIMITS, "--target", "kubernetes", "-o", out)
    assert refused.returncode == 1 and not out.exists()
    assert f"{GLOBAL_LIMITS}:22:18: limits.store.redis: 127.0.0.1:6379 is the pod's own loopback" in refused.stderr
    assert "kubernetes.redis: true and limits.store.redis: confgen-global-limits-redis:6379" in refused.stderr
    assert "limits.store.redis" not in _confgen("validate", GLOBAL_LIMITS).stdout
    with_section = tmp_path / "k8s.yaml"
    with_section.write_text(GLOBAL_LIMITS.read_text() + "kubernetes: {namespace: inference}\n")
    warned = _confgen("validate", with_section)
    assert warned.returncode == 0
    assert f"{with_section}:22:18: limits.store.redis: warning: 127.0.0.1:6379 is the pod's own" in warned.stdout
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(GLOBAL_LIMITS.read_text().replace("127.0.0.1:6379", "confgen-global-limits-redis:6379")
                     + "kubernetes: {namespace: inference, redis: true}\n")
    assert "limits.store.redis" not in _confgen("validate", fixed).stdout
    done = _confgen("render", fixed, "--target", "kubernetes", "-o", out)
    assert done.returncode == 0, done.stderr


def test_the_unpublished_default_sidecar_image_is_said_at_render_time(tmp_path: Path) -> None:
    """`render --target kubernetes` with the default kubernetes.sidecar_image (confgen/sidecar:0.1.0, on no
    registry) warns, pinned to the file (the `kubernetes:` section when the image is not written), and still
    renders; an image of one's own is not warned about."""
    example = EXAMPLES[4]
    done = _confgen("render", example, "--target", "kubernetes", "-o", tmp_path / "a")
    assert done.returncode == 0, done.stderr
    assert (f"{example}:18:3: kubernetes.sidecar_image: warning: confgen/sidecar:0.1.0 is not published on any "
            "registry") in done.stderr
    own = tmp_path / "own.yaml"
    own.write_text(example.read_text().replace("  namespace: inference\n",
                                               "  namespace: inference\n  sidecar_image: registry.example/c:1\n"))
    done = _confgen("render", own, "--target", "kubernetes", "-o", tmp_path / "b")
    assert done.returncode == 0 and "sidecar_image" not in done.stderr, done.stderr


def test_compose_refuses_an_ads_topology_with_its_place_in_the_file(tmp_path: Path) -> None:
    """Compose runs one Envoy beside its sidecar on the xDS files; with envoy.xds.mode ads its Envoy
    would wait for a control plane nobody runs (and the sidecar now refuses to start that way):
    `render --target compose` exits 1 naming the field and writes nothing."""
    path = tmp_path / "ads.yaml"
    path.write_text(ADS)
    out = tmp_path / "c"
    refused = _confgen("render", path, "--target", "compose", "-o", out)
    assert refused.returncode == 1 and not out.exists()
    assert re.search(r"ads\.yaml:\d+:\d+: envoy\.xds\.mode: the compose target runs one Envoy", refused.stderr)


PICKER = """version: 1
name: agents
listeners: [{name: public, port: 8080}]
pools:
  - name: chat
    engine: vllm
    models: [m]
    capacity: 64
    balancing: {policy: prefix_affinity}
    workers: [10.0.2.11:8000, 10.0.2.12:8000]
sidecar:
  grpc_port: 9110
%s
kubernetes: {replicas: %d}
"""
MTLS = "  grpc_tls: {cert: /etc/envoy-tls/tls.crt, key: /etc/envoy-tls/tls.key, ca: /etc/envoy-tls/ca.crt}"


@pytest.mark.parametrize(("transport", "block"), [("unix", ""), ("plaintext", "  grpc_plaintext_loopback: true"),
                                                  ("mtls", MTLS)])
def test_the_rendered_sidecars_serve_grpc_as_the_rendered_envoy_calls_it(transport: str, block: str) -> None:
    """Each transport the topology can give Envoy's calls to the picker (Unix socket, loopback
    plaintext, mutual TLS) starts the Kubernetes render's sidecar with the flags that agree: its own
    startup check (grpc_transport_for, grpc_listen_mismatch) passes on the rendered arguments. The
    render passed no transport flag, so a topology with sidecar.grpc_tls or grpc_plaintext_loopback
    gave pods whose sidecar refused to start. With mutual TLS both containers mount their Secret
    where the flags and sidecar.grpc_tls name the files."""
    from confgen.deploy.kubernetes import SIDECAR_TLS_DIR
    from confgen.model import grpc_transport
    from sidecar.config import grpc_listen_mismatch, grpc_transport_for

    topo, _ = parse_topology((PICKER % (block, 1)).encode(), "t.yaml")
    assert grpc_transport(topo) == transport
    pod = pod_of(docs_of(render_kubernetes(topo)))
    envoy, sidecar = pod["containers"]
    config = from_argv(sidecar["args"])
    assert grpc_transport_for(config, topo).kind == transport
    assert grpc_listen_mismatch(config, topo) is None
    volumes = {v["name"]: v for v in pod["volumes"]}
    if transport == "mtls":
        assert config.grpc_tls is not None and str(config.grpc_tls.cert).startswith(SIDECAR_TLS_DIR)
        assert volumes["sidecar-tls"]["secret"]["secretName"] == "confgen-agents-sidecar-tls"
        assert volumes["envoy-tls"]["secret"]["secretName"] == "confgen-agents-envoy-tls"
        assert {"name": "sidecar-tls", "mountPath": SIDECAR_TLS_DIR, "readOnly": True} in sidecar["volumeMounts"]
        assert {"name": "envoy-tls", "mountPath": "/etc/envoy-tls", "readOnly": True} in envoy["volumeMounts"]
    else:
        assert "sidecar-tls" not in volumes and "envoy-tls" not in volumes
    assert config.picker_peers == ()  # one proxy pod: nobody to share with


def test_proxy_pods_pickers_are_peers_through_a_headless_service_over_mutual_tls() -> None:
    """Several proxy pods with a picker pool and sidecar.grpc_tls: each sidecar listens on its pod's
    address and follows dns:<base>-pickers:<grpc port>, a headless Service of the proxy pods only
    (not the Redis beside them) whose port is the sidecar's; a NetworkPolicy keeps the listeners
    and the metrics port open as before and admits the gRPC port only from the proxy pods.
    Without mutual TLS (the Unix socket is the pod's own) or with one pod: no peers, no objects,
    and validate's note says why."""
    topo, _ = parse_topology((PICKER % (MTLS, 3)).encode(), "t.yaml")
    docs = docs_of(render_kubernetes(topo))
    for doc in docs:
        if doc["kind"] in CORE_KINDS | {"NetworkPolicy"}:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
    assert violations(pod_of(docs)) == []
    sidecar = pod_of(docs)["containers"][1]
    config = from_argv(sidecar["args"])
    assert config.picker_peers == ("dns:confgen-agents-pickers:9110",)
    assert config.grpc_listen == ("0.0.0.0", 9110)
    assert {"name": "grpc", "containerPort": 9110} in sidecar["ports"]
    proxy = by_kind(docs, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "confgen-agents-pickers"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= proxy.items()
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "proxy"
    assert service["spec"]["ports"] == [{"name": "grpc", "port": 9110, "targetPort": "grpc"}]
    (policy,) = by_kind(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]
    open_rule, peers_rule = policy["spec"]["ingress"]
    assert "from" not in open_rule and {p["port"] for p in open_rule["ports"]} == {8080, topo.sidecar.port}
    assert peers_rule == {"from": [{"podSelector": {"matchLabels": service["spec"]["selector"]}}],
                          "ports": [{"protocol": "TCP", "port": 9110}]}
    for block, replicas in (("", 3), (MTLS, 1)):
        alone, _ = parse_topology((PICKER % (block, replicas)).encode(), "t.yaml")
        docs = docs_of(render_kubernetes(alone))
        assert from_argv(pod_of(docs)["containers"][1]["args"]).picker_peers == ()
        assert by_kind(docs, "NetworkPolicy") == []
        assert [s["metadata"]["name"] for s in by_kind(docs, "Service")] == ["confgen-agents", "confgen-agents-metrics"]


def test_validate_says_whether_the_proxy_pods_pickers_are_peers(tmp_path: Path) -> None:
    peered = tmp_path / "peered.yaml"
    peered.write_text(PICKER % (MTLS, 3))
    alone = tmp_path / "alone.yaml"
    alone.write_text(PICKER % ("", 3))
    out = _confgen("validate", peered)
    assert out.returncode == 0, out.stderr
    assert "are each other's peers through the headless Service confgen-agents-pickers" in out.stdout + out.stderr
    assert "must name confgen-agents-pickers" in out.stdout + out.stderr
    out = _confgen("validate", alone)
    assert out.returncode == 0, out.stderr
    assert "each run their own endpoint picker" in out.stdout + out.stderr
    assert "With sidecar.grpc_tls the render makes the pods' pickers peers" in out.stdout + out.stderr


def test_compose_serves_grpc_as_envoy_calls_it_and_refuses_mutual_tls(tmp_path: Path) -> None:
    """Compose runs Envoy and the sidecar on one host: the Unix socket (shared volume) or loopback
    plaintext (--grpc-plaintext-loopback, which the sidecar's startup check wants); mutual TLS has
    no certificates there, so the target refuses it with its place (exit 1, nothing written)."""
    from sidecar.config import grpc_transport_for

    for block, kind in (("", "unix"), ("  grpc_plaintext_loopback: true", "plaintext")):
        topo, _ = parse_topology((PICKER % (block, 1)).encode(), "t.yaml")
        compose = yaml.safe_load(render_compose(topo)["compose.yaml"])
        config = from_argv(compose["services"]["sidecar"]["command"])
        assert grpc_transport_for(config, topo).kind == kind
    path = tmp_path / "t.yaml"
    path.write_text(PICKER % (MTLS, 1))
    out = _confgen("render", path, "--target", "compose", "-o", tmp_path / "out")
    assert out.returncode == 1
    assert re.search(r"t\.yaml:\d+:\d+: sidecar\.grpc_tls: .*compose target runs Envoy and the sidecar on one host",
                     out.stderr), out.stderr
    assert not (tmp_path / "out").exists()


def test_the_proxys_services_and_budget_never_select_the_redis_pods_beside_it() -> None:
    """With kubernetes.redis the Redis pods carry the topology's name and instance labels too: the
    clients' Service, the metrics Service, the PodDisruptionBudget and the spread selected them by
    those alone, so the clients' Service sent a share of its connections to Redis's pod (nothing
    listens there on the listeners' ports) and Prometheus scraped it for the sidecar. Each selects
    the proxy pods by their component now (the Deployment's own selector stays: it cannot change on
    an upgrade, and its ReplicaSets own their pods by reference)."""
    docs = docs_of(render_kubernetes(_with_store("confgen-global-limits-redis:6379")))
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
                   for d in by_kind(docs, "Deployment")}
    proxy, redis = deployments["confgen-global-limits"], deployments["confgen-global-limits-redis"]
    selectors = {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["selector"] for d in by_kind(docs, "Service")}
    selectors.update({f"PodDisruptionBudget/{d['metadata']['name']}": d["spec"]["selector"]["matchLabels"]
                      for d in by_kind(docs, "PodDisruptionBudget")})
    pod = pod_of(docs)
    selectors.update({f"spread/{c['topologyKey']}": c["labelSelector"]["matchLabels"]
                      for c in pod["topologySpreadConstraints"]})
    assert len(selectors) == 6  # clients', metrics, redis Services; the proxy's budget; two spreads
    for name, selector in selectors.items():
        picks_proxy, picks_redis = selector.items() <= proxy.items(), selector.items() <= redis.items()
        assert picks_proxy != picks_redis, (name, selector)  # one kind of pod, never both
        assert picks_redis == (name == "Service/confgen-global-limits-redis"), name


LONGEST = "n" * 63  # the longest topology name the schema allows


def _long_named(case: str) -> tuple[Topology, dict[str, bytes], str]:
    from confgen._names import object_base
    from confgen.deploy.gateway_api import render_gateway_api

    if case == "ads":
        base = object_base(LONGEST)
        text = ADS.replace("name: fleet", f"name: {LONGEST}").replace(
            "confgen-fleet-xds-0.confgen-fleet-xds", f"{base}-xds-0.{base}-xds")
        topo, _ = parse_topology(text.encode(), "t.yaml")
        return topo, render_kubernetes(topo), "kubernetes.yaml"
    if case == "gateway-api":
        text = (ROOT / "tests/golden/inputs/gateway-api.yaml").read_text().replace("name: gie", f"name: {LONGEST}")
        topo, _ = parse_topology(text.encode(), "t.yaml")
        return topo, render_gateway_api(topo), "gateway-api.yaml"
    text = (ROOT / f"tests/golden/inputs/{case}.yaml").read_text()
    text = re.sub(r"(?m)^name: .*$", f"name: {LONGEST}", text, count=1)
    topo, _ = parse_topology(text.encode(), "t.yaml")
    return monitored(topo), render_kubernetes(monitored(topo)), "kubernetes.yaml"


@pytest.mark.parametrize("case", ["ads", "gateway-api", "global-limits", "picker-peers"])
def test_every_object_a_63_character_topology_name_gives_is_a_name_kubernetes_takes(case: str) -> None:
    """Found by review: the base `confgen-<name>` was cut to 63 and suffixes went after it, so a topology
    name of 48+ characters (the schema allows 63) gave Services like `<63>-metrics` the API server refuses,
    while validate said ok. Every Service is a DNS-1035 label of at most 63, a StatefulSet name leaves its
    pods' controller-revision-hash label room (52), every other name is at most 253."""
    _, files, name = _long_named(case)
    docs = docs_of(files, name)
    assert docs
    for doc in docs:
        kind, obj = doc["kind"], doc["metadata"]["name"]
        if kind == "Service":
            assert len(obj) <= 63 and DNS_1123_LABEL.fullmatch(obj), (kind, obj)
        elif kind == "StatefulSet":
            assert len(obj) <= 52, (kind, obj)
        assert len(obj) <= 253, (kind, obj)
