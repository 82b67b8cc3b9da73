"""Kubernetes objects for `envoy.xds.mode: ads`: a control plane and an Envoy fleet without sidecars.

    StatefulSet <base>-xds (2 replicas) + headless Service + PDB: `confgen-sidecar --serve-xds`.
        A StatefulSet gives each replica a stable DNS name
        (<base>-xds-<i>.<base>-xds.<namespace>.svc), which is what `envoy.xds.servers` should
        list: the bootstrap puts each server in its own priority, so every Envoy follows
        replica 0 while it is healthy and replica 1 is a hot standby (docs/ads.md: why one
        replica should count the whole fleet).
    Deployment <base> (kubernetes.replicas Envoys, no sidecar) + Service on the listeners +
        PDB; an HPA scales it on CPU.
    mTLS (sidecar.grpc_tls, required here: the control plane listens beyond loopback). The
        certificates come from Secrets with cert-manager's entries (tls.crt, tls.key, ca.crt):
        <base>-xds-tls for the control plane (mounted at XDS_TLS_DIR, its --grpc-tls-* flags),
        <base>-envoy-tls for the Envoys (mounted where sidecar.grpc_tls says). The Envoys share one
        certificate whose name (SAN or CN) is <base>-envoy: each Envoy's node id is
        <base>-envoy/<pod name>, which the control plane accepts only from that certificate, and
        counts for the limits at most max(replicas, envoy_max_replicas) of (--xds-nodes-per-identity).
    The endpoint picker (a pool with policy prefix_affinity) runs in the control plane: one
        picker sees every Envoy's requests. It listens on sidecar.grpc_port beyond loopback, so
        over mTLS too, from the same Secret as ADS: the
        same pods, the same server names (the per-pod DNS names envoy.xds.servers lists, which
        the Envoys check for both clusters), the same clients (the Envoy pods' shared
        certificate) and the same CA: the sidecar's one TLS setup (--grpc-tls-*), the Envoys'
        one TLS block (sidecar.grpc_tls).
    The replicas' pickers are each other's `--picker-peer` (every pod lists every replica; a picker
        ends the link to itself): the standby knows every placement and in-flight request, so a
        failover keeps the conversations where their prefixes are. The control plane's certificate
        is then a client certificate too (clientAuth), signed by the CA it trusts; the
        NetworkPolicy admits the picker's port from the control plane's own pods.
    The rate limit service (scope: global limits) runs there too, on the same port and TLS: every
        Envoy's checks go to the replica it follows for ADS, which counts in limits.store (with
        kubernetes.redis, the rendered Redis admits the control plane's pods); docs/limits.md says
        why one service for the fleet rather than a sidecar per Envoy.
    NetworkPolicy <base>-xds: the control plane's pods accept the gRPC ports (ADS, and the
        picker's when it runs) only from this topology's Envoy pods and /metrics only from pods
        labelled app.kubernetes.io/name=prometheus (any namespace); nothing else.

Built from `kubernetes.py`'s pieces (the plan's names and labels, the restricted security
contexts, the key environment, the resource sizes); the selectors add the component, so
the listeners' Service never picks a control-plane pod.
"""

from __future__ import annotations

import posixpath

from ..balancing import grpc_wanted, picker_wanted
from ..model import grpc_service_hosts, grpc_tls, join_address, split_address
from . import _kubernetes_base as k8s_mod
from ._kubernetes_base import Obj

__all__ = ["SCRAPER_LABELS", "XDS_TLS_DIR", "ads_objects", "ads_problems", "envoy_identity", "xds_port"]

DEFAULT_XDS_PORT = 18000
XDS_TLS_DIR = "/etc/confgen/xds-tls"
SCRAPER_LABELS = {"app.kubernetes.io/name": "prometheus"}  # Prometheus Operator's and the Helm chart's label


def envoy_identity(plan: k8s_mod._Plan) -> str:
    """The name the Envoys' shared client certificate carries (SAN or CN); node ids are <it>/<pod name>."""
    return f"{plan.base}-envoy"


