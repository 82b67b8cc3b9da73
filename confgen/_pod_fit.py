"""What a Kubernetes render cannot do in a pod, shared by `render --target kubernetes` (which refuses or
warns) and `confgen validate` (which warns when the file writes a `kubernetes:` section).

Each function returns (field path, message) pairs; the callers give them a severity and pin them to the
file. Imports only the model, so the checks take it without a cycle.
"""

from __future__ import annotations

from ._names import object_base
from .model import Kubernetes, Topology, is_loopback_host, split_address

__all__ = ["DEFAULT_SIDECAR_IMAGE", "loopback_store", "unpublished_image"]

Finding = tuple[str, str]
DEFAULT_SIDECAR_IMAGE = Kubernetes().sidecar_image


def loopback_store(topo: Topology) -> list[Finding]:
    """A Redis on loopback is the pod itself in Kubernetes: none runs there, so every global limit would fail
    open (or, fail_closed, refuse everything)."""
    store = topo.limits.store
    if store is None:
        return []
    if store.sentinel is not None:
        return [(f"limits.store.sentinel.addresses[{i}]",
                 f"{a} is the pod's own loopback in Kubernetes, where no Sentinel runs: every global limit would "
                 "fail open. Name your Sentinels' Service") for i, a in enumerate(store.sentinel.addresses)
                if (parts := split_address(a)) is not None and is_loopback_host(parts[0])]
    if store.redis is None:
        return []
    parts = split_address(store.redis)
    if parts is None or not is_loopback_host(parts[0]):
        return []
    return [("limits.store.redis",
             f"{store.redis} is the pod's own loopback in Kubernetes, where no Redis runs: every global limit would "
             "fail open. Set kubernetes.redis: true and limits.store.redis: "
             f"{object_base(topo.name)}-redis:6379 (the rendered Redis), or name your Redis Service")]


def unpublished_image(topo: Topology) -> list[Finding]:
    """The default sidecar image is a placeholder: confgen's image is built from the repository, not pulled."""
    if topo.kubernetes.sidecar_image != DEFAULT_SIDECAR_IMAGE:
        return []
    return [("kubernetes.sidecar_image",
             f"{DEFAULT_SIDECAR_IMAGE} is not published on any registry: the pods will not start until you build "
             "sidecar/Dockerfile, push it, and set kubernetes.sidecar_image to it (or overlay `images:` with "
             "kustomize); docs/kubernetes.md, 'The image'")]
