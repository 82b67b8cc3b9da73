"""Kubernetes manifests for the sidecar mode: one proxy Deployment (init render + Envoy + sidecar).

Output (every file plain YAML from `yaml.safe_dump`, so no topology value changes structure):

    kubernetes.yaml       ConfigMap (topology), Deployment, Service, PodDisruptionBudget, HPAs
                          (+ ServiceMonitor, PrometheusRule, dashboard ConfigMap with kubernetes.monitoring)
    kustomization.yaml    the base, for overlays (`kubectl apply -k out/`)
    autoscaling/prometheus-adapter-rules.yaml   the adapter's external rule serving llm_queue_depth
    keda/kustomization.yaml + keda/kubernetes.yaml + keda/scaledobjects.yaml
                          a second base: the same objects with KEDA ScaledObjects instead of the pools' HPAs

The sidecar's gRPC services (the endpoint picker, the rate limit service) as the topology says
Envoy calls them: on the pod's Unix sockets (the default: a shared emptyDir), on its loopback in
plaintext (`sidecar.grpc_plaintext_loopback`: `--grpc-plaintext-loopback`), or over mutual TLS
(`sidecar.grpc_tls`): the Envoy container mounts the Secret <base>-envoy-tls where grpc_tls names
its files, the sidecar mounts <base>-sidecar-tls (cert-manager's tls.crt, tls.key, ca.crt) at
SIDECAR_TLS_DIR for its --grpc-tls-* flags. With mutual TLS, a picker pool and more than one proxy
pod, the pods' pickers are each other's peers (`pickers_peered`): a headless Service
<base>-pickers names every proxy pod, each sidecar listens on its pod's address and follows
`--picker-peer dns:<base>-pickers:<grpc_port>` (placements and in-flight counts, so a conversation
whose turns reach two pods still goes home); the sidecar certificate must then carry the name
<base>-pickers too (each peer checks it) and serve as a client certificate (clientAuth), and a
NetworkPolicy admits the gRPC port only from the proxy pods themselves.

Pod hardening meets Pod Security "restricted" on every container; the preStop hooks drain Envoy
(fail its health, drain listeners, wait for the streams) within terminationGracePeriodSeconds.
The pieces are small functions over a `_Plan` (names, labels) so another mode (an ADS control
plane, Envoy without sidecars) is an addition: it reuses `_restricted`, `_envoy_container`,
`_service`, `_pdb` and `_hpas` with its own Deployment.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Callable

from ..balancing import grpc_wanted, picker_wanted
from ..errors import DeployError
from ..model import Pool, Topology, admin_reach, grpc_socket_dir, grpc_transport, join_address
from . import _observability
from ._canonical import dump, topology_yaml
from ._kubernetes_ads import ads_objects, ads_problems
from ._kubernetes_base import (
    ADMIN_TOKEN_ENV,
    DRAINED_MARKER,
    HEADROOM,
    LIFECYCLE_DIR,
    RESOURCES,
    TOPOLOGY_DIR,
    WORK_DIR,
    XDS_DIR,
    Obj,
    _key_env,
    _key_files,
    _key_mounts,
    _Plan,
    _pod_security,
    _port_name,
    _restricted,
    _store_env,
    _token_env,
    dns_label,
    envoy_liveness,
    envoy_tls_mounts,
    object_base,
    served_listeners,
    sidecar_resources,
    spread,
)

__all__ = ["SIDECAR_TLS_DIR", "dns_label", "pickers_peered", "pickers_service", "render_kubernetes"]

SIDECAR_TLS_DIR = "/etc/confgen/sidecar-tls"  # the sidecar's own certificate (Secret <base>-sidecar-tls)


def pickers_peered(topo: Topology) -> bool:
    """Whether the render makes the proxy pods' pickers each other's peers: a pool on the endpoint
    picker, more than one proxy pod, and mutual TLS between the sidecars (sidecar.grpc_tls; peers
    reach each other beyond the pod, which nothing else may do)."""
    return picker_wanted(topo) and grpc_transport(topo) == "mtls" and topo.kubernetes.replicas > 1


def pickers_service(base: str) -> str:
    """The headless Service naming every proxy pod, which the pickers follow as their peers."""
    return f"{base}-pickers"


def _key_problems(plan: _Plan) -> list[tuple[str, str]]:
    problems = []
    seen: dict[str, str] = {}
    for index, path, entry in _key_files(plan):
        where = f"auth.api_keys[{index}].file"
        if not re.fullmatch(r"[-._a-zA-Z0-9]{1,253}", entry) or entry in (".", ".."):
            problems.append((where, f"{entry!r} cannot name an entry of the Secret {plan.keys_secret}"))
        elif seen.setdefault(path, entry) != entry:
            problems.append((where, f"{path} is mounted twice"))
    return problems


# -- the proxy pod --------------------------------------------------------------------------


def _grace_s(topo: Topology) -> int:
    return topo.kubernetes.termination_grace_seconds


def _envoy_container(plan: _Plan, bootstrap: str) -> Obj:
    topo = plan.topo
    grace = _grace_s(topo)
    # preStop: wait (bounded) until the sidecar's hook reports the drain done; Envoy gets
    # SIGTERM only after this returns. The envoy image has a POSIX shell and no HTTP client.
    wait = (f"i=0; while [ ! -e {DRAINED_MARKER} ] && [ $i -lt {grace - 5} ]; "
            "do sleep 1; i=$((i+1)); done")
    return {
        "name": "envoy",
        "image": topo.kubernetes.envoy_image,
        "args": ["-c", bootstrap, "--log-level", "info", "--drain-time-s", str(max(1, grace // 4)),
                 "--drain-strategy", "immediate"],
        "ports": [{"name": _port_name(lst.name), "containerPort": lst.port} for lst in topo.listeners],
        "volumeMounts": [
            {"name": "xds", "mountPath": XDS_DIR, "readOnly": True},
            {"name": "lifecycle", "mountPath": LIFECYCLE_DIR, "readOnly": True},
        ],
        "resources": RESOURCES["envoy"],
        "securityContext": _restricted(bind_low_ports=any(lst.port < 1024 for lst in topo.listeners)),
        # Envoy's own /ready (503 once health is failed for the drain), relayed by the sidecar:
        # the admin interface stays on the pod's loopback. The sidecar's port by number: the kubelet
        # resolves a named probe port in the probed container's own ports only (`metrics` is the sidecar
        # container's, so a name here left Envoy never Ready).
        "readinessProbe": {"httpGet": {"path": "/envoy/ready", "port": topo.sidecar.port},
                           "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": envoy_liveness(topo),
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", wait]}}},
    }


def _admin_url(topo: Topology) -> str:
    return f"http://{join_address(*admin_reach(topo))}"


def _sidecar_container(plan: _Plan, topology_file: str, mounts: list[Obj]) -> Obj:
    topo = plan.topo
    drain = ["python", "-m", "sidecar.drain", "--admin", _admin_url(topo),
             "--deadline", str(_grace_s(topo) - 10), "--marker", DRAINED_MARKER]
    return {
        "name": "sidecar",
        "image": topo.kubernetes.sidecar_image,
        # Bound on the pod's addresses: the kubelet's probes and Prometheus reach it there;
        # POST /drain and /undrain then need the token (off without kubernetes.admin_token_secret).
        # The program is named, not left to the image's ENTRYPOINT (an image built otherwise works).
        "command": ["confgen-sidecar"],
        # Each sidecar sees its own Envoy's in-flight requests: with N proxy pods each Envoy takes 1/N of the
        # shedding budget (README, Backpressure). ADS needs no flag (the control plane counts its Envoys).
        "args": ["--topology", topology_file, "--xds-dir", XDS_DIR, "--listen", f"0.0.0.0:{topo.sidecar.port}",
                 "--envoy-admin", _admin_url(topo),  # on the pod's loopback (the render's --admin-loopback)
                 "--ingresses", str(topo.kubernetes.replicas),
                 *(["--admin-token-env", ADMIN_TOKEN_ENV] if topo.kubernetes.admin_token_secret else []),
                 *_grpc_args(plan)],
        "workingDir": WORK_DIR,
        "ports": [{"name": "metrics", "containerPort": topo.sidecar.port}],
        "volumeMounts": [*mounts, {"name": "lifecycle", "mountPath": LIFECYCLE_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],  # noqa: S108 - an emptyDir of the pod
        "env": [*_key_env(plan), *_store_env(plan), *_token_env(plan)],
        "resources": sidecar_resources(topo),
        "securityContext": _restricted(),
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        # Fail Envoy's health, drain its listeners, wait for the streams; then tell Envoy's hook.
        "lifecycle": {"preStop": {"exec": {"command": drain}}},
    }


def _grpc_args(plan: _Plan) -> list[str]:
    """The sidecar's gRPC transport as the topology has Envoy call it (`grpc_transport`), and with
    `pickers_peered` its pod-wide listen and its peers, the headless Service's addresses."""
    topo = plan.topo
    if not grpc_wanted(topo):
        return []
    transport = grpc_transport(topo)
    if transport == "plaintext":
        return ["--grpc-plaintext-loopback"]
    if transport != "mtls":
        return []
    args = ["--grpc-tls-cert", f"{SIDECAR_TLS_DIR}/tls.crt", "--grpc-tls-key", f"{SIDECAR_TLS_DIR}/tls.key",
            "--grpc-client-ca", f"{SIDECAR_TLS_DIR}/ca.crt"]
    if pickers_peered(topo):
        port = topo.sidecar.grpc_port
        args += ["--grpc-listen", f"0.0.0.0:{port}", "--picker-peer", f"dns:{pickers_service(plan.base)}:{port}"]
    return args


