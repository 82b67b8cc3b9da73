"""A bare Envoy least_request, written by hand: the baseline a user gets without confgen.

The smallest config that proxies the OpenAI API to the workers: one listener, one route
(timeout 0 = none, so long generations are not cut at Envoy's 15 s default), one STATIC
cluster with LEAST_REQUEST (Envoy's default choice_count 2, power of two choices). Nothing
else: no health checks, no outlier detection, no retries, and no `circuit_breakers` block
(Envoy's default thresholds, 1,024 requests / pending / connections, which these runs never
reach, so nothing is shed or held back in Envoy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CLUSTER = "workers"


def bootstrap(workers: Sequence[tuple[str, int]], listen_port: int, policy: str = "LEAST_REQUEST") -> dict[str, Any]:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": CLUSTER, "timeout": "0s"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    endpoints = [{"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in workers]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{"name": "public", "address": {"socket_address": {"address": "127.0.0.1",
                                                                            "port_value": listen_port}},
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": [{"name": CLUSTER, "type": "STATIC", "connect_timeout": "1s", "lb_policy": policy,
                          "load_assignment": {"cluster_name": CLUSTER,
                                              "endpoints": [{"lb_endpoints": endpoints}]}}],
        },
    }
