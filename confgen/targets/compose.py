"""The Docker Compose target: Envoy and the sidecar side by side, for one machine."""

from __future__ import annotations

from collections.abc import Mapping

from ..model import Topology
from . import Finding, Target


def _render(topo: Topology, config_dir: str, secrets: Mapping[str, str] | None) -> dict[str, bytes]:
    from ..deploy import render_compose

    return render_compose(topo)


def _refusals(topo: Topology) -> list[Finding]:
    """The Compose file runs one Envoy beside its sidecar, which writes the xDS files that Envoy reads;
    on one host Envoy calls the sidecar's gRPC services on its Unix socket or its loopback, not over
    mutual TLS (whose certificates the Compose file has no place for)."""
    from ..balancing import grpc_wanted

    if topo.envoy.xds.mode == "ads":
        return [("envoy.xds.mode", "the compose target runs one Envoy beside its sidecar on the xDS files: use "
                 "mode files (ADS serves many Envoys from a control plane: the kubernetes target renders that)")]
    if topo.sidecar.grpc_tls is not None and grpc_wanted(topo):
        return [("sidecar.grpc_tls", "the compose target runs Envoy and the sidecar on one host, where Envoy calls "
                 "the sidecar's gRPC services on its Unix socket (the default) or on loopback "
                 "(sidecar.grpc_plaintext_loopback): remove grpc_tls for it (the kubernetes target mounts the "
                 "certificates mutual TLS needs)")]
    return []


# The Compose file references the keys (an env file); no key is read.
TARGET = Target(name="compose", render=_render, refusals=_refusals, needs_keys=lambda _: False)