def _mount_grpc_tls(plan: _Plan, envoy: Obj, sidecar: Obj, volumes: list[Obj]) -> None:
    """With mutual TLS to the sidecar's gRPC services: Envoy's client certificate where sidecar.grpc_tls
    names it, the sidecar's own at SIDECAR_TLS_DIR (the files `_grpc_args` gives its flags)."""
    topo = plan.topo
    if not grpc_wanted(topo) or grpc_transport(topo) != "mtls":
        return
    tls_volumes, tls_mounts = envoy_tls_mounts(plan)
    volumes += tls_volumes
    envoy["volumeMounts"] += tls_mounts
    volumes.append({"name": "sidecar-tls", "secret": {"secretName": f"{plan.base}-sidecar-tls", "defaultMode": 0o440}})
    sidecar["volumeMounts"].append({"name": "sidecar-tls", "mountPath": SIDECAR_TLS_DIR, "readOnly": True})
    if pickers_peered(topo):
        sidecar["ports"].append({"name": "grpc", "containerPort": topo.sidecar.grpc_port})


def _proxy_pods(plan: _Plan) -> dict[str, str]:
    """The proxy pods' labels to select them by (not the Redis or another component's pods)."""
    return {**plan.selector, "app.kubernetes.io/component": "proxy"}


