"""Envoy over ADS: the bootstrap that takes everything from a control plane, and what it serves.

    bootstrap(topo, admin)     node, admin, one static HTTP/2 cluster to `envoy.xds.servers`,
                               ADS (delta or state of the world) for CDS, LDS, EDS and an RTDS
                               runtime layer; nothing from files
    resources(topo, secrets)   the listeners, clusters, endpoint assignments, runtime layer and
                               extension configs the control plane (`confgen-sidecar --serve-xds`)
                               sends: the same JSON as the file target, except that EDS comes over
                               ADS and the API keys come apart from the listeners (ECDS)

The API keys: the listeners' `api_key_auth` filter takes its configuration by extension
config discovery (ECDS) over the same ADS stream, as one TypedExtensionConfig named
`API_KEYS`; rotating a key changes that resource alone, so no listener is rewritten (no
listener drain, no connection closed). No default configuration is rendered for the filter,
so there is no keyless fallback (what Envoy does while it waits for the resource is its own
warming, not measured here).

The control plane fills the runtime layer with the in-flight limits
(`circuit_breakers.<pool>.default.max_requests` / `max_pending_requests`); until it has
sent one, the clusters' own circuit breakers apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..model import XDS_SOCKET, Topology, grpc_socket, grpc_tls, grpc_transport, is_ip, split_address
from ..plan import plan
from ._clusters import assignments, clusters, pipe, upstream_mtls
from ._listener import listeners
from ._proto import Json, typed

__all__ = ["ADS_CLUSTER", "API_KEYS", "RUNTIME_LAYER", "Resources", "bootstrap", "keys_inline", "resources"]

ADS_CLUSTER = "confgen_xds"  # '_' is not in any pool's failover name, and pools may use it: see _checks
RUNTIME_LAYER = "confgen_limits"
API_KEYS = "envoy.filters.http.api_key_auth"  # the filter's name is the ECDS resource's
_TYPED_EXTENSION_CONFIG = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
_API_KEY_AUTH_TYPE = "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth"
_INITIAL_FETCH_TIMEOUT = "15s"  # Envoy's default, written down: starting without a control plane waits this long


@dataclass(frozen=True)
class Resources:
    """What the control plane serves, as Envoy's protobuf JSON (each resource with its "@type")."""

    listeners: list[Json]
    clusters: list[Json]
    assignments: dict[str, Json]  # pool -> ClusterLoadAssignment (the topology's first view)
    runtime: Json  # the RTDS layer's key/values
    extension_configs: list[Json] = field(default_factory=list)  # ECDS: TypedExtensionConfig, by name


def resources(topo: Topology, secrets: Mapping[str, str]) -> Resources:
    routing = plan(topo)
    served = listeners(topo, routing, secrets)
    keys = _keys_apart(served)
    return Resources(listeners=served, clusters=clusters(topo, routing, None), assignments=assignments(topo),
                     runtime={}, extension_configs=[{"@type": _TYPED_EXTENSION_CONFIG, "name": API_KEYS,
                                                     "typed_config": keys}] if keys else [])


def keys_inline(served: Resources) -> list[Json]:
    """The listeners with the API keys put back in their filters (what a static bootstrap needs to be
    validated the way Envoy checks what it receives)."""
    by_name = {str(e["name"]): e["typed_config"] for e in served.extension_configs}

    def put(node: object) -> object:
        if isinstance(node, dict):
            out = {k: put(v) for k, v in node.items()}
            if "config_discovery" in out and out.get("name") in by_name:
                del out["config_discovery"]
                out["typed_config"] = by_name[str(out["name"])]
            return out
        if isinstance(node, list):
            return [put(v) for v in node]
        return node

    return [dict(put(listener)) for listener in served.listeners]  # type: ignore[call-overload]


def _keys_apart(node: object) -> Json | None:
    """Replace every api_key_auth filter's inline configuration (the keys) by an ECDS reference;
    the configuration taken out (the same for every listener: auth is the topology's)."""
    found: Json | None = None
    if isinstance(node, dict):
        for item in node.get("http_filters", ()):
            if item.get("name") == API_KEYS and "typed_config" in item:
                config = item.pop("typed_config")
                assert found is None or found == config
                found = config
                item["config_discovery"] = {
                    "config_source": {"ads": {}, "resource_api_version": "V3",
                                      "initial_fetch_timeout": _INITIAL_FETCH_TIMEOUT},
                    "type_urls": [_API_KEY_AUTH_TYPE],
                }
        children: list[object] = list(node.values())
    elif isinstance(node, list):
        children = list(node)
    else:
        return None
    for child in children:
        inner = _keys_apart(child)
        if inner is not None:
            assert found is None or found == inner
            found = inner
    return found


