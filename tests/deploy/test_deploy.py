"""Deployment targets: Kubernetes manifests and Docker Compose from the same topology."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from confgen import load_topology, parse_topology
from confgen.deploy import render_compose, render_kubernetes, topology_yaml

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_canonical_topology_round_trips(example: Path) -> None:
    """The topology a ConfigMap carries reloads to exactly the model it was written from."""
    topo, _ = load_topology(example)
    again, _ = parse_topology(topology_yaml(topo).encode(), "canonical.yaml")
    assert again == topo


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_kubernetes_manifests_pass_kubernetes_schemas(example: Path) -> None:
    """Every rendered object validates (strictly: no unknown fields) against the Kubernetes
    1.30 schemas, and the pod runs Envoy and the sidecar over a shared xDS volume."""
    topo, _ = load_topology(example)
    docs = list(yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    kinds = [d["kind"] for d in docs]
    assert kinds[:3] == ["ConfigMap", "Deployment", "Service"]
    pod = docs[1]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["envoy", "sidecar"]
    assert pod["initContainers"][0]["command"][:2] == ["confgen", "render"]


def test_hpa_scales_pool_on_queue_depth_and_keys_come_from_a_secret() -> None:
    """A pool with autoscale gets an HPA on the sidecar's llm_queue_depth for that pool; API
    keys reach the pod only as secretKeyRef environment variables, never as values."""
    topo, _ = load_topology(EXAMPLES[4])
    text = render_kubernetes(topo)["kubernetes.yaml"].decode()
    docs = list(yaml.safe_load_all(text))
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert len(hpas) == 1
    spec = hpas[0]["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "vllm-70b"}
    metric = spec["metrics"][0]["external"]
    assert metric["metric"] == {"name": "llm_queue_depth", "selector": {"matchLabels": {"pool": "llama-70b"}}}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (3, 12)
    sidecar = docs[1]["spec"]["template"]["spec"]["containers"][1]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in sidecar["env"]}
    assert refs["CONFGEN_KEY_TEAM_SEARCH"] == {"name": "confgen-api-keys", "key": "CONFGEN_KEY_TEAM_SEARCH"}
    assert all("value" not in e for e in sidecar["env"])


def test_compose_runs_render_then_envoy_and_sidecar() -> None:
    """The compose file renders once, then runs Envoy and the sidecar on the shared volume,
    next to a copy of the canonical topology; it has no YAML anchors to trip up tools."""
    topo, _ = load_topology(EXAMPLES[3])
    files = render_compose(topo)
    text = files["compose.yaml"].decode()
    assert "&id" not in text and "*id" not in text
    services = yaml.safe_load(text)["services"]
    assert set(services) == {"render", "sidecar", "envoy"}
    assert services["envoy"]["depends_on"]["render"]["condition"] == "service_completed_successfully"
    assert parse_topology(files["topology.yaml"], "t.yaml")[0] == topo
