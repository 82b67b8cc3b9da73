"""The Gateway API Inference Extension objects: InferencePools whose endpoint picker is confgen's.

Output (`render --target gateway-api`; plain YAML from `yaml.safe_dump`):

    gateway-api.yaml     ConfigMap <base>-epp-topology, Deployment + Service <base>-epp (the picker), one
                         InferencePool (inference.networking.k8s.io/v1) per pool with balancing.policy
                         prefix_affinity, and the HTTPRoute <base> sending the Gateway's traffic to them
    kustomization.yaml   the base (`kubectl apply -k out/`)

The picker is `confgen-sidecar` on its own, as the extension's EPP: it probes the pools' workers (health,
load, speed) and answers the gateway's ext_proc calls on sidecar.grpc_port over mutual TLS, like the ADS
control plane of `--target kubernetes` does for its Envoys. It publishes to no Envoy: `--serve-xds` on the
pod's loopback keeps the control-plane publisher (the one that needs no Envoy to confirm a write) and serves
nothing outside the pod. Its certificate, key and the CA that signs the gateway's client certificate come
from the Secret <base>-epp-tls (cert-manager's tls.crt, tls.key, ca.crt); the gateway must present a client
certificate signed by that CA (docs/kubernetes.md says how per gateway).

An InferencePool selects its pods by label (`pools[].pod_labels`) and their ports (the workers' ports); the
picker answers with the addresses it resolved from `pools[].workers` (the headless Service of the same
pods), so both must name the same pods. One pool: the route sends every request to it; several: each pool's
rule matches the `X-Gateway-Model-Name` header the extension's body-based router sets, and the default
pool (when it has the picker) takes the rest.
"""

from __future__ import annotations

import dataclasses

from ..balancing import AUTO, uses_picker
from ..errors import DeployError
from ..model import GrpcTls, Pool, Topology, split_address
from ._canonical import dump, topology_yaml
from ._kubernetes_base import (
    RESOURCES,
    SIDECAR_PORT,
    TOPOLOGY_DIR,
    WORK_DIR,
    Obj,
    _key_env,
    _key_files,
    _key_mounts,
    _Plan,
    _pod_security,
    _restricted,
    _store_env,
    dns_label,
    object_base,
)

__all__ = ["EPP_TLS_DIR", "MODEL_HEADER", "gateway_problems", "render_gateway_api"]

INFERENCE_API = "inference.networking.k8s.io/v1"
GATEWAY_GROUP = "gateway.networking.k8s.io"
EPP_TLS_DIR = "/etc/confgen/epp-tls"
LOCAL_XDS_PORT = 18000  # the publisher's ADS port, on the pod's loopback only (no Envoy connects to it)
MODEL_HEADER = "X-Gateway-Model-Name"  # what the extension's body-based router sets from the body's model
MAX_MATCHES = 8  # HTTPRoute: matches per rule
MAX_RULES = 16  # HTTPRoute: rules per route (the CRD's maxItems), and at most 128 matches in all
MAX_ROUTE_MATCHES = 128


def gateway_pools(topo: Topology) -> list[tuple[int, Pool]]:
    """The pools that become InferencePools: those on the endpoint picker, a pool on it by default
    (policy auto) only where it names its pods' labels (an InferencePool selects pods by label)."""
    return [(i, p) for i, p in enumerate(topo.pools)
            if uses_picker(topo, p) and (p.balancing.policy != AUTO or p.pod_labels)]


def _ports(pool: Pool) -> list[int]:
    ports: list[int] = []
    for worker in pool.workers:
        parts = split_address(worker.address)
        if parts is not None and parts[1] not in ports:
            ports.append(parts[1])
    return ports


