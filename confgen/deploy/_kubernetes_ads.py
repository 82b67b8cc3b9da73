"""Kubernetes objects for `envoy.xds.mode: ads`: a control plane and an Envoy fleet without sidecars.

    StatefulSet <base>-xds (2 replicas) + headless Service + PDB: `confgen-sidecar --serve-xds`.
        A StatefulSet gives each replica a stable DNS name
        (<base>-xds-<i>.<base>-xds.<namespace>.svc), which is what `envoy.xds.servers` should
        list: the bootstrap puts each server in its own priority, so every Envoy follows
        replica 0 while it is healthy and replica 1 is a hot standby (docs/ads.md: why one
        replica should count the whole fleet).
    Deployment <base> (kubernetes.replicas Envoys, no sidecar) + Service on the listeners +
        PDB; each Envoy's node id is its pod name; an HPA scales it on CPU.

Built from `kubernetes.py`'s pieces (the plan's names and labels, the restricted security
contexts, the key environment, the resource sizes); the selectors add the component, so
the listeners' Service never picks a control-plane pod.
"""

from __future__ import annotations

from ..model import split_address
from . import _kubernetes_base as k8s_mod
from ._kubernetes_base import Obj

__all__ = ["ads_objects", "xds_port"]

DEFAULT_XDS_PORT = 18000


def xds_port(plan: k8s_mod._Plan) -> int:
    """The control plane's gRPC port: the first listed server's (they are this StatefulSet's pods)."""
    for server in plan.topo.envoy.xds.servers:
        parts = split_address(server)
        if parts is not None:
            return parts[1]
    return DEFAULT_XDS_PORT


def _selector(plan: k8s_mod._Plan, component: str) -> dict[str, str]:
    return {**plan.selector, "app.kubernetes.io/component": component}


def _pdb(plan: k8s_mod._Plan, name: str, component: str) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": plan.meta(name, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(plan, component)}},
    }


