"""What the Kubernetes renderers share: paths, ports, sizing, names, the per-render plan, and the
restricted security contexts and key mounts every pod uses.

`kubernetes.py` (the proxy Deployment and what goes with it) and `_kubernetes_ads.py` (the
control plane and its Envoys in ADS mode) both build on this module and never on each other.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from .. import __version__
from .._names import dns_label as dns_label  # re-exported: the renders name objects with it
from .._names import object_base as object_base
from ..limits import needs_store
from ..model import Listener, Topology, admin_reach, grpc_tls, is_loopback_host

TOPOLOGY_DIR = "/etc/confgen/topology"
XDS_DIR = "/var/run/confgen/envoy"
LIFECYCLE_DIR = "/var/run/confgen/lifecycle"  # the drain hand-off between the two preStop hooks
WORK_DIR = "/var/run/confgen/work"  # render/sidecar working directory (relative key files live under it)
DRAINED_MARKER = f"{LIFECYCLE_DIR}/envoy-drained"
SIDECAR_PORT = 9109
ADMIN_TOKEN_ENV = "CONFGEN_SIDECAR_ADMIN_TOKEN"  # noqa: S105 - a variable name, not a token
RUN_AS = 101  # the envoy image's user; the sidecar image runs as any uid
# Autoscaling target: the HPA aims at 80 % of the queue a worker may hold, 20 % headroom for the
# time a new worker takes to start while the queue keeps growing (see docs/kubernetes.md).
HEADROOM = 0.2

# Sizing (docs/kubernetes.md): Envoy ~0.5 core per 1,000 req/s of streamed completions; the
# sidecar ~0.35 core and 70 MB per 1,000 endpoints at the default 2 s interval (bench: 0.68
# core at 1 s); the render step is one short Python process.
RESOURCES: dict[str, dict[str, dict[str, str]]] = {
    "envoy": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
    "sidecar": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
    "render": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "256Mi"}},
}

Obj = dict[str, Any]

# Port names confgen gives its own ports (a listener of the same name would be the port a Service's
# targetPort finds first in the pod: the pickers' Service reaching Envoy's listener).
RESERVED_PORT_NAMES = frozenset({"metrics", "grpc", "xds", "redis"})


def served_listeners(topo: Topology) -> list[Listener]:
    """The listeners other pods can reach: one bound to loopback answers only inside its own pod, so a Service
    port or a probe on it would never connect (all of them when every listener is loopback: a Service needs a
    port)."""
    reachable = [lst for lst in topo.listeners if not is_loopback_host(lst.address)]
    return reachable or list(topo.listeners)


def _port_name(name: str) -> str:
    """An IANA service name (Kubernetes port names): 1-15 of [a-z0-9-], a letter, no '--'; never one of
    RESERVED_PORT_NAMES (then a slug and a digest, as for a name that is not one)."""
    slug = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]+", "-", name.lower())).strip("-")
    if slug == name and len(slug) <= 15 and re.search("[a-z]", slug) and slug not in RESERVED_PORT_NAMES:
        return slug
    digest = hashlib.sha256(name.encode()).hexdigest()[:4]
    return f"{slug[:8].strip('-')}-{digest}".lstrip("-") if re.search("[a-z]", slug[:8]) else f"l-{digest}"


@dataclass(frozen=True)
class _Plan:
    topo: Topology
    base: str  # confgen-<topology name>, a DNS label

    @property
    def namespace(self) -> str:
        return self.topo.kubernetes.namespace

    @property
    def selector(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": "confgen", "app.kubernetes.io/instance": self.base}

    def labels(self, component: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {
            **self.selector,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": self.base,
            "app.kubernetes.io/version": __version__,
            "app.kubernetes.io/managed-by": "confgen",
            **(extra or {}),
        }

    def meta(self, name: str, component: str, extra: dict[str, str] | None = None) -> Obj:
        return {"name": name, "namespace": self.namespace, "labels": self.labels(component, extra)}

    @property
    def keys_secret(self) -> str:
        return self.topo.kubernetes.keys_secret or f"{self.base}-api-keys"


def _restricted(*, read_only_root: bool = True, bind_low_ports: bool = False) -> Obj:
    """A container securityContext that meets Pod Security "restricted"."""
    caps: Obj = {"drop": ["ALL"]}
    if bind_low_ports:
        caps["add"] = ["NET_BIND_SERVICE"]  # the only capability "restricted" allows
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": caps,
        "readOnlyRootFilesystem": read_only_root,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# -- keys -----------------------------------------------------------------------------------


def _key_env(plan: _Plan) -> list[Obj]:
    """Environment keys: one secretKeyRef per auth.api_keys[].env (the entry named like the variable)."""
    auth = plan.topo.auth
    return [
        {"name": k.env, "valueFrom": {"secretKeyRef": {"name": plan.keys_secret, "key": k.env}}}
        for k in (auth.api_keys if auth else [])
        if k.env is not None
    ]


def _store_env(plan: _Plan) -> list[Obj]:
    """The Redis password of limits.store.password_env, for the containers that count (the sidecars, the
    control plane): from the keys Secret's entry named like the variable, as the API keys' are."""
    limits = plan.topo.limits
    store = limits.store if limits is not None else None
    if store is None or store.password_env is None:
        return []
    name = store.password_env
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": plan.keys_secret, "key": name}}}]


def _token_env(plan: _Plan) -> list[Obj]:
    secret = plan.topo.kubernetes.admin_token_secret
    if secret is None:
        return []
    return [{"name": ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}}]


def _key_files(plan: _Plan) -> list[tuple[int, str, str]]:
    """(index, mount path, Secret entry) per file key: the entry is the file's name, as
    `kubectl create secret generic --from-file=<path>` names it."""
    auth = plan.topo.auth
    out = []
    for index, key in enumerate(auth.api_keys if auth else []):
        if key.file is None:
            continue
        path = posixpath.normpath(posixpath.join(WORK_DIR, key.file))
        out.append((index, path, posixpath.basename(path)))
    return out


def _key_mounts(plan: _Plan) -> list[Obj]:
    return [
        {"name": "api-keys", "mountPath": path, "subPath": entry, "readOnly": True}
        for _, path, entry in _key_files(plan)
    ]


def envoy_tls_mounts(plan: _Plan) -> tuple[list[Obj], list[Obj]]:
    """The Envoys' certificate Secret <base>-envoy-tls (cert-manager's entries): one volume whose entries
    take the file names sidecar.grpc_tls gives, mounted at each directory it names; (volumes, mounts)."""
    tls = grpc_tls(plan.topo)
    assert tls is not None  # only called with mutual TLS
    items = [{"key": key, "path": posixpath.basename(path)}
             for key, path in (("tls.crt", tls.cert), ("tls.key", tls.key), ("ca.crt", tls.ca))]
    volume = {"name": "envoy-tls", "secret": {"secretName": f"{plan.base}-envoy-tls", "defaultMode": 0o440,
                                              "items": items}}
    dirs = sorted({posixpath.dirname(p) for p in (tls.cert, tls.key, tls.ca)})
    return [volume], [{"name": "envoy-tls", "mountPath": d, "readOnly": True} for d in dirs]


def envoy_liveness(topo: Topology) -> Obj:
    """Envoy answers its admin's GET /server_info within 4 s (its main thread lives; also while
    draining, unlike /ready). Asked from inside the container: the admin stays on the pod's
    loopback and the envoy image has bash (/dev/tcp) but no HTTP client; the sidecar's relay
    would tie Envoy's restarts to the sidecar's. tests/deploy/test_probes_live.py runs it."""
    host, port = admin_reach(topo)
    request = "GET /server_info HTTP/1.1\\r\\nHost: envoy-admin\\r\\nConnection: close\\r\\n\\r\\n"
    script = (f"exec 3<>/dev/tcp/{host}/{port} && printf '{request}' >&3 && "
              "read -r -t 4 status <&3 && case \"$status\" in 'HTTP/1.1 200'*) exit 0;; esac; exit 1")
    return {"exec": {"command": ["/bin/bash", "-c", script]},
            "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}


def spread(selector: dict[str, str]) -> list[Obj]:
    """Replicas spread over zones, then nodes, as evenly as the cluster allows (ScheduleAnyway:
    a one-node or one-zone cluster still schedules them): one node or zone lost takes one
    replica's share, not the whole Service."""
    return [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": selector}}
            for key in ("topology.kubernetes.io/zone", "kubernetes.io/hostname")]


def sidecar_resources(topo: Topology) -> dict[str, dict[str, str]]:
    """With global limits the sidecar answers Envoy's rate limit check on every request (measured:
    about 0.5-1 ms of CPU per check in Python's gRPC): half a core requested, a whole one allowed.
    The same for the control plane of mode ads, which answers every Envoy's checks."""
    if not needs_store(topo):
        return RESOURCES["sidecar"]
    return {"requests": {**RESOURCES["sidecar"]["requests"], "cpu": "500m"}, "limits": RESOURCES["sidecar"]["limits"]}
