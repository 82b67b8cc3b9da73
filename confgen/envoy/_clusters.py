"""Pools -> Envoy clusters (CDS), and the aggregate clusters that implement fallback."""

from __future__ import annotations

from ..balancing import POLICIES, grpc_wanted, policy_of
from ..endpoints import Endpoint, static_weight
from ..model import (
    ENVOY_CAP_MAX,
    GRPC_SOCKET,
    Pool,
    Topology,
    grpc_service_hosts,
    grpc_socket,
    grpc_tls,
    grpc_transport,
    is_ip,
    split_address,
)
from ..plan import Plan
from . import layout
from ._proto import Json, dur, extension, typed
from .eds import build_cla


def initial_endpoints(pool: Pool) -> list[Endpoint]:
    """Endpoints as the topology states them: IP workers only (names wait for the sidecar).

    Weights and labels are those the sidecar publishes for an endpoint it has no load
    sample of yet (`static_weight`), so its first start changes no weight.
    """
    out: list[Endpoint] = []
    for worker in pool.workers:
        parts = split_address(worker.address)
        assert parts is not None  # checked on load
        host, port = parts
        if not is_ip(host):
            continue
        out.append(Endpoint(
            address=host, port=port, weight=static_weight(pool.capacity_of(worker), worker.weight),
            health="DRAINING" if worker.drain else "HEALTHY",
            zone=worker.zone, worker=worker.address, labels=tuple(sorted(worker.labels.items())),
        ))
    return out


def _dns_assignment(pool: Pool) -> Json:
    endpoints = []
    for worker in pool.workers:
        parts = split_address(worker.address)
        assert parts is not None
        host, port = parts
        endpoints.append({
            "endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}},
            "load_balancing_weight": worker.weight,
        })
    return {"cluster_name": pool.name, "endpoints": [{"lb_endpoints": endpoints}]}


UPSTREAM_IDLE_TIMEOUT = "4s"


def pool_cluster(topo: Topology, plan: Plan, pool: Pool, config_dir: str | None) -> Json:
    """The pool's cluster; its EDS comes from a file under `config_dir`, or over ADS when None."""
    cluster: Json = {
        "name": pool.name,
        "connect_timeout": dur(pool.timeouts.connect),
        "ignore_health_on_host_removal": True,
        "circuit_breakers": {"thresholds": _all_thresholds(topo, pool)},
        "common_lb_config": _common_lb(topo, plan, pool),
        # HTTP/1.1 to the workers, an idle connection closed before the engines' servers close theirs (uvicorn,
        # vLLM's and SGLang's, after 5 s): reusing one the worker is closing that instant resets the request
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": typed(
            "extensions.upstreams.http.v3.HttpProtocolOptions",
            {"common_http_protocol_options": {"idle_timeout": UPSTREAM_IDLE_TIMEOUT},
             "explicit_http_config": {"http_protocol_options": {}}})},
    }
    if pool.discovery == "eds" and config_dir is None:
        cluster["type"] = "EDS"
        cluster["eds_cluster_config"] = {"service_name": pool.name,
                                         "eds_config": {"resource_api_version": "V3", "ads": {}}}
    elif pool.discovery == "eds":
        eds_file = f"{config_dir}/{layout.eds_path(pool.name)}"
        cluster["type"] = "EDS"
        cluster["eds_cluster_config"] = {
            "service_name": pool.name,
            "eds_config": {
                "resource_api_version": "V3",
                # Its own directory, no watched_directory: only a rename of this very file
                # reloads this cluster, and no other cluster's subscription wakes up.
                "path_config_source": {"path": eds_file},
            },
        }
    else:
        cluster["type"] = "STRICT_DNS"
        cluster["dns_lookup_family"] = "V4_PREFERRED"
        cluster["load_assignment"] = _dns_assignment(pool)
    policy = policy_of(topo, pool)
    if POLICIES[policy].picker:
        cluster["load_balancing_policy"] = _override_host(pool)
    else:
        cluster["lb_policy"] = POLICIES[policy].envoy
    if policy == "least_request":
        cluster["least_request_lb_config"] = _least_request(pool)
    elif policy == "ring_hash":
        cluster["ring_hash_lb_config"] = {"hash_function": "XX_HASH", "minimum_ring_size": 1024}
    if pool.health.enabled:
        hc = pool.health
        cluster["health_checks"] = [{
            "timeout": dur(hc.timeout),
            "interval": dur(hc.interval),
            "interval_jitter_percent": 10,
            "healthy_threshold": hc.healthy_threshold,
            "unhealthy_threshold": hc.unhealthy_threshold,
            "no_traffic_interval": dur(hc.no_traffic_interval),
            "http_health_check": {"path": pool.health_path},
        }]
    od = pool.outlier_detection
    if od.enabled:
        cluster["outlier_detection"] = {
            "consecutive_5xx": od.consecutive_5xx,
            "consecutive_gateway_failure": od.consecutive_gateway_failure,
            "enforcing_consecutive_5xx": 100,
            "enforcing_consecutive_gateway_failure": 100,
            "interval": dur(od.interval),
            "base_ejection_time": dur(od.base_ejection_time),
            "max_ejection_percent": od.max_ejection_percent,
            # success-rate ejection needs more traffic than an LLM pool sees per interval
            "enforcing_success_rate": 0,
        }
    return typed("config.cluster.v3.Cluster", cluster)


