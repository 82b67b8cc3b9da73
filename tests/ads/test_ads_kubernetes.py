"""--target kubernetes with envoy.xds.mode: ads: a control plane (2 replicas) and Envoys without sidecars."""

from __future__ import annotations

import kubernetes_validate
import yaml

from confgen import parse_topology
from confgen.deploy import render_kubernetes

TOPOLOGY = """\
version: 1
name: fleet
listeners: [{name: public, port: 8080}]
kubernetes: {namespace: inference, replicas: 3, envoy_max_replicas: 12}
envoy:
  xds:
    mode: ads
    servers:
      - confgen-fleet-xds-0.confgen-fleet-xds.inference.svc:18000
      - confgen-fleet-xds-1.confgen-fleet-xds.inference.svc:18000
pools:
  - name: chat
    engine: vllm
    models: [m]
    workers: ["10.0.0.1:8000", "10.0.0.2:8000"]
"""


def test_ads_manifests_run_a_control_plane_and_sidecarless_envoys() -> None:
    """Every object validates strictly against Kubernetes 1.30; the control plane is 2 replicas serving ADS on
    the servers' port behind a headless Service (per-pod names); the Envoy pods carry no sidecar, take their node
    id from the pod name, and an HPA scales them on CPU between kubernetes.replicas and envoy_max_replicas."""
    topo, _ = parse_topology(TOPOLOGY.encode())
    docs = list(yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    cp = by[("StatefulSet", "confgen-fleet-xds")]["spec"]
    assert cp["replicas"] == 2 and cp["serviceName"] == "confgen-fleet-xds"
    (container,) = cp["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--serve-xds") + 1] == "0.0.0.0:18000"
    svc = by[("Service", "confgen-fleet-xds")]["spec"]
    assert svc["clusterIP"] == "None" and svc["ports"][0]["port"] == 18000
    assert svc["selector"]["app.kubernetes.io/component"] == "control-plane"

    pod = by[("Deployment", "confgen-fleet")]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["envoy"]
    envoy = pod["containers"][0]
    assert envoy["args"][envoy["args"].index("--service-node") + 1] == "$(POD_NAME)"
    assert pod["initContainers"][0]["command"][:2] == ["confgen", "render"]
    listeners = by[("Service", "confgen-fleet")]["spec"]
    assert listeners["selector"]["app.kubernetes.io/component"] == "envoy"  # never the control plane's pods
    hpa = by[("HorizontalPodAutoscaler", "confgen-fleet")]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 12)
    assert hpa["metrics"][0]["resource"]["name"] == "cpu"