def _pickers_objects(plan: _Plan) -> list[Obj]:
    """With `pickers_peered`: the headless Service the pickers resolve (every proxy pod, ready or
    starting: a new pod learns the placements before it takes traffic) and the NetworkPolicy that
    admits the gRPC port only from the proxy pods (the listeners and the metrics port as before)."""
    if not pickers_peered(plan.topo):
        return []
    topo = plan.topo
    port = topo.sidecar.grpc_port
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(pickers_service(plan.base), "proxy"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": _proxy_pods(plan),
                 "ports": [{"name": "grpc", "port": port, "targetPort": "grpc"}]},
    }
    open_ports = sorted({lst.port for lst in topo.listeners} | {topo.sidecar.port})
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": plan.meta(pickers_service(plan.base), "proxy"),
        "spec": {
            "podSelector": {"matchLabels": _proxy_pods(plan)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": p} for p in open_ports]},
                {"from": [{"podSelector": {"matchLabels": _proxy_pods(plan)}}],
                 "ports": [{"protocol": "TCP", "port": port}]},
            ],
        },
    }
    return [service, policy]


def _share_grpc_socket(topo: Topology, envoy: Obj, sidecar: Obj, volumes: list[Obj]) -> None:
    """Envoy calls the sidecar's gRPC services (picker, rate limits) on its Unix socket
    (sidecar.grpc_socket_dir) unless sidecar.grpc_tls says mTLS: both containers then mount one
    emptyDir at the socket directory's parent (the pod's tmp volume for the default /tmp/...), where
    the sidecar makes its 0700 directory; both run as the pod's user (runAsUser), so Envoy may enter."""
    if not grpc_wanted(topo) or grpc_transport(topo) != "unix":
        return
    parent = grpc_socket_dir(topo).rsplit("/", 1)[0] or "/"
    mounted = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    name = mounted.get(parent)
    if name is None:
        name = "grpc-sockets"
        volumes.append({"name": name, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}})
        sidecar["volumeMounts"].append({"name": name, "mountPath": parent})
    envoy["volumeMounts"].append({"name": name, "mountPath": parent})