def _all_thresholds(topo: Topology, pool: Pool) -> list[Json]:
    """DEFAULT, and when some traffic is critical (routes[].class, auth.api_keys[].class) a
    HIGH-priority twin at the same safety cap that the sidecar never lowers; both then track
    what remains, so the sidecar can tell critical requests in flight from the others
    (`circuit_breakers.high.remaining_rq`)."""
    default = _thresholds(topo, pool)
    if not topo.has_critical():
        return [default]
    return [{**default, "track_remaining": True}, {**default, "priority": "HIGH", "track_remaining": True}]


def _least_request(pool: Pool) -> Json:
    bal = pool.balancing
    return {
        "choice_count": bal.choice_count,
        "active_request_bias": {
            "default_value": bal.active_request_bias,
            "runtime_key": f"confgen.{pool.name}.active_request_bias",
        },
    }


# The Endpoint Picker Protocol's destination header (and its dynamic metadata namespace).
PICKER_HEADER = "x-gateway-destination-endpoint"
PICKER_METADATA_NS = "envoy.lb"


def _override_host(pool: Pool) -> Json:
    """The picker's choice, among the pool's own (EDS) endpoints only: a host the header names
    that is not one of them, or is unhealthy, is ignored and least_request picks instead. So a
    bad or forged pick cannot send traffic anywhere else (ORIGINAL_DST would connect to any
    ip:port the header names)."""
    least = {"typed_extension_config": extension(
        "envoy.load_balancing_policies.least_request",
        "extensions.load_balancing_policies.least_request.v3.LeastRequest",
        _least_request(pool),
    )}
    return {"policies": [{"typed_extension_config": extension(
        "envoy.load_balancing_policies.override_host",
        "extensions.load_balancing_policies.override_host.v3.OverrideHost",
        {
            # The metadata first: it lists the picker's fallbacks after its choice (retries).
            "override_host_sources": [
                {"metadata": {"key": PICKER_METADATA_NS, "path": [{"key": PICKER_HEADER}]}},
                {"header": PICKER_HEADER},
            ],
            "fallback_policy": {"policies": [least]},
        },
    )}]}


def breaker_runtime_keys(pool: str) -> tuple[str, str]:
    """Envoy's runtime keys that override the DEFAULT-priority circuit breakers rendered for
    `pool` (max_requests, max_pending_requests): how the sidecar lowers them while shedding."""
    return (f"circuit_breakers.{pool}.default.max_requests",
            f"circuit_breakers.{pool}.default.max_pending_requests")