def ads_problems(plan: k8s_mod._Plan) -> list[tuple[str, str]]:
    """What the ADS manifests cannot express (field path, reason)."""
    tls = grpc_tls(plan.topo)  # sidecar.grpc_tls, or the deprecated envoy.xds.tls
    where = "sidecar.grpc_tls" if plan.topo.sidecar.grpc_tls is not None or tls is None else "envoy.xds.tls"
    if tls is None:
        return [(where, "the control plane listens beyond loopback in Kubernetes: ADS serves the API "
                 "keys, so it needs mutual TLS (cert, key, ca; docs/ads.md)")]
    names = [posixpath.basename(p) for p in (tls.cert, tls.key, tls.ca)]
    if len(set(names)) < 3:
        return [(where, f"cert, key and ca need distinct file names to come from one Secret, got {names}")]
    if serves_grpc(plan) and plan.topo.sidecar.grpc_port in (xds_port(plan), k8s_mod.SIDECAR_PORT):
        return [("sidecar.grpc_port", f"port {plan.topo.sidecar.grpc_port} is also the control plane's ADS or "
                 "metrics port")]
    return []


def serves_grpc(plan: k8s_mod._Plan) -> bool:
    """Whether the control plane runs gRPC services for the Envoys: the endpoint picker (a pool with
    policy prefix_affinity), the rate limit service (scope: global limits), or both."""
    return grpc_wanted(plan.topo)


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
    grpc_port = topo.sidecar.grpc_port
    picker = serves_grpc(plan)
    # the picker and the rate limit service for every Envoy, on the same mTLS setup as ADS (the module's
    # docstring says why)
    grpc_args = ["--grpc-listen", f"0.0.0.0:{grpc_port}"] if picker else []
    # the replicas' pickers are each other's peers (placements and in-flight counts, over the same mTLS):
    # a standby that takes over knows where every conversation is. Every pod gets every replica; a
    # picker ends the link to itself (sidecar/outputs/picker/peers.py)
    if picker_wanted(topo):
        for host in dict.fromkeys(grpc_service_hosts(topo)):
            grpc_args += ["--picker-peer", join_address(host, grpc_port)]
    replicas = max(topo.kubernetes.replicas, topo.kubernetes.envoy_max_replicas)
    grpc_ports = [{"name": "grpc", "containerPort": grpc_port}] if picker else []
    container = {
        "name": "control-plane",
        "image": topo.kubernetes.sidecar_image,
        "command": ["confgen-sidecar"],
        "args": ["--topology", topology_file, "--serve-xds", f"0.0.0.0:{port}",
                 "--grpc-tls-cert", f"{XDS_TLS_DIR}/tls.crt", "--grpc-tls-key", f"{XDS_TLS_DIR}/tls.key",
                 "--grpc-client-ca", f"{XDS_TLS_DIR}/ca.crt",
                 # a replica serves at most this many Envoys; the Envoy pods share one certificate, which
                 # counts (and the limits are divided by) at most as many Envoys as the HPA may run
                 "--xds-max-nodes", str(replicas + 2), "--xds-nodes-per-identity", str(replicas),
                 "--listen", f"0.0.0.0:{k8s_mod.SIDECAR_PORT}", *grpc_args],
        "workingDir": k8s_mod.WORK_DIR,
        "ports": [{"name": "xds", "containerPort": port}, *grpc_ports,
                  {"name": "metrics", "containerPort": k8s_mod.SIDECAR_PORT}],
        "volumeMounts": [{"name": "topology", "mountPath": k8s_mod.TOPOLOGY_DIR, "readOnly": True},
                         {"name": "work", "mountPath": k8s_mod.WORK_DIR},
                         {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - an emptyDir of the pod
                         {"name": "xds-tls", "mountPath": XDS_TLS_DIR, "readOnly": True},
                         *k8s_mod._key_mounts(plan)],
        "env": [*k8s_mod._key_env(plan), *k8s_mod._store_env(plan)],
        "resources": k8s_mod.sidecar_resources(topo),  # global limits: every Envoy's checks
        "securityContext": k8s_mod._restricted(),
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10,
                          "failureThreshold": 6},
    }
    volumes: list[Obj] = [
        {"name": "topology", "configMap": {"name": f"{plan.base}-topology"}},
        {"name": "work", "emptyDir": {"sizeLimit": "16Mi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
        # cert-manager's Certificate output; renewed in place, re-read on the next handshake
        {"name": "xds-tls", "secret": {"secretName": f"{plan.base}-xds-tls", "defaultMode": 0o400}},
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
                    "topologySpreadConstraints": k8s_mod.spread(_selector(plan, "control-plane")),
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
                      *({"name": "grpc", "port": grpc_port, "targetPort": "grpc", "appProtocol": "grpc"}
                        for _ in grpc_ports),
                      {"name": "metrics", "port": k8s_mod.SIDECAR_PORT, "targetPort": "metrics"}],
        },
    }
    envoy_ports = [port, grpc_port] if picker else [port]
    return [statefulset, service, _pdb(plan, name, "control-plane"), _network_policy(plan, name, envoy_ports)]


