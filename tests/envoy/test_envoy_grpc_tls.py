"""sidecar.grpc_tls: Envoy's mutual TLS to the sidecar's gRPC services (the endpoint picker, rate limits).

The confgen_sidecar_grpc cluster gets an UpstreamTlsContext (client certificate, CA, the server's
expected names) in the file render and in what the control plane serves over ADS, the real Envoy
accepts both (`envoy --mode validate`, with real certificate files), and validate refuses a
picker reached beyond loopback without it, at the place in the file that sends Envoy there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from confgen import envoy, parse_topology
from confgen.errors import Severity, TopologyError
from confgen.topology import load
from confgen.verify import verify_envoy
from tests.support.certs import CertAuthority

TOPO = """\
version: 1
name: pa
listeners: [{{name: main, port: 18080}}]
pools:
  - name: chat
    engine: vllm
    models: [m]
    balancing: {{policy: {policy}}}
    workers: ['10.0.0.1:8000', '10.0.0.2:8000']
{extra}"""

TLS = "  grpc_tls: {cert: /etc/tls/envoy.crt, key: /etc/tls/envoy.key, ca: /etc/tls/ca.crt}\n"


def _grpc_cluster(text: str) -> dict[str, Any]:
    topo, _ = parse_topology(text.encode())
    files = envoy.render(topo, config_dir="/etc/envoy")
    cds = json.loads(files[envoy.layout.CDS])["resources"]
    found: dict[str, Any] = {c["name"]: c for c in cds}["confgen_sidecar_grpc"]
    return found


def _findings(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    try:
        _, problems = load(path)
    except TopologyError as exc:
        return [str(d) for d in exc.diagnostics]
    return [str(p) for p in problems]


def test_file_render_has_mtls_to_the_sidecar() -> None:
    cluster = _grpc_cluster(TOPO.format(policy="prefix_affinity", extra="sidecar:\n  address: 10.0.0.9\n" + TLS))
    assert cluster["type"] == "STATIC"
    assert cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "10.0.0.9", "port_value": 9110}}
    socket = cluster["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    ctx = socket["typed_config"]["common_tls_context"]
    assert ctx["tls_certificates"] == [{"certificate_chain": {"filename": "/etc/tls/envoy.crt"},
                                        "private_key": {"filename": "/etc/tls/envoy.key"}}]
    assert ctx["validation_context"]["trusted_ca"] == {"filename": "/etc/tls/ca.crt"}
    assert ctx["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "10.0.0.9"}}]
    assert ctx["alpn_protocols"] == ["h2"]


def test_without_grpc_tls_the_cluster_is_the_sidecars_unix_socket() -> None:
    cluster = _grpc_cluster(TOPO.format(policy="prefix_affinity", extra=""))
    assert "transport_socket" not in cluster and cluster["type"] == "STATIC"
    (group,) = cluster["load_assignment"]["endpoints"]
    assert group["lb_endpoints"][0]["endpoint"]["address"] == {"pipe": {"path": "/tmp/confgen-pa/grpc.sock"}}
    plain = _grpc_cluster(TOPO.format(policy="prefix_affinity", extra="sidecar: {grpc_plaintext_loopback: true}\n"))
    (group,) = plain["load_assignment"]["endpoints"]  # the explicit opt-in: plaintext TCP on loopback
    assert group["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "127.0.0.1", "port_value": 9110}}


def test_ads_mode_calls_the_control_plane_with_mtls() -> None:
    extra = ("envoy:\n  xds:\n    mode: ads\n    servers: ['cp-0.cp.ns.svc:18000', 'cp-1.cp.ns.svc:18000']\n"
             "sidecar:\n  grpc_port: 9200\n" + TLS.replace("ca.crt}", "ca.crt, server_names: [cp.ns.svc]}"))
    topo, _ = parse_topology(TOPO.format(policy="prefix_affinity", extra=extra).encode())
    clusters = {c["name"]: c for c in envoy.ads_static_bootstrap(topo)["static_resources"]["clusters"]}
    cluster = clusters["confgen_sidecar_grpc"]
    assert cluster["type"] == "STRICT_DNS"
    assert [(g["priority"], g["lb_endpoints"][0]["endpoint"]["address"]["socket_address"])
            for g in cluster["load_assignment"]["endpoints"]] == [
        (0, {"address": "cp-0.cp.ns.svc", "port_value": 9200}), (1, {"address": "cp-1.cp.ns.svc", "port_value": 9200})]
    assert cluster["health_checks"][0]["tcp_health_check"] == {}
    ctx = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    assert ctx["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "cp.ns.svc"}}]


def test_validate_refuses_a_remote_picker_without_tls(tmp_path: Path) -> None:
    text = TOPO.format(policy="prefix_affinity", extra="sidecar:\n  address: 10.0.0.9\n")
    errors = _findings(tmp_path, text)
    assert any(":11:12: sidecar.address: " in e and "sidecar.grpc_tls" in e for e in errors), errors
    ads = TOPO.format(policy="prefix_affinity", extra="envoy:\n  xds:\n    mode: ads\n"
                      "    servers: ['127.0.0.1:18000', '10.0.0.7:18000']\n")
    errors = _findings(tmp_path, ads)
    assert any(":13:34: envoy.xds.servers[1]: " in e and "10.0.0.7:18000" in e and "sidecar.grpc_tls" in e
               for e in errors), errors
    # loopback (the default) needs no TLS; with grpc_tls a remote picker is fine
    assert not [e for e in _findings(tmp_path, TOPO.format(policy="prefix_affinity", extra="")) if "grpc" in e]
    ok = _findings(tmp_path, TOPO.format(policy="prefix_affinity", extra="sidecar:\n  address: 10.0.0.9\n" + TLS))
    assert not [e for e in ok if "grpc" in e], ok


def test_grpc_tls_without_a_grpc_service_is_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    path.write_text(TOPO.format(policy="least_request", extra="sidecar:\n" + TLS))
    _, problems = load(path)
    found = [p for p in problems if p.path == "sidecar.grpc_tls"]
    assert [p.severity for p in found] == [Severity.WARNING], problems


@pytest.mark.parametrize("ads", ["", "10.0.0.9:18000", "cp-0.cp.ns.svc:18000', 'cp-1.cp.ns.svc:18000"],
                         ids=["files", "ads-ip", "ads-dns"])
def test_envoy_accepts_the_tls_cluster(tmp_path: Path, ads: str) -> None:
    """`envoy --mode validate` loads the certificate files: real ones, from a throwaway CA."""
    ca = CertAuthority.create(tmp_path / "pki")
    client = ca.issue("pa-envoy", ["DNS:pa-envoy"])
    tls = f"  grpc_tls: {{cert: {client.cert}, key: {client.key}, ca: {ca.cert}}}\n"
    extra = "sidecar:\n  address: 10.0.0.9\n" + tls
    if ads:
        extra = (f"envoy:\n  xds:\n    mode: ads\n    servers: ['{ads}']\n"
                 f"    tls: {{cert: {client.cert}, key: {client.key}, ca: {ca.cert}}}\n" + "sidecar:\n" + tls)
    topo, _ = parse_topology(TOPO.format(policy="prefix_affinity", extra=extra).encode())
    assert verify_envoy(topo) == []