def _thresholds(topo: Topology, pool: Pool) -> Json:
    """The pool's circuit breakers: a safety cap, never the shedding rule.

    max_requests and max_pending_requests are the safety cap (`Topology.in_flight_cap`);
    the sidecar lowers them through the runtime layer only when the engines report the
    pool saturated. max_connections is never what makes a request pend: an HTTP/1.1
    upstream needs one connection per request in flight, and Envoy keeps one connection
    pool per worker thread, so idle connections held by one thread count against the
    limit while another thread needs a new one. Connections stay bounded by threads x
    the in-flight cap all the same.
    """
    limit = topo.in_flight_cap(pool, ENVOY_CAP_MAX)
    return {
        "priority": "DEFAULT",
        "max_requests": limit,
        "max_pending_requests": limit,
        "max_connections": ENVOY_CAP_MAX,
        "retry_budget": {
            "budget_percent": {"value": pool.retries.budget_percent},
            "min_retry_concurrency": pool.retries.min_concurrency,
        },
        "track_remaining": True,
    }


def _common_lb(topo: Topology, plan: Plan, pool: Pool) -> Json:
    common: Json = {}
    if plan.pool(pool.name).hashing:
        common["consistent_hashing_lb_config"] = {"hash_balance_factor": pool.balancing.hash_balance_factor}
    # Never spray traffic over workers known to be down: Envoy's default (panic at 50 % unhealthy) sent two
    # thirds of a pool's requests to its two dead workers of three, where the retry budget ran out (25 of 40
    # concurrent requests 503, measured in review), while the survivor could have queued them and admission
    # shed the excess. The sidecar already keeps every endpoint published when all of a pool fail (its view
    # more likely wrong than the pool dead), so the safety net panic mode stands for is there. With nowhere
    # to go (every worker down), the answer is the fallback pool, the last resort or 503 `no_healthy`.
    common["healthy_panic_threshold"] = {"value": 0.0}
    return common


def failover_cluster(plan: Plan, pool: Pool) -> Json:
    chain = [p.name for p in plan.pool(pool.name).chain]
    return typed("config.cluster.v3.Cluster", {
        "name": layout.failover_cluster(pool.name),
        "connect_timeout": dur(pool.timeouts.connect),
        "lb_policy": "CLUSTER_PROVIDED",
        "cluster_type": {
            "name": "envoy.clusters.aggregate",
            "typed_config": typed("extensions.clusters.aggregate.v3.ClusterConfig", {"clusters": chain}),
        },
    })


def target_cluster(pool: Pool) -> str:
    """The cluster a route to `pool` names: the pool's own, or its failover aggregate."""
    return layout.failover_cluster(pool.name) if pool.fallback is not None else pool.name


def clusters(topo: Topology, plan: Plan, config_dir: str | None) -> list[Json]:
    out = [pool_cluster(topo, plan, pool, config_dir) for pool in topo.pools]
    out += [failover_cluster(plan, pool) for pool in topo.pools if pool.fallback is not None]
    if topo.models_endpoint and topo.sidecar.models:
        out.append(sidecar_cluster(topo))
    if grpc_wanted(topo):  # the sidecar's gRPC services: picker, rate limits
        out.append(picker_cluster(topo))
    return out


# confgen-sidecar's gRPC services (the endpoint picker): HTTP/2, a name no pool can have.
SIDECAR_GRPC_CLUSTER = "confgen_sidecar_grpc"


def pipe(path: str) -> Json:
    """An endpoint address on a Unix socket (Envoy's `pipe`)."""
    return {"pipe": {"path": path}}