def _control_plane(plan: k8s_mod._Plan) -> list[Obj]:
    topo = plan.topo
    name = f"{plan.base}-xds"
    port = xds_port(plan)
    topology_file = f"{k8s_mod.TOPOLOGY_DIR}/topology.yaml"
    container = {
        "name": "control-plane",
        "image": topo.kubernetes.sidecar_image,
        "args": ["--topology", topology_file, "--serve-xds", f"0.0.0.0:{port}",
                 "--listen", f"0.0.0.0:{k8s_mod.SIDECAR_PORT}"],
        "workingDir": k8s_mod.WORK_DIR,
        "ports": [{"name": "xds", "containerPort": port},
                  {"name": "metrics", "containerPort": k8s_mod.SIDECAR_PORT}],
        "volumeMounts": [{"name": "topology", "mountPath": k8s_mod.TOPOLOGY_DIR, "readOnly": True},
                         {"name": "work", "mountPath": k8s_mod.WORK_DIR},
                         {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - an emptyDir of the pod
                         *k8s_mod._key_mounts(plan)],
        "env": k8s_mod._key_env(plan),
        "resources": k8s_mod.RESOURCES["sidecar"],
        "securityContext": k8s_mod._restricted(),
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10,
                          "failureThreshold": 6},
    }
    volumes: list[Obj] = [
        {"name": "topology", "configMap": {"name": f"{plan.base}-topology"}},
        {"name": "work", "emptyDir": {"sizeLimit": "16Mi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    if k8s_mod._key_files(plan):
        volumes.append({"name": "api-keys", "secret": {"secretName": plan.keys_secret, "defaultMode": 0o400}})
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": plan.meta(name, "control-plane"),
        "spec": {
            "replicas": 2,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _selector(plan, "control-plane")},
            "template": {
                "metadata": {"labels": plan.labels("control-plane"), "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(k8s_mod.SIDECAR_PORT),
                    "prometheus.io/path": "/metrics"}},
                "spec": {
                    "securityContext": k8s_mod._pod_security(),
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": volumes,
                    # Envoys keep their config while it is gone; nothing to drain
                    "terminationGracePeriodSeconds": 10,
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(name, "control-plane"),
        "spec": {
            "clusterIP": "None",  # per-pod DNS names for envoy.xds.servers
            "selector": _selector(plan, "control-plane"),
            "ports": [{"name": "xds", "port": port, "targetPort": "xds", "appProtocol": "grpc"},
                      {"name": "metrics", "port": k8s_mod.SIDECAR_PORT, "targetPort": "metrics"}],
        },
    }
    return [statefulset, service, _pdb(plan, name, "control-plane")]


def _envoys(plan: k8s_mod._Plan) -> list[Obj]:
    topo = plan.topo
    k8s = topo.kubernetes
    xds_dir = k8s_mod.XDS_DIR
    mounts = [{"name": "topology", "mountPath": k8s_mod.TOPOLOGY_DIR, "readOnly": True},
              {"name": "xds", "mountPath": xds_dir}, {"name": "work", "mountPath": k8s_mod.WORK_DIR}]
    init = {
        "name": "render",
        "image": k8s.sidecar_image,
        # mode ads: the bootstrap alone, no key in it (the control plane serves the listeners)
        "command": ["confgen", "render", f"{k8s_mod.TOPOLOGY_DIR}/topology.yaml", "-o", xds_dir,
                    "--config-dir", xds_dir],
        "workingDir": k8s_mod.WORK_DIR,
        "volumeMounts": mounts,
        "resources": k8s_mod.RESOURCES["render"],
        "securityContext": k8s_mod._restricted(),
    }
    grace = k8s.termination_grace_seconds
    envoy = {
        "name": "envoy",
        "image": k8s.envoy_image,
        "args": ["-c", f"{xds_dir}/bootstrap.json", "--service-node", "$(POD_NAME)", "--log-level", "info",
                 "--drain-time-s", str(max(1, grace // 4)), "--drain-strategy", "immediate"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": k8s_mod._port_name(lst.name), "containerPort": lst.port} for lst in topo.listeners],
        "volumeMounts": [{"name": "xds", "mountPath": xds_dir, "readOnly": True}],
        # the HPA scales on CPU utilisation, relative to this request
        "resources": k8s_mod.RESOURCES["envoy"],
        "securityContext": k8s_mod._restricted(bind_low_ports=any(lst.port < 1024 for lst in topo.listeners)),
        "readinessProbe": {"tcpSocket": {"port": topo.listeners[0].port}, "periodSeconds": 5},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": plan.meta(plan.base, "envoy"),
        "spec": {
            "replicas": k8s.replicas,
            "selector": {"matchLabels": _selector(plan, "envoy")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": plan.labels("envoy")},
                "spec": {
                    "securityContext": k8s_mod._pod_security(),
                    "automountServiceAccountToken": False,
                    "initContainers": [init],
                    "containers": [envoy],
                    "volumes": [{"name": "topology", "configMap": {"name": f"{plan.base}-topology"}},
                                {"name": "xds", "emptyDir": {}},
                                {"name": "work", "emptyDir": {"sizeLimit": "16Mi"}}],
                    "terminationGracePeriodSeconds": grace,
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(plan.base, "envoy"),
        "spec": {"selector": _selector(plan, "envoy"),
                 "ports": [{"name": k8s_mod._port_name(lst.name), "port": lst.port, "targetPort": lst.port}
                           for lst in topo.listeners]},
    }
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": plan.meta(plan.base, "envoy"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": plan.base},
            "minReplicas": k8s.replicas,
            "maxReplicas": max(k8s.replicas, k8s.envoy_max_replicas),
            "metrics": [{"type": "Resource", "resource": {
                "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}],
        },
    }
    return [deployment, service, _pdb(plan, plan.base, "envoy"), hpa]


def ads_objects(plan: k8s_mod._Plan) -> list[Obj]:
    """The control plane's objects, then the Envoys'."""
    return [*_control_plane(plan), *_envoys(plan)]