def _deployment(plan: _Plan) -> Obj:
    topo = plan.topo
    k8s = topo.kubernetes
    topology_file = f"{TOPOLOGY_DIR}/topology.yaml"
    mounts: list[Obj] = [
        {"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True},
        {"name": "xds", "mountPath": XDS_DIR},
        {"name": "work", "mountPath": WORK_DIR},
        *_key_mounts(plan),
    ]
    volumes: list[Obj] = [
        {"name": "topology", "configMap": {"name": f"{plan.base}-topology"}},
        {"name": "xds", "emptyDir": {}},
        {"name": "lifecycle", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "work", "emptyDir": {"sizeLimit": "16Mi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    if _key_files(plan):
        volumes.append({"name": "api-keys", "secret": {"secretName": plan.keys_secret, "defaultMode": 0o400}})
    envoy = _envoy_container(plan, f"{XDS_DIR}/bootstrap.json")
    sidecar = _sidecar_container(plan, topology_file, mounts)
    _share_grpc_socket(topo, envoy, sidecar, volumes)
    _mount_grpc_tls(plan, envoy, sidecar, volumes)
    init = {
        "name": "render",
        "image": k8s.sidecar_image,
        # the pod's loopback is its own: Envoy's admin there, for the liveness probe and the sidecar
        "command": ["confgen", "render", topology_file, "-o", XDS_DIR, "--config-dir", XDS_DIR, "--admin-loopback"],
        "workingDir": WORK_DIR,
        "volumeMounts": mounts,
        "env": _key_env(plan),
        "resources": RESOURCES["render"],
        "securityContext": _restricted(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": plan.meta(plan.base, "proxy"),
        "spec": {
            "replicas": k8s.replicas,
            # name + instance (not the component): a Deployment's selector cannot change on upgrade, and its
            # ReplicaSets own their pods by reference, so the Redis pods beside it are never its own
            "selector": {"matchLabels": plan.selector},
            # never below the replica count during a rollout: a new pod first, then a drain
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": plan.labels("proxy"),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(topo.sidecar.port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "securityContext": _pod_security(),
                    "automountServiceAccountToken": False,
                    "topologySpreadConstraints": spread(_proxy_pods(plan)),
                    "initContainers": [init],
                    "containers": [envoy, sidecar],
                    "volumes": volumes,
                    "terminationGracePeriodSeconds": _grace_s(topo),
                },
            },
        },
    }


def _service(plan: _Plan) -> Obj:
    """The clients' Service: the listeners only (the sidecar's port is on its own Service)."""
    ports = [{"name": _port_name(lst.name), "port": lst.port, "targetPort": lst.port}
             for lst in served_listeners(plan.topo)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(plan.base, "proxy"),
        "spec": {"selector": _proxy_pods(plan), "ports": ports},
    }


def _metrics_service(plan: _Plan) -> Obj:
    """The sidecar's port (metrics, /envoy/stats, /state) for Prometheus, apart from the clients'
    Service: headless (Prometheus scrapes each pod), its own component label for the ServiceMonitor."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(f"{plan.base}-metrics", "metrics"),
        "spec": {"clusterIP": "None", "selector": _proxy_pods(plan),
                 "ports": [{"name": "metrics", "port": plan.topo.sidecar.port, "targetPort": "metrics"}]},
    }


def _pdb(plan: _Plan) -> Obj:
    # maxUnavailable 1: a node drain takes one proxy at a time, and never blocks with 1 replica.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": plan.meta(plan.base, "proxy"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _proxy_pods(plan)}},
    }


def _configmap(plan: _Plan) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": plan.meta(f"{plan.base}-topology", "proxy"),
        "data": {"topology.yaml": topology_yaml(plan.topo)},
    }


# -- autoscaling ----------------------------------------------------------------------------


def _scaled(topo: Topology) -> list[tuple[int, Pool]]:
    return [(i, p) for i, p in enumerate(topo.pools) if p.autoscale is not None]


def queue_query(pool: str | None = None, namespace: str | None = None) -> str:
    """The pool's queue: each worker counted once however many proxy replicas report it; only the series
    scraped in `namespace` when given (a same-named pool of another namespace, staging beside production,
    must not scale this one)."""
    labels = [f'{key}="{value}"' for key, value in (("pool", pool), ("namespace", namespace)) if value is not None]
    match = "{" + ",".join(labels) + "}" if labels else ""
    return f"sum by (pool) (max by (pool, worker) (llm_queue_depth{match}))"


# How fast the worker count may move, the same for the HPA and the KEDA overlay (KEDA's own default would
# scale down 100 % every 15 s after 5 minutes, cutting long generations): up 2 pods a minute at once, down one
# pod every two minutes after five minutes of less demand.
SCALE_BEHAVIOR: Obj = {
    "scaleUp": {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
    "scaleDown": {"stabilizationWindowSeconds": 300,
                  "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]},
}


def target_value(pool: Pool) -> float:
    assert pool.autoscale is not None
    return round(pool.autoscale.queue_depth_per_replica * (1 - HEADROOM), 3)


def _quantity(value: float) -> str:
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _scale_ref(pool: Pool) -> tuple[Obj, str]:
    assert pool.autoscale is not None
    kind, name = pool.autoscale.target.split("/", 1)
    ref = {"apiVersion": "apps/v1", "kind": "Deployment" if kind == "deployment" else "StatefulSet", "name": name}
    return ref, name


def _autoscalers(plan: _Plan, api_version: str, kind: str, spec: Callable[[Pool, Obj, str], Obj]) -> list[Obj]:
    """One autoscaler object per autoscaled pool, named after its scale target; `spec(pool, ref, name)`."""
    out = []
    for _, pool in _scaled(plan.topo):
        ref, name = _scale_ref(pool)
        out.append({
            "apiVersion": api_version,
            "kind": kind,
            "metadata": plan.meta(dns_label(f"{name}-queue", 253), "autoscaler", {"confgen.dev/pool": pool.name}),
            "spec": spec(pool, ref, name),
        })
    return out


def _hpas(plan: _Plan) -> list[Obj]:
    def spec(pool: Pool, ref: Obj, name: str) -> Obj:
        assert pool.autoscale is not None
        return {
            "scaleTargetRef": ref,
            "minReplicas": pool.autoscale.min_replicas,
            "maxReplicas": pool.autoscale.max_replicas,
            # llm_queue_depth{pool} is served by prometheus-adapter's external rule
            # (autoscaling/prometheus-adapter-rules.yaml): the pool's queue, each worker
            # once. AverageValue divides it by the current workers.
            "metrics": [{
                "type": "External",
                "external": {
                    "metric": {"name": "llm_queue_depth", "selector": {"matchLabels": {"pool": pool.name}}},
                    "target": {"type": "AverageValue", "averageValue": _quantity(target_value(pool))},
                },
            }],
            "behavior": copy.deepcopy(SCALE_BEHAVIOR),
        }
    return _autoscalers(plan, "autoscaling/v2", "HorizontalPodAutoscaler", spec)


def _adapter_rules(plan: _Plan) -> Obj:
    """prometheus-adapter's external rule for llm_queue_depth (merge into the adapter's rules)."""
    rule = {
        "seriesQuery": 'llm_queue_depth{namespace!="",pool!=""}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
        "name": {"matches": "^llm_queue_depth$", "as": "llm_queue_depth"},
        "metricsQuery": "sum by (pool) (max by (pool, worker) (<<.Series>>{<<.LabelMatchers>>}))",
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": plan.meta(f"{plan.base}-adapter-rules", "autoscaler"),
        "data": {"config.yaml": dump({"externalRules": [rule]})},
    }


def _scaled_objects(plan: _Plan) -> list[Obj]:
    def spec(pool: Pool, ref: Obj, name: str) -> Obj:
        assert pool.autoscale is not None
        return {
            "scaleTargetRef": {"apiVersion": ref["apiVersion"], "kind": ref["kind"], "name": name},
            "minReplicaCount": pool.autoscale.min_replicas,
            "maxReplicaCount": pool.autoscale.max_replicas,
            # the HPA KEDA makes moves like the one the base renders (cooldownPeriod acts only to and from zero)
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": copy.deepcopy(SCALE_BEHAVIOR)}},
            "triggers": [{
                "type": "prometheus",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": plan.topo.kubernetes.prometheus_url,
                    "query": queue_query(pool.name, plan.topo.kubernetes.namespace),
                    "threshold": repr(target_value(pool)),
                },
            }],
        }
    return _autoscalers(plan, "keda.sh/v1alpha1", "ScaledObject", spec)


def _keda_overlay(plan: _Plan) -> Obj:
    """The overlay's kustomization: its own copy of the base's objects without the pools' HPAs, and the
    ScaledObjects. It cannot name the base (`..`): kustomize refuses a root that contains the overlay
    ("cycle detected"), and a file above the overlay's root (LoadRestrictionsRootOnly)."""
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["kubernetes.yaml", "scaledobjects.yaml"],
    }


# -- the render -----------------------------------------------------------------------------


def _collisions(docs: list[Obj]) -> list[tuple[str, str]]:
    seen = Counter((d["kind"], d["metadata"]["name"]) for d in docs)
    out = [("pools", f"two {kind}s would be named {name!r} (autoscale.target used twice?)")
           for (kind, name), n in seen.items() if n > 1]
    for doc in docs:
        if doc["kind"] == "Service":
            ports = Counter(p["name"] for p in doc["spec"]["ports"])
            out += [("listeners", f"two ports of the Service would be named {name!r}")
                    for name, n in ports.items() if n > 1]
    return out


REDIS_PORT = 6379
REDIS_RUN_AS = 999  # the redis image's own user


def _redis_problems(plan: _Plan) -> list[tuple[str, str]]:
    """kubernetes.redis serves limits.store: the store must name the rendered Service."""
    topo = plan.topo
    if not topo.kubernetes.redis:
        return []
    store = topo.limits.store
    if store is None or store.redis is None:
        return [("kubernetes.redis", "there is no limits.store.redis for the rendered Redis to serve")]
    host = store.redis.rpartition(":")[0]
    name = f"{plan.base}-redis"
    if (host != name and not host.startswith(name + ".")) or not store.redis.endswith(f":{REDIS_PORT}"):
        return [("limits.store.redis", f"with kubernetes.redis the store is the rendered Service: write "
                 f"{name}:{REDIS_PORT} (or {name}.{topo.kubernetes.namespace}.svc:{REDIS_PORT})")]
    return []


def _redis_objects(plan: _Plan) -> list[Obj]:
    """One Redis for the global limits' counters: no persistence (a counter lives one window),
    memory bounded, reachable only from the proxy pods."""
    name = f"{plan.base}-redis"
    selector = {**plan.selector, "app.kubernetes.io/component": "redis"}
    password = _store_env(plan)  # limits.store.password_env: the same Secret entry the sidecars send
    container = {
        "name": "redis",
        "image": plan.topo.kubernetes.redis_image,
        "args": ["--save", "", "--appendonly", "no", "--maxmemory", "200mb", "--maxmemory-policy", "volatile-ttl",
                 "--protected-mode", "no",
                 # the kubelet expands $(NAME) from the container's env
                 *(["--requirepass", f"$({password[0]['name']})"] if password else [])],
        **({"env": password} if password else {}),
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "256Mi"}},
        "securityContext": _restricted(),
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": plan.meta(name, "redis"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": plan.labels("redis")},
                "spec": {
                    "securityContext": {**_pod_security(), "runAsUser": REDIS_RUN_AS, "runAsGroup": REDIS_RUN_AS,
                                        "fsGroup": REDIS_RUN_AS},
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {"sizeLimit": "64Mi"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": plan.meta(name, "redis"),
        "spec": {"selector": selector, "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}]},
    }
    # only the pods whose sidecars count in it talk to it: the proxy pods, or with ADS the control plane's
    counting = {**plan.selector, "app.kubernetes.io/component": "control-plane"} \
        if plan.topo.envoy.xds.mode == "ads" else _proxy_pods(plan)  # no version label: old pods keep Redis
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": plan.meta(name, "redis"),
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": counting}}],
                         "ports": [{"port": REDIS_PORT, "protocol": "TCP"}]}],
        },
    }
    return [deployment, service, policy]