def picker_cluster(topo: Topology) -> Json:
    """confgen-sidecar's gRPC services: by default its Unix socket (sidecar.grpc_socket_dir/grpc.sock, on this
    host); with sidecar.grpc_tls (mutual TLS) or sidecar.grpc_plaintext_loopback over TCP: the sidecar beside
    Envoy (sidecar.address), or with envoy.xds.mode ads the control plane (each server's host, one priority
    each in the order listed, like confgen_xds: every Envoy asks the first healthy one, so one picker sees
    the whole fleet's requests)."""
    port = topo.sidecar.grpc_port
    unix = grpc_transport(topo) == "unix"
    hosts = [] if unix else grpc_service_hosts(topo)
    resolve = not all(is_ip(host) for host in hosts)
    groups: list[Json] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]} for host in hosts]
    if unix:
        groups = [{"lb_endpoints": [{"endpoint": {"address": pipe(grpc_socket(topo, GRPC_SOCKET))}}]}]
    if len(groups) > 1:
        for priority, group in enumerate(groups):
            group["priority"] = priority
    cluster: Json = {
        "name": SIDECAR_GRPC_CLUSTER,
        "type": "STRICT_DNS" if resolve else "STATIC",
        "connect_timeout": "0.25s",
        "load_assignment": {"cluster_name": SIDECAR_GRPC_CLUSTER, "endpoints": groups},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": typed(
            "extensions.upstreams.http.v3.HttpProtocolOptions",
            {"explicit_http_config": {"http2_protocol_options": {
                "connection_keepalive": {"interval": "30s", "timeout": "5s"}}}})},
        # One stream per request in flight (it stays open until the response ends): as many as
        # Envoy's own caps allow, never the 1,024 default that would make busy pools fall back.
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_requests": ENVOY_CAP_MAX,
                                             "max_pending_requests": ENVOY_CAP_MAX,
                                             "max_connections": 64}]},
    }
    if len(groups) > 1:  # a failing server hands all of its share to the next one at once
        cluster["load_assignment"]["policy"] = {"overprovisioning_factor": 100}
        cluster["health_checks"] = [{"timeout": "1s", "interval": "2s", "no_traffic_interval": "2s",
                                     "unhealthy_threshold": 1, "healthy_threshold": 1, "tcp_health_check": {}}]
    if resolve:
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    tls = grpc_tls(topo)
    if tls is not None:
        cluster["transport_socket"] = upstream_mtls(tls.cert, tls.key, tls.ca, tls.server_names or hosts)
    return typed("config.cluster.v3.Cluster", cluster)


def upstream_mtls(cert: str, key: str, ca: str, server_names: list[str]) -> Json:
    """Envoy's side of mutual TLS to a confgen-sidecar gRPC server (ADS, picker, rate limits): its client
    certificate, and the server's checked against `ca` and one of `server_names` (DNS or IP SANs)."""
    return {"name": "envoy.transport_sockets.tls", "typed_config": typed(
        "extensions.transport_sockets.tls.v3.UpstreamTlsContext", {"common_tls_context": {
            "alpn_protocols": ["h2"],  # gRPC
            "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
            "tls_certificates": [{"certificate_chain": {"filename": cert}, "private_key": {"filename": key}}],
            "validation_context": {
                "trusted_ca": {"filename": ca},
                "match_typed_subject_alt_names": [
                    {"san_type": "IP_ADDRESS" if is_ip(name) else "DNS", "matcher": {"exact": name}}
                    for name in server_names],
            },
        }})}


# The confgen-sidecar next to Envoy, asked for GET /v1/models only. A name no pool can have
# (pool names hold no '.'); a short timeout, because its absence has an answer of its own.
SIDECAR_CLUSTER = "confgen.sidecar"
SIDECAR_TIMEOUT = "1s"
# Connections Envoy opens to the sidecar for /v1/models at once: a burst of listings queues in Envoy (answers
# take milliseconds) instead of opening a connection each, within the sidecar's share for one address (32).
SIDECAR_MAX_CONNECTIONS = 16


def sidecar_cluster(topo: Topology) -> Json:
    address = {"socket_address": {"address": topo.sidecar.address, "port_value": topo.sidecar.port}}
    return typed("config.cluster.v3.Cluster", {
        "name": SIDECAR_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "circuit_breakers": {"thresholds": [{"max_connections": SIDECAR_MAX_CONNECTIONS,
                                             "max_pending_requests": 1024}]},
        "load_assignment": {"cluster_name": SIDECAR_CLUSTER,
                            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]},
    })


def assignments(topo: Topology) -> dict[str, Json]:
    """The first EDS content of every EDS pool, keyed by pool name."""
    return {p.name: build_cla(p.name, initial_endpoints(p)) for p in topo.pools if p.discovery == "eds"}
