"""Render and validate with `envoy.xds.mode: ads`: a bootstrap that takes everything over ADS."""

from __future__ import annotations

import json
from typing import Any

import pytest

from confgen import envoy, parse_topology
from confgen.errors import TopologyError
from confgen.runtime import validate_envoy_static
from confgen.verify import verify_envoy

BASE = """\
version: 1
name: fleet
listeners: [{name: public, port: 8080}]
pools:
  - name: chat
    engine: vllm
    models: [m]
    workers: ["10.0.0.1:8000", "10.0.0.2:8000"]
  - name: big
    engine: vllm
    models: [b]
    fallback: chat
    workers: ["10.0.1.1:8000"]
"""
# TCP to the servers: plaintext on loopback, by the explicit opt-in (the default is a Unix socket)
ADS = BASE + ('sidecar: {grpc_plaintext_loopback: true}\n'
              'envoy:\n  xds: {mode: ads, servers: ["127.0.0.1:18000", "localhost:18000"]%s}\n')


def _walk(node: Any) -> Any:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def test_ads_bootstrap_takes_everything_over_ads_and_nothing_from_files() -> None:
    """Mode ads renders the bootstrap only: ADS to a static HTTP/2 cluster of the servers, CDS/LDS/RTDS over
    ADS, no path_config_source anywhere; delta is the default protocol, sotw selectable."""
    topo, _ = parse_topology((ADS % "").encode())
    files = envoy.render(topo, config_dir="/etc/envoy")
    assert set(files) == {"bootstrap.json"}
    boot = json.loads(files["bootstrap.json"])
    assert not [k for k, _ in _walk(boot) if k == "path_config_source"]
    dyn = boot["dynamic_resources"]
    assert dyn["ads_config"]["api_type"] == "DELTA_GRPC"
    assert dyn["ads_config"]["grpc_services"][0]["envoy_grpc"]["cluster_name"] == envoy.ads.ADS_CLUSTER
    assert dyn["cds_config"]["ads"] == {} and dyn["lds_config"]["ads"] == {}
    (cluster,) = boot["static_resources"]["clusters"]
    assert cluster["type"] == "STRICT_DNS"  # one server is a DNS name
    hosts = [(g["priority"], g["lb_endpoints"][0]["endpoint"]["address"]["socket_address"])
             for g in cluster["load_assignment"]["endpoints"]]
    # primary and standby: every Envoy follows the first healthy server
    assert hosts == [(0, {"address": "127.0.0.1", "port_value": 18000}),
                     (1, {"address": "localhost", "port_value": 18000})]
    http2 = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in http2["explicit_http_config"]
    rtds = [layer for layer in boot["layered_runtime"]["layers"] if "rtds_layer" in layer]
    assert rtds and rtds[0]["rtds_layer"]["rtds_config"]["ads"] == {}
    assert validate_envoy_static(boot) == []  # the real Envoy accepts the bootstrap as rendered

    sotw, _ = parse_topology((ADS % ", protocol: sotw").encode())
    assert json.loads(envoy.render(sotw, config_dir="/x")["bootstrap.json"])["dynamic_resources"][
        "ads_config"]["api_type"] == "GRPC"


def test_ads_resources_use_ads_for_eds_and_validate_with_the_real_envoy() -> None:
    """The served clusters take EDS over ADS; `validate --envoy` checks the bootstrap and the inlined resources,
    and a resource Envoy refuses is reported."""
    topo, _ = parse_topology((ADS % "").encode())
    served = envoy.ads.resources(topo, {})
    chat = next(c for c in served.clusters if c["name"] == "chat")
    assert chat["eds_cluster_config"]["eds_config"] == {"resource_api_version": "V3", "ads": {}}
    assert set(served.assignments) == {"chat", "big"}
    assert verify_envoy(topo) == []
    boot = envoy.ads_static_bootstrap(topo)
    boot["static_resources"]["clusters"][0]["lb_policy"] = "NOT_A_POLICY"
    assert validate_envoy_static(boot)  # the inlined resources really are what Envoy checks


def test_files_mode_is_the_default_and_unchanged() -> None:
    """Without envoy.xds the output is the file tree (bootstrap, LDS, CDS, one EDS file per pool)."""
    topo, _ = parse_topology(BASE.encode())
    assert topo.envoy.xds.mode == "files"
    files = envoy.render(topo, config_dir="/etc/envoy")
    assert set(files) == {"bootstrap.json", "lds.json", "cds.json", "eds/chat/endpoints.json",
                          "eds/big/endpoints.json"}


@pytest.mark.parametrize(("xds", "needle"), [
    ("{mode: ads}", "envoy.xds.servers: mode ads needs at least one"),
    ('{mode: ads, servers: ["nope"]}', "envoy.xds.servers[0]"),
    ('{mode: ads, servers: ["a:1", "a:1"]}', "listed twice"),
    ('{mode: ads, servers: ["a:99999"]}', "not host:port"),
])
def test_bad_xds_settings_are_refused_with_their_path(xds: str, needle: str) -> None:
    """Mode ads without servers, malformed or duplicated servers: errors naming envoy.xds.servers."""
    with pytest.raises(TopologyError) as info:
        parse_topology((BASE + f"envoy:\n  xds: {xds}\n").encode())
    assert needle in "\n".join(str(d) for d in info.value.diagnostics)


def test_pool_named_like_the_control_plane_cluster_is_refused_in_ads_mode() -> None:
    """confgen_xds is the bootstrap's own cluster in mode ads: a pool of that name would collide."""
    text = (ADS % "").replace("name: chat", "name: confgen_xds").replace("fallback: chat", "fallback: confgen_xds")
    with pytest.raises(TopologyError) as info:
        parse_topology(text.encode())
    assert "confgen_xds" in "\n".join(str(d) for d in info.value.diagnostics)


def test_ads_defaults_to_the_control_planes_unix_socket() -> None:
    """Without sidecar.grpc_tls or the plaintext opt-in, the bootstrap's control plane is a pipe to
    <sidecar.grpc_socket_dir>/xds.sock (the real Envoy accepts it); servers beyond loopback then need TLS."""
    text = BASE + ('sidecar: {grpc_socket_dir: /run/confgen-fleet}\n'
                   'envoy:\n  xds: {mode: ads, servers: ["127.0.0.1:18000"]}\n')
    topo, _ = parse_topology(text.encode())
    boot = json.loads(envoy.render(topo, config_dir="/etc/envoy")["bootstrap.json"])
    (cluster,) = boot["static_resources"]["clusters"]
    (group,) = cluster["load_assignment"]["endpoints"]
    assert group["lb_endpoints"][0]["endpoint"]["address"] == {"pipe": {"path": "/run/confgen-fleet/xds.sock"}}
    assert "transport_socket" not in cluster
    assert validate_envoy_static(boot) == []
    with pytest.raises(TopologyError) as info:
        parse_topology(text.replace("127.0.0.1:18000", "10.1.0.1:18000").encode())
    found = "\n".join(str(d) for d in info.value.diagnostics)
    assert "envoy.xds.servers[0]: 10.1.0.1:18000 is beyond loopback" in found