def render_kubernetes(topo: Topology) -> dict[str, bytes]:
    """The manifests; DeployError (field path, reason) when the topology cannot be expressed."""
    plan = _Plan(topo, object_base(topo.name))
    hpas = _hpas(plan)
    if topo.envoy.xds.mode == "ads" and (unfit := ads_problems(plan)):
        raise DeployError(unfit)
    if topo.envoy.xds.mode == "ads":  # a control plane + Envoys without sidecars (an addition, its own module)

        docs = [_configmap(plan), *ads_objects(plan), *hpas]
        scraped = "control-plane"  # its Service carries the metrics port
    else:
        docs = [_configmap(plan), _deployment(plan), _service(plan), _metrics_service(plan), _pdb(plan),
                *_pickers_objects(plan), *hpas]
        scraped = "metrics"
    if topo.kubernetes.monitoring:
        docs += _observability.kubernetes_objects(
            plan.meta, plan.base, {**plan.selector, "app.kubernetes.io/component": scraped},
            dict(topo.kubernetes.monitoring_labels), relay=topo.envoy.xds.mode != "ads")
    redis_problems = _redis_problems(plan)
    if topo.kubernetes.redis and not redis_problems:
        docs += _redis_objects(plan)
    scaled = _scaled_objects(plan)
    problems = _key_problems(plan) + redis_problems + _collisions(docs) + _collisions(scaled)
    if problems:
        raise DeployError(problems)
    files = {
        "kubernetes.yaml": "---\n".join(dump(doc) for doc in docs).encode(),
        "kustomization.yaml": dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": ["kubernetes.yaml"],
        }).encode(),
    }
    if hpas:
        files["autoscaling/prometheus-adapter-rules.yaml"] = dump(_adapter_rules(plan)).encode()
        files["keda/scaledobjects.yaml"] = "---\n".join(dump(doc) for doc in scaled).encode()
        files["keda/kubernetes.yaml"] = "---\n".join(dump(doc) for doc in docs if doc not in hpas).encode()
        files["keda/kustomization.yaml"] = dump(_keda_overlay(plan)).encode()
    return files
