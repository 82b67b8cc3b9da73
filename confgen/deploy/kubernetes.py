"""Kubernetes manifests: ConfigMap, Deployment (init render + Envoy + sidecar), Service, HPAs."""

from __future__ import annotations

from typing import Any

from ..model import Topology
from . import _kubernetes_ads as _ads
from ._canonical import dump, topology_yaml

TOPOLOGY_DIR = "/etc/confgen/topology"
XDS_DIR = "/var/run/confgen/envoy"
SIDECAR_PORT = 9109

Obj = dict[str, Any]


def _meta(topo: Topology, name: str, extra: dict[str, str] | None = None) -> Obj:
    labels = {"app.kubernetes.io/name": "confgen", "app.kubernetes.io/instance": topo.name, **(extra or {})}
    return {"name": name, "namespace": topo.kubernetes.namespace, "labels": labels}


def _key_env(topo: Topology) -> list[Obj]:
    if topo.auth is None or topo.kubernetes.keys_secret is None:
        return []
    return [
        {"name": k.env, "valueFrom": {"secretKeyRef": {"name": topo.kubernetes.keys_secret, "key": k.env}}}
        for k in topo.auth.api_keys
        if k.env is not None
    ]


def _deployment(topo: Topology) -> Obj:
    k8s = topo.kubernetes
    name = f"confgen-{topo.name}"
    selector = {"app.kubernetes.io/name": "confgen", "app.kubernetes.io/instance": topo.name}
    volumes = [
        {"name": "topology", "configMap": {"name": f"{name}-topology"}},
        {"name": "xds", "emptyDir": {}},
    ]
    topology_file = f"{TOPOLOGY_DIR}/topology.yaml"
    mounts = [
        {"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True},
        {"name": "xds", "mountPath": XDS_DIR},
    ]
    env = _key_env(topo)
    init = {
        "name": "render",
        "image": k8s.sidecar_image,
        "command": ["confgen", "render", topology_file, "-o", XDS_DIR, "--config-dir", XDS_DIR],
        "volumeMounts": mounts,
        "env": env,
    }
    envoy = {
        "name": "envoy",
        "image": k8s.envoy_image,
        "args": ["-c", f"{XDS_DIR}/bootstrap.json", "--log-level", "info"],
        "ports": [{"name": lst.name, "containerPort": lst.port} for lst in topo.listeners],
        "volumeMounts": [{"name": "xds", "mountPath": XDS_DIR, "readOnly": True}],
        "readinessProbe": {"tcpSocket": {"port": topo.listeners[0].port}, "periodSeconds": 5},
    }
    sidecar = {
        "name": "sidecar",
        "image": k8s.sidecar_image,
        "args": ["--topology", topology_file, "--xds-dir", XDS_DIR, "--listen", f"0.0.0.0:{SIDECAR_PORT}"],
        "ports": [{"name": "metrics", "containerPort": SIDECAR_PORT}],
        "volumeMounts": mounts,
        "env": env,
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": SIDECAR_PORT}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": SIDECAR_PORT}, "periodSeconds": 10},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(topo, name),
        "spec": {
            "replicas": k8s.replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": selector,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(SIDECAR_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 101, "fsGroup": 101},
                    "initContainers": [init],
                    "containers": [envoy, sidecar],
                    "volumes": volumes,
                    "terminationGracePeriodSeconds": 60,
                },
            },
        },
    }


def _service(topo: Topology) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(topo, f"confgen-{topo.name}"),
        "spec": {
            "selector": {"app.kubernetes.io/name": "confgen", "app.kubernetes.io/instance": topo.name},
            "ports": [{"name": lst.name, "port": lst.port, "targetPort": lst.port} for lst in topo.listeners],
        },
    }


def _hpas(topo: Topology) -> list[Obj]:
    out = []
    for pool in topo.pools:
        scale = pool.autoscale
        if scale is None:
            continue
        kind, name = scale.target.split("/", 1)
        out.append({
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(topo, f"{name}-queue", {"confgen.dev/pool": pool.name}),
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment" if kind == "deployment" else "StatefulSet",
                    "name": name,
                },
                "minReplicas": scale.min_replicas,
                "maxReplicas": scale.max_replicas,
                # llm_queue_depth is served by prometheus-adapter (or KEDA) from the sidecar's /metrics.
                "metrics": [{
                    "type": "External",
                    "external": {
                        "metric": {"name": "llm_queue_depth", "selector": {"matchLabels": {"pool": pool.name}}},
                        "target": {"type": "AverageValue", "averageValue": str(scale.queue_depth_per_replica)},
                    },
                }],
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
            },
        })
    return out


def render_kubernetes(topo: Topology) -> dict[str, bytes]:
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(topo, f"confgen-{topo.name}-topology"),
        "data": {"topology.yaml": topology_yaml(topo)},
    }
    if topo.envoy.xds.mode == "ads":  # a control plane + Envoys without sidecars
        name = f"confgen-{topo.name}"
        docs = [configmap, *_ads.control_plane(topo, name, _key_env(topo)), *_ads.envoy_fleet(topo, name),
                *_hpas(topo)]
    else:
        docs = [configmap, _deployment(topo), _service(topo), *_hpas(topo)]
    text = "---\n".join(dump(doc) for doc in docs)
    return {"kubernetes.yaml": text.encode()}