def _ads_source() -> Json:
    return {"resource_api_version": "V3", "ads": {}, "initial_fetch_timeout": _INITIAL_FETCH_TIMEOUT}


def _server_cluster(topo: Topology) -> Json:
    """The control plane: its Unix socket by default (sidecar.grpc_socket_dir/xds.sock, on this host), or over
    TCP (mutual TLS with sidecar.grpc_tls, or plaintext on loopback) envoy.xds.servers."""
    if grpc_transport(topo) == "unix":
        return {
            "name": ADS_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": _http2_keepalive(),
            "load_assignment": {"cluster_name": ADS_CLUSTER, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": pipe(grpc_socket(topo, XDS_SOCKET))}}]}]},
        }
    groups: list[Json] = []
    resolve = False
    for priority, server in enumerate(topo.envoy.xds.servers):
        parts = split_address(server)
        assert parts is not None  # checked on load
        host, port = parts
        resolve = resolve or not is_ip(host)
        # One priority per server, in the order listed: every Envoy follows the first healthy
        # server, so the control plane's count of connected Envoys is the whole fleet; the
        # next one takes over when it fails (docs/ads.md).
        groups.append({"priority": priority, "lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]})
    cluster: Json = {
        "name": ADS_CLUSTER,
        "type": "STRICT_DNS" if resolve else "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": _http2_keepalive(),
        "load_assignment": {"cluster_name": ADS_CLUSTER, "endpoints": groups,
                            # a failing server hands all of its share to the next one at once
                            "policy": {"overprovisioning_factor": 100}},
        # A control plane that refuses connections is skipped until it accepts them again.
        "health_checks": [{
            "timeout": "1s", "interval": "2s", "no_traffic_interval": "2s",
            "unhealthy_threshold": 1, "healthy_threshold": 1, "tcp_health_check": {},
        }],
    }
    if resolve:
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if grpc_tls(topo) is not None:
        cluster["transport_socket"] = _upstream_tls(topo)
    return cluster


def _http2_keepalive() -> Json:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": typed(
        "extensions.upstreams.http.v3.HttpProtocolOptions",
        # gRPC needs HTTP/2; keepalive pings find a control plane that vanished
        # without closing its connection (a lost node), so Envoy moves to the other.
        {"explicit_http_config": {"http2_protocol_options": {
            "connection_keepalive": {"interval": "10s", "timeout": "5s"}}}},
    )}


def _upstream_tls(topo: Topology) -> Json:
    """mTLS to the control plane: Envoy's client certificate, and the server's checked against the CA and
    one of the expected names (sidecar.grpc_tls.server_names, else the servers' hosts)."""
    tls = grpc_tls(topo)
    assert tls is not None
    names = list(tls.server_names)
    if not names:
        for server in topo.envoy.xds.servers:
            parts = split_address(server)
            if parts is not None and parts[0] not in names:
                names.append(parts[0])
    return upstream_mtls(tls.cert, tls.key, tls.ca, names)


def bootstrap(topo: Topology, admin: Json) -> Json:
    """A bootstrap that takes listeners, clusters, endpoints and limits over ADS, nothing from files; its
    admin as given (confgen.envoy.admin)."""
    api_type = "DELTA_GRPC" if topo.envoy.xds.protocol == "delta" else "GRPC"
    return {
        "node": {"id": topo.envoy.node_id or topo.name, "cluster": topo.name},
        "admin": admin,
        "dynamic_resources": {
            "ads_config": {
                "api_type": api_type,
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{
                    "envoy_grpc": {
                        "cluster_name": ADS_CLUSTER,
                        # Reconnect backoff of the xDS stream (jittered, exponential).
                        "retry_policy": {"retry_back_off": {"base_interval": "0.25s", "max_interval": "5s"}},
                    },
                }],
            },
            "cds_config": _ads_source(),
            "lds_config": _ads_source(),
        },
        "static_resources": {"clusters": [_server_cluster(topo)]},
        "layered_runtime": {"layers": [
            {"name": "static", "static_layer": {"overload.global_downstream_max_connections": 50000}},
            {"name": RUNTIME_LAYER, "rtds_layer": {"name": RUNTIME_LAYER, "rtds_config": _ads_source()}},
            {"name": "admin", "admin_layer": {}},
        ]},
    }
