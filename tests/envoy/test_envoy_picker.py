"""policy prefix_affinity in the Envoy render: the picker's filter, cluster and LB policy,
accepted by the real Envoy (file and ADS output), and the picker's view of the routes."""

from __future__ import annotations

import json

import pytest

from confgen import envoy, parse_topology
from confgen.verify import verify_envoy
from sidecar.outputs.picker import routes

TOPO = """
version: 1
name: pa
listeners: [{name: main, port: 18080}]
default_pool: chat
pools:
  - name: chat
    engine: vllm
    models: [m]
    aliases: [m-alias]
    balancing: {policy: prefix_affinity, choice_count: 3}
    workers: ['10.0.0.1:8000', '10.0.0.2:8000']
  - name: other
    engine: vllm
    models: [o]
    balancing: {policy: least_request}
    workers: ['10.0.0.3:8000']
"""


def _render(text: str) -> tuple[list[dict], list[dict]]:  # type: ignore[type-arg]
    topo, _ = parse_topology(text.encode())
    files = envoy.render(topo, config_dir="/etc/envoy")
    return (json.loads(files[envoy.layout.LDS])["resources"], json.loads(files[envoy.layout.CDS])["resources"])


def test_the_pool_uses_override_host_with_least_request_as_fallback() -> None:
    lds, cds = _render(TOPO)
    clusters = {c["name"]: c for c in cds}
    chat, other = clusters["chat"], clusters["other"]
    assert "lb_policy" not in chat and other["lb_policy"] == "LEAST_REQUEST"
    policy = chat["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    cfg = policy["typed_config"]
    assert {"header": "x-gateway-destination-endpoint"} in cfg["override_host_sources"]
    fallback = cfg["fallback_policy"]["policies"][0]["typed_extension_config"]
    assert fallback["name"] == "envoy.load_balancing_policies.least_request"
    assert fallback["typed_config"]["choice_count"] == 3
    grpc = clusters["confgen_sidecar_grpc"]
    assert grpc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "pipe": {"path": "/tmp/confgen-pa/grpc.sock"}}  # the sidecar's Unix socket (the default transport)
    filters = lds[0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    names = [f["name"] for f in filters]
    assert names[-2:] == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    wrapper = filters[-2]["typed_config"]
    # skipped for the runtime share of requests the sidecar sends past a picker that cannot keep up
    assert wrapper["@type"].endswith("extensions.common.matching.v3.ExtensionWithMatcher")
    (matcher,) = wrapper["xds_matcher"]["matcher_list"]["matchers"]
    fraction = matcher["predicate"]["single_predicate"]["custom_match"]["typed_config"]["runtime_fraction"]
    assert fraction == {"default_value": {"numerator": 0, "denominator": "HUNDRED"},
                        "runtime_key": "confgen.picker.bypass"}
    assert matcher["predicate"]["single_predicate"]["input"]["typed_config"]["header_name"] == "x-request-id"
    assert matcher["on_match"]["action"]["typed_config"]["@type"].endswith("matcher.action.v3.SkipFilter")
    assert wrapper["extension_config"]["name"] == "envoy.filters.http.ext_proc"
    ext = wrapper["extension_config"]["typed_config"]
    assert ext["failure_mode_allow"] is True and ext["message_timeout"] == "0.2s"
    assert ext["grpc_service"]["envoy_grpc"]["cluster_name"] == "confgen_sidecar_grpc"
    assert ext["processing_mode"]["request_header_mode"] == "SEND"  # holds the headers until the pick
    removed = [m["remove"] for m in filters[0]["typed_config"]["mutations"]["request_mutations"]]
    assert "x-gateway-destination-endpoint" in removed  # before anything reads it


def test_without_prefix_affinity_nothing_of_the_picker_is_rendered() -> None:
    lds, cds = _render(TOPO.replace("policy: prefix_affinity, ", "policy: least_request, "))
    assert "confgen_sidecar_grpc" not in {c["name"] for c in cds}
    text = json.dumps(lds)
    assert "ext_proc" not in text and "x-gateway-destination-endpoint" not in text


@pytest.mark.parametrize("ads", [False, True])
def test_envoy_accepts_it(ads: bool) -> None:
    text = TOPO + ("envoy: {xds: {mode: ads, servers: ['127.0.0.1:18000']}}\n" if ads else "")
    topo, _ = parse_topology(text.encode())
    assert verify_envoy(topo) == []


def test_the_picker_knows_which_pool_a_model_goes_to() -> None:
    topo, _ = parse_topology(TOPO.encode())
    assert routes(topo) == {"m": "chat", "m-alias": "chat", "o": "other", None: "chat"}