def _network_policy(plan: k8s_mod._Plan, name: str, ports: list[int]) -> Obj:
    """The control plane's pods: gRPC (ADS, the picker, rate limits) from this topology's Envoys, /metrics
    from scrapers, nothing else."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": plan.meta(name, "control-plane"),
        "spec": {
            "podSelector": {"matchLabels": _selector(plan, "control-plane")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": _selector(plan, "envoy")}}],
                 "ports": [{"protocol": "TCP", "port": port} for port in ports]},
                *([{"from": [{"podSelector": {"matchLabels": _selector(plan, "control-plane")}}],
                    "ports": [{"protocol": "TCP", "port": plan.topo.sidecar.grpc_port}]}]
                  if picker_wanted(plan.topo) else []),  # the replicas' pickers, peers of each other
                {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(SCRAPER_LABELS)}}],
                 "ports": [{"protocol": "TCP", "port": k8s_mod.SIDECAR_PORT}]},
            ],
        },
    }


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
                    "--config-dir", xds_dir, "--admin-loopback"],  # the pod's loopback is its own
        "workingDir": k8s_mod.WORK_DIR,
        "volumeMounts": mounts,
        "resources": k8s_mod.RESOURCES["render"],
        "securityContext": k8s_mod._restricted(),
    }
    grace = k8s.termination_grace_seconds
    tls_volumes, tls_mounts = k8s_mod.envoy_tls_mounts(plan)
    envoy = {
        "name": "envoy",
        "image": k8s.envoy_image,
        # the node id the control plane accepts from the shared certificate: <its name>/<this pod>
        "args": ["-c", f"{xds_dir}/bootstrap.json", "--service-node", f"{envoy_identity(plan)}/$(POD_NAME)",
                 "--log-level", "info",
                 "--drain-time-s", str(max(1, grace // 4)), "--drain-strategy", "immediate"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": k8s_mod._port_name(lst.name), "containerPort": lst.port} for lst in topo.listeners],
        "volumeMounts": [{"name": "xds", "mountPath": xds_dir, "readOnly": True}, *tls_mounts],
        # the HPA scales on CPU utilisation, relative to this request
        "resources": k8s_mod.RESOURCES["envoy"],
        "securityContext": k8s_mod._restricted(bind_low_ports=any(lst.port < 1024 for lst in topo.listeners)),
        "readinessProbe": {"tcpSocket": {"port": k8s_mod.served_listeners(topo)[0].port}, "periodSeconds": 5},
        "livenessProbe": k8s_mod.envoy_liveness(topo),
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
                    "topologySpreadConstraints": k8s_mod.spread(_selector(plan, "envoy")),
                    "initContainers": [init],
                    "containers": [envoy],
                    "volumes": [{"name": "topology", "configMap": {"name": f"{plan.base}-topology"}},
                                {"name": "xds", "emptyDir": {}},
                                {"name": "work", "emptyDir": {"sizeLimit": "16Mi"}}, *tls_volumes],
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
                           for lst in k8s_mod.served_listeners(topo)]},
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
