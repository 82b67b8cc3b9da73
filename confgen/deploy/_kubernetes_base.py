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
from ..model import Topology

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

def dns_label(text: str, limit: int = 63) -> str:
    """`text` as an RFC 1123 label starting with a letter (valid for every object kind,
    Services included): lowercased, anything but [a-z0-9-] mapped to '-', and cut to `limit`
    with a short hash of the original when too long (so two long names stay apart)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "x"
    if not slug[0].isalpha():
        slug = "x-" + slug
    if len(slug) > limit:
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        slug = slug[: limit - 9].rstrip("-") + "-" + digest
    return slug


def _port_name(name: str) -> str:
    """An IANA service name (Kubernetes port names): 1-15 of [a-z0-9-], a letter, no '--'."""
    slug = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]+", "-", name.lower())).strip("-")
    if slug == name and len(slug) <= 15 and re.search("[a-z]", slug) and slug != "metrics":
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
