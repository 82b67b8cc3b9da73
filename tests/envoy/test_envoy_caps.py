"""The in-flight safety cap: a documented multiple of the declared capacity, in range for
both proxies by construction, and accepted by the real Envoy and nginx at its extremes."""

from __future__ import annotations

import json

import pytest

from confgen import envoy, nginx, parse_topology
from confgen.model import ENVOY_CAP_MAX, NGINX_CAP_MAX, in_flight_cap
from confgen.verify import verify_envoy, verify_nginx

HUGE = """
version: 1
name: huge
listeners: [{name: public, port: 8080}]
backpressure: {safety_cap: 1000}
pools:
  - name: big
    engine: vllm
    models: [m]
    capacity: 100000
    workers: [%s]
  - name: small
    engine: vllm
    models: [s]
    capacity: 1
    workers: ["10.0.0.1:8000"]
"""


def test_cap_formula_rounds_up_and_stays_in_range() -> None:
    """ceil(safety_cap x capacity), at least 1, at most the proxy's ceiling."""
    assert in_flight_cap(12, 4.0, ENVOY_CAP_MAX) == 48
    assert in_flight_cap(3, 1.5, ENVOY_CAP_MAX) == 5
    assert in_flight_cap(10, 1.1, ENVOY_CAP_MAX) == 11  # 11.000000000000002 is still 11
    assert in_flight_cap(0, 4.0, NGINX_CAP_MAX) == 1
    assert in_flight_cap(100_000 * 100, 1000.0, ENVOY_CAP_MAX) == ENVOY_CAP_MAX
    assert in_flight_cap(100_000, 1.0, NGINX_CAP_MAX) == NGINX_CAP_MAX


@pytest.mark.parametrize("workers", [1, 50])
def test_extreme_caps_render_in_range_and_the_real_proxies_accept_them(workers: int) -> None:
    """The largest capacity x the largest multiple renders Envoy thresholds within uint32
    (max_connections never below the in-flight cap) and limit_conn within 65535, and both
    real binaries accept the result."""
    addresses = ", ".join(f'"10.0.1.{i}:8000"' for i in range(1, workers + 1))
    topo, _ = parse_topology((HUGE % addresses).encode(), "huge.yaml")
    cds = json.loads(envoy.render(topo, config_dir="/etc/confgen")["cds.json"])
    pools = {p.name for p in topo.pools}  # not the sidecar cluster (GET /v1/models)
    caps = {c["name"]: c["circuit_breakers"]["thresholds"][0] for c in cds["resources"] if c["name"] in pools}
    expected_big = min(100_000 * workers * 1000, ENVOY_CAP_MAX)
    assert caps["big"]["max_requests"] == caps["big"]["max_pending_requests"] == expected_big
    assert caps["small"]["max_requests"] == 1000  # 1 slot x 1000
    assert all(t["max_connections"] == ENVOY_CAP_MAX for t in caps.values())
    conf = nginx.render(topo, config_dir="/etc/confgen")["nginx.conf"].decode()
    assert f"limit_conn confgen_inflight {min(100_000 * workers * 1000, NGINX_CAP_MAX)};" in conf
    assert "limit_conn confgen_inflight 1000;" in conf
    assert verify_envoy(topo) == []
    assert verify_nginx(topo) == []


def test_no_pool_sprays_traffic_over_workers_known_to_be_down() -> None:
    """Found by review: a pool without a fallback kept Envoy's 50 % panic threshold, so with two of three workers
    down Envoy spread requests over all three (25 of 40 concurrent requests 503, the retry budget spent on the
    dead ones). Every pool's panic threshold is 0: the healthy workers take the traffic, admission sheds."""
    from pathlib import Path

    from confgen import load_topology

    root = Path(__file__).resolve().parents[2]
    for example in sorted((root / "examples").glob("*.yaml")):
        topo, _ = load_topology(example)
        cds = json.loads(envoy.render(topo, config_dir="/etc/confgen")["cds.json"])
        pools = {p.name for p in topo.pools}
        for resource in cds["resources"]:
            if resource["name"] in pools:
                assert resource["common_lb_config"]["healthy_panic_threshold"] == {"value": 0.0}, (example, resource)


def test_a_listener_that_reads_usage_from_answers_buffers_answers_larger_than_its_request_cap() -> None:
    """Found by review: with token budgets json_to_metadata buffers each JSON answer for its usage, up to the
    listener's per-connection limit, which was max_request_bytes (2 MiB): a 3 MB embeddings answer became a
    plain-text 500 after the work was done. Such a listener buffers up to 16 MiB; the request cap stays the
    buffer filter's max_request_bytes; a listener without token budgets keeps its cap."""
    from pathlib import Path

    from confgen import load_topology
    from confgen.envoy._listener import BODY_LIMIT_FILTER, RESPONSE_BUFFER_BYTES

    root = Path(__file__).resolve().parents[2]
    for name, reads_usage in (("global-limits", True), ("routing-matrix", False)):
        topo, _ = load_topology(root / "tests" / "golden" / "inputs" / f"{name}.yaml")
        lds = json.loads(envoy.render(topo, config_dir="/etc/confgen")["lds.json"])
        for resource in lds["resources"]:
            lst = next(x for x in topo.listeners if x.name == resource["name"])
            limit = resource["per_connection_buffer_limit_bytes"]
            assert limit == (max(lst.max_request_bytes, RESPONSE_BUFFER_BYTES) if reads_usage
                             else lst.max_request_bytes), (name, limit)
            hcm = resource["filter_chains"][0]["filters"][0]["typed_config"]
            caps = [f["typed_config"]["max_request_bytes"] for f in hcm["http_filters"]
                    if f["name"] == BODY_LIMIT_FILTER]
            assert caps == [lst.max_request_bytes], (name, caps)