def gateway_problems(topo: Topology) -> list[tuple[str, str]]:
    """What the gateway-api render cannot express (field path, reason): render refuses these."""
    picked = gateway_pools(topo)
    if not picked:
        return [("pools", "no pool has balancing.policy prefix_affinity: confgen's endpoint picker (the "
                 "InferencePool's) picks for those pools only")]
    problems = []
    if topo.kubernetes.gateway is None:
        problems.append(("kubernetes.gateway", "name the Gateway (in kubernetes.namespace) the HTTPRoute attaches to"))
    named: dict[str, int] = {}
    for i, pool in picked:
        other = named.setdefault(_pool_name(pool), i)
        if other != i:  # dns_label maps "_" to "-": the second object would replace the first
            problems.append((f"pools[{i}].name", f"its InferencePool would be named {_pool_name(pool)!r}, as "
                             f"pools[{other}]'s is ({topo.pools[other].name!r}): rename one"))
        if not pool.pod_labels:
            problems.append((f"pools[{i}].pod_labels", "an InferencePool selects its pods by label: give the labels "
                             "of this pool's worker pods (the ones its workers' headless Service selects)"))
        if len(_ports(pool)) > 8:
            problems.append((f"pools[{i}].workers", "an InferencePool has at most 8 target ports"))
        if len(picked) > 1 and len(pool.served_names) > MAX_MATCHES:
            problems.append((f"pools[{i}].models", f"an HTTPRoute rule matches at most {MAX_MATCHES} model names "
                             f"({MODEL_HEADER}); this pool serves {len(pool.served_names)}"))
    if len(picked) > 1:
        rules = len(picked) + (1 if any(p.name == topo.default_pool for _, p in picked) else 0)
        matches = sum(len(p.served_names) for _, p in picked) + (rules - len(picked))
        if rules > MAX_RULES or matches > MAX_ROUTE_MATCHES:
            problems.append(("pools", f"the HTTPRoute would have {rules} rules and {matches} matches; the Gateway "
                             f"API allows {MAX_RULES} rules and {MAX_ROUTE_MATCHES} matches in one route: put "
                             "fewer pools on the picker in this topology, or split it"))
    if topo.envoy.xds.mode == "ads":
        problems.append(("envoy.xds.mode", "the gateway's picker runs on its own (render --target gateway-api); "
                         "with mode ads the control plane of --target kubernetes already serves the picker"))
    return problems


def _epp_topology(topo: Topology) -> Topology:
    """The picker's own topology: the gateway calls it over mutual TLS (the Secret mounted at
    EPP_TLS_DIR), so its sidecar.grpc_tls names those files unless the topology set its own."""
    if topo.sidecar.grpc_tls is not None:
        return topo
    tls = GrpcTls(cert=f"{EPP_TLS_DIR}/tls.crt", key=f"{EPP_TLS_DIR}/tls.key", ca=f"{EPP_TLS_DIR}/ca.crt")
    return dataclasses.replace(topo, sidecar=dataclasses.replace(topo.sidecar, grpc_tls=tls))


