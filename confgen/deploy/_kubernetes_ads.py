"""Kubernetes objects for `envoy.xds.mode: ads`: a control plane and an Envoy fleet without sidecars.

    StatefulSet confgen-<name>-xds (2 replicas) + headless Service: `confgen-sidecar --serve-xds`.
        A StatefulSet gives each replica a stable DNS name
        (confgen-<name>-xds-<i>.confgen-<name>-xds.<namespace>.svc), which is what
        `envoy.xds.servers` should list: the bootstrap puts each server in its own priority, so
        every Envoy follows replica 0 while it is healthy and replica 1 is a hot standby
        (docs/ads.md: why one replica should count the whole fleet).
    Deployment confgen-<name> (kubernetes.replicas Envoys, no sidecar) + Service on the
        listeners; each Envoy's node id is its pod name; an HPA scales it on CPU.
"""

from __future__ import annotations

from typing import Any

from ..model import Topology, split_address

Obj = dict[str, Any]

TOPOLOGY_DIR = "/etc/confgen/topology"
XDS_DIR = "/var/run/confgen/envoy"
SIDECAR_PORT = 9109
DEFAULT_XDS_PORT = 18000


def xds_port(topo: Topology) -> int:
    """The control plane's gRPC port: the first listed server's (they are this StatefulSet's pods)."""
    for server in topo.envoy.xds.servers:
        parts = split_address(server)
        if parts is not None:
            return parts[1]
    return DEFAULT_XDS_PORT


def _labels(topo: Topology, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "confgen", "app.kubernetes.io/instance": topo.name,
            "app.kubernetes.io/component": component}


def _meta(topo: Topology, name: str, component: str) -> Obj:
    return {"name": name, "namespace": topo.kubernetes.namespace, "labels": _labels(topo, component)}


def _restricted() -> Obj:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def control_plane(topo: Topology, name: str, key_env: list[Obj]) -> list[Obj]:
    k8s = topo.kubernetes
    cp = f"{name}-xds"
    port = xds_port(topo)
    selector = _labels(topo, "control-plane")
    container = {
        "name": "control-plane",
        "image": k8s.sidecar_image,
        "args": ["--topology", f"{TOPOLOGY_DIR}/topology.yaml", "--serve-xds", f"0.0.0.0:{port}",
                 "--listen", f"0.0.0.0:{SIDECAR_PORT}"],
        "ports": [{"name": "xds", "containerPort": port}, {"name": "metrics", "containerPort": SIDECAR_PORT}],
        "volumeMounts": [{"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True}],
        "env": key_env,
        "securityContext": _restricted(),
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": SIDECAR_PORT}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": SIDECAR_PORT}, "periodSeconds": 10},
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(topo, cp, "control-plane"),
        "spec": {
            "replicas": 2,
            "serviceName": cp,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(SIDECAR_PORT),
                    "prometheus.io/path": "/metrics"}},
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 101, "fsGroup": 101},
                    "containers": [container],
                    "volumes": [{"name": "topology", "configMap": {"name": f"{name}-topology"}}],
                    "terminationGracePeriodSeconds": 10,
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(topo, cp, "control-plane"),
        "spec": {
            "clusterIP": "None",  # per-pod DNS names for envoy.xds.servers
            "selector": selector,
            "publishNotReadyAddresses": False,
            "ports": [{"name": "xds", "port": port, "targetPort": port, "appProtocol": "grpc"}],
        },
    }
    return [statefulset, service]


def envoy_fleet(topo: Topology, name: str) -> list[Obj]:
    k8s = topo.kubernetes
    selector = _labels(topo, "envoy")
    mounts = [{"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True},
              {"name": "xds", "mountPath": XDS_DIR}]
    init = {
        "name": "render",
        "image": k8s.sidecar_image,
        # mode ads: the bootstrap alone, no key in it (the control plane serves the listeners)
        "command": ["confgen", "render", f"{TOPOLOGY_DIR}/topology.yaml", "-o", XDS_DIR, "--config-dir", XDS_DIR],
        "volumeMounts": mounts,
        "securityContext": _restricted(),
    }
    envoy = {
        "name": "envoy",
        "image": k8s.envoy_image,
        "args": ["-c", f"{XDS_DIR}/bootstrap.json", "--service-node", "$(POD_NAME)", "--log-level", "info"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": lst.name[:15], "containerPort": lst.port} for lst in topo.listeners],
        "volumeMounts": [{"name": "xds", "mountPath": XDS_DIR, "readOnly": True}],
        "securityContext": _restricted(),
        # the HPA scales on CPU utilisation, which is relative to this request
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "readinessProbe": {"tcpSocket": {"port": topo.listeners[0].port}, "periodSeconds": 5},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(topo, name, "envoy"),
        "spec": {
            "replicas": k8s.replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector},
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 101, "fsGroup": 101},
                    "initContainers": [init],
                    "containers": [envoy],
                    "volumes": [{"name": "topology", "configMap": {"name": f"{name}-topology"}},
                                {"name": "xds", "emptyDir": {}}],
                    "terminationGracePeriodSeconds": 60,
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(topo, name, "envoy"),
        "spec": {
            "selector": selector,
            "ports": [{"name": lst.name[:15], "port": lst.port, "targetPort": lst.port} for lst in topo.listeners],
        },
    }
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(topo, name, "envoy"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": k8s.replicas,
            "maxReplicas": max(k8s.replicas, k8s.envoy_max_replicas),
            "metrics": [{"type": "Resource", "resource": {
                "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}],
        },
    }
    return [deployment, service, hpa]
