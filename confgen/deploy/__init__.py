"""Deployment targets: Kubernetes manifests and a Docker Compose file, from the same model.

Each proxy pod runs Envoy and the confgen sidecar side by side. The topology travels as a
ConfigMap; an init container renders the Envoy files into a shared emptyDir, the sidecar
keeps them current (health, weights, topology edits), and Envoy reads them. Per-pool HPAs
scale the workers on `llm_queue_depth`, the sidecar's autoscaling signal.
"""

from __future__ import annotations

from ._canonical import topology_yaml
from .compose import render_compose
from .kubernetes import render_kubernetes

__all__ = ["render_compose", "render_kubernetes", "topology_yaml"]