def _epp(plan: _Plan) -> list[Obj]:
    topo = plan.topo
    name = f"{plan.base}-epp"
    grpc_port = topo.sidecar.grpc_port
    topology_file = f"{TOPOLOGY_DIR}/topology.yaml"
    selector = {**plan.selector, "app.kubernetes.io/component": "epp"}
    container = {
        "name": "epp",
        "image": topo.kubernetes.sidecar_image,
        "command": ["confgen-sidecar"],
        "args": ["--topology", topology_file,
                 # the publisher that needs no Envoy, on the pod's loopback: nothing outside the pod reaches it
                 "--serve-xds", f"127.0.0.1:{LOCAL_XDS_PORT}",
                 "--listen", f"0.0.0.0:{SIDECAR_PORT}",
                 "--grpc-listen", f"0.0.0.0:{grpc_port}",
                 "--grpc-tls-cert", f"{EPP_TLS_DIR}/tls.crt", "--grpc-tls-key", f"{EPP_TLS_DIR}/tls.key",
                 "--grpc-client-ca", f"{EPP_TLS_DIR}/ca.crt"],
        # TODO: a gateway sends the protocol's subset hint (the pool's endpoints as it sees them); once the
        # picker's flag that makes it honour the hint is on main, this path is the one that turns it on.
        "workingDir": WORK_DIR,
        "ports": [{"name": "grpc", "containerPort": grpc_port}, {"name": "metrics", "containerPort": SIDECAR_PORT}],
        "volumeMounts": [{"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True},
                         {"name": "work", "mountPath": WORK_DIR},
                         {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - an emptyDir of the pod
                         {"name": "epp-tls", "mountPath": EPP_TLS_DIR, "readOnly": True},
                         *_key_mounts(plan)],
        "env": [*_key_env(plan), *_store_env(plan)],
        "resources": RESOURCES["sidecar"],
        "securityContext": _restricted(),
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10,
                          "failureThreshold": 6},
    }
    volumes: list[Obj] = [
        {"name": "topology", "configMap": {"name": f"{name}-topology"}},
        {"name": "work", "emptyDir": {"sizeLimit": "16Mi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
        # cert-manager's Certificate output; renewed in place, re-read on the next handshake
        {"name": "epp-tls", "secret": {"secretName": f"{name}-tls", "defaultMode": 0o400}},
    ]
    if _key_files(plan):
        volumes.append({"name": "api-keys", "secret": {"secretName": plan.keys_secret, "defaultMode": 0o400}})
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": plan.meta(f"{name}-topology", "epp"),
                 "data": {"topology.yaml": topology_yaml(_epp_topology(topo))}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": plan.meta(name, "epp"),
        "spec": {
            # one picker: its prefix index is its own, a second replica would halve every pool's hits
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": plan.labels("epp"), "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(SIDECAR_PORT),
                    "prometheus.io/path": "/metrics"}},
                "spec": {
                    "securityContext": _pod_security(),
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": volumes,
                    "terminationGracePeriodSeconds": 10,  # the gateway fails open meanwhile
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(name, "epp"),
        "spec": {"selector": selector,
                 "ports": [{"name": "grpc", "port": grpc_port, "targetPort": "grpc"},
                           {"name": "metrics", "port": SIDECAR_PORT, "targetPort": "metrics"}]},
    }
    return [configmap, deployment, service]


def _pool_name(pool: Pool) -> str:
    return dns_label(pool.name, 253)


def _inference_pool(plan: _Plan, pool: Pool) -> Obj:
    return {
        "apiVersion": INFERENCE_API,
        "kind": "InferencePool",
        "metadata": plan.meta(_pool_name(pool), "inference-pool", {"confgen.dev/pool": dns_label(pool.name)}),
        "spec": {
            "selector": {"matchLabels": dict(pool.pod_labels)},
            "targetPorts": [{"number": port} for port in _ports(pool)],
            "endpointPickerRef": {
                "group": "", "kind": "Service", "name": f"{plan.base}-epp",
                "port": {"number": plan.topo.sidecar.grpc_port},
                # as the render's own Envoy: a picker down costs no request, the gateway balances meanwhile
                "failureMode": "FailOpen",
            },
        },
    }


def _backend(pool: Pool) -> Obj:
    return {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": _pool_name(pool)}


def _route(plan: _Plan) -> Obj:
    topo = plan.topo
    picked = [p for _, p in gateway_pools(topo)]
    everything = [{"path": {"type": "PathPrefix", "value": "/"}}]
    if len(picked) == 1:
        rules = [{"matches": everything, "backendRefs": [_backend(picked[0])]}]
    else:
        rules = [{"matches": [{"path": {"type": "PathPrefix", "value": "/"},
                               "headers": [{"type": "Exact", "name": MODEL_HEADER, "value": name}]}
                              for name in pool.served_names],
                  "backendRefs": [_backend(pool)]} for pool in picked]
        default = next((p for p in picked if p.name == topo.default_pool), None)
        if default is not None:
            rules.append({"matches": everything, "backendRefs": [_backend(default)]})
    assert topo.kubernetes.gateway is not None  # gateway_problems
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1",
        "kind": "HTTPRoute",
        "metadata": plan.meta(plan.base, "route"),
        "spec": {"parentRefs": [{"group": GATEWAY_GROUP, "kind": "Gateway", "name": topo.kubernetes.gateway}],
                 "rules": rules},
    }


def render_gateway_api(topo: Topology) -> dict[str, bytes]:
    """The InferencePools, their HTTPRoute and the picker; DeployError (field path, reason) when the topology
    cannot be expressed."""
    if problems := gateway_problems(topo):
        raise DeployError(problems)
    plan = _Plan(topo, object_base(topo.name))
    docs = [*_epp(plan), *(_inference_pool(plan, p) for _, p in gateway_pools(topo)), _route(plan)]
    return {
        "gateway-api.yaml": "---\n".join(dump(doc) for doc in docs).encode(),
        "kustomization.yaml": dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                    "resources": ["gateway-api.yaml"]}).encode(),
    }
