"""The control plane's JSON -> protobuf packing: a typed config whose message the generated modules
(xds-protos) lack goes to Envoy as a TypedStruct of the same JSON, so a filter newer than the Python
protos (Envoy 1.40's sse_to_metadata, which reads a stream's usage for token budgets) is served over ADS
as it is written to files; a known type is packed as itself. The live side: tests/ads/test_ads_global_limits.py
(streams charged their usage through a control plane)."""

from __future__ import annotations

from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from xds.type.v3 import typed_struct_pb2

from confgen import parse_topology
from confgen.envoy import ads
from sidecar.outputs.xds.cache import Packer

TOPOLOGY = """\
version: 1
name: t
listeners: [{name: public, port: 8080}]
envoy: {xds: {mode: ads, servers: ['127.0.0.1:18000']}}
auth: {api_keys: [{client: a, env: K}]}
limits:
  store: {redis: '127.0.0.1:6379'}
  per_key: [{requests: 10, per: 1s}, {scope: global, unit: total_tokens, tokens: 1000, window: minute}]
pools:
  - {name: p, engine: vllm, models: [m], max_output_tokens: 512, workers: ["127.0.0.1:8000"]}
"""


def test_a_filter_the_python_protos_lack_is_sent_as_a_typed_struct() -> None:
    topo, _ = parse_topology(TOPOLOGY.encode())
    (served,) = ads.resources(topo, {"a": "x" * 32}).listeners
    packed = Packer().to_any(served)
    listener = listener_pb2.Listener()
    assert packed.Unpack(listener)
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    by_name = {f.name: f.typed_config for f in hcm.http_filters}
    sse = by_name["envoy.filters.http.sse_to_metadata"]
    assert sse.type_url == "type.googleapis.com/xds.type.v3.TypedStruct"
    opaque = typed_struct_pb2.TypedStruct()
    assert sse.Unpack(opaque)
    assert opaque.type_url == "type.googleapis.com/envoy.extensions.filters.http.sse_to_metadata.v3.SseToMetadata"
    parser = opaque.value["response_rules"]["content_parser"]
    assert parser["typed_config"]["@type"].endswith("content_parsers.json.v3.JsonContentParser")  # left to Envoy
    # the ones the protos have are themselves, not wrapped
    assert by_name["envoy.filters.http.ratelimit"].type_url.endswith("ratelimit.v3.RateLimit")
    assert by_name["envoy.filters.http.json_to_metadata"].type_url.endswith("json_to_metadata.v3.JsonToMetadata")
