"""The real Envoy serves traffic from confgen's rendered file-based xDS."""

from __future__ import annotations

import json
from pathlib import Path

from confgen import envoy, parse_topology
from confgen.output import atomic_write
from confgen.runtime import free_port
from tests.support.backends import backends
from tests.support.envoy import request, running_envoy, wait_until

TOPOLOGY = """
version: 1
name: live
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - name: public
    address: 127.0.0.1
    port: {port}
pools:
  - name: big
    engine: vllm
    models: [big-model]
    health: {{enabled: false}}
    workers: ["127.0.0.1:{a}"]
  - name: small
    engine: vllm
    models: [small-model]
    health: {{enabled: false}}
    workers: ["127.0.0.1:{b}"]
"""


def test_traffic_flows_by_model_and_eds_replacement_takes_effect(tmp_path: Path) -> None:
    """Requests reach the pool named by the body's `model`; replacing a pool's EDS file
    (atomic rename) moves its traffic to the new endpoint without restarting Envoy."""
    port = free_port()
    with backends("a", "b", "c") as (a, b, c):
        text = TOPOLOGY.format(admin=free_port(), port=port, a=a.port, b=b.port)
        out = tmp_path / "out"
        with running_envoy(text, out) as proc:
            url = f"http://127.0.0.1:{port}/v1/completions"
            assert wait_until(lambda: request(url, {"model": "big-model"})[0] == 200)
            status, headers, _ = request(url, {"model": "big-model", "prompt": "hi"})
            assert (status, headers["x-backend"]) == (200, "a")
            status, headers, _ = request(url, {"model": "small-model", "prompt": "hi"})
            assert (status, headers["x-backend"]) == (200, "b")

            # The sidecar's path: rebuild the pool's EDS with confgen's builder, rename into place.
            doc = envoy.render_eds("small", [envoy.Endpoint("127.0.0.1", c.port, worker=f"127.0.0.1:{c.port}")])
            atomic_write(out / envoy.layout.eds_path("small"), doc)

            def moved() -> bool:
                s, h, _ = request(url, {"model": "small-model", "prompt": "hi"})
                return s == 200 and h.get("x-backend") == "c"

            assert wait_until(moved, timeout=5)
            assert request(url, {"model": "big-model"})[1]["x-backend"] == "a"
            stats = proc.stats()
            assert int(stats.get("cluster.small.update_rejected", 0)) == 0


def test_unknown_model_gets_openai_style_404(tmp_path: Path) -> None:
    """A model no pool serves is answered at the edge: 404 with an OpenAI error object."""
    port = free_port()
    with backends("a", "b") as (a, b):
        text = TOPOLOGY.format(admin=free_port(), port=port, a=a.port, b=b.port)
        with running_envoy(text, tmp_path / "out"):
            status, headers, body = request(f"http://127.0.0.1:{port}/v1/completions", {"model": "nope"})
            assert status == 404
            assert headers["content-type"].startswith("application/json")
            error = json.loads(body)["error"]
            assert error["code"] == "model_not_found"
            assert "nope" in error["message"]
            assert a.requests == [] and b.requests == []


def test_models_endpoint_answered_at_the_edge(tmp_path: Path) -> None:
    """GET /v1/models lists every served name from the topology without touching a worker."""
    port = free_port()
    with backends("a", "b") as (a, b):
        text = TOPOLOGY.format(admin=free_port(), port=port, a=a.port, b=b.port)
        with running_envoy(text, tmp_path / "out"):
            status, _, body = request(f"http://127.0.0.1:{port}/v1/models")
            assert status == 200
            assert [m["id"] for m in json.loads(body)["data"]] == ["big-model", "small-model"]
            assert a.requests == [] and b.requests == []


def test_rendered_eds_matches_topology_workers() -> None:
    """The first EDS file lists the topology's IP workers with the weight the sidecar would
    publish for them without a load sample (static share x capacity: the pool's default 256
    here) and their labels as metadata."""
    topo, _ = parse_topology(TOPOLOGY.format(admin=9901, port=8080, a=9001, b=9002).encode())
    files = envoy.render(topo, config_dir="/cfg")
    cla = json.loads(files["eds/big/endpoints.json"])["resources"][0]
    ep = cla["endpoints"][0]["lb_endpoints"][0]
    assert ep["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9001}
    assert ep["load_balancing_weight"] == 256 == envoy.eds.static_weight(256, 1)
    text = TOPOLOGY.format(admin=9901, port=8080, a=9001, b=9002).replace(
        'workers: ["127.0.0.1:9002"]',
        'workers: [{address: "127.0.0.1:9002", weight: 3, capacity: 8, labels: {gpu: l4}}]',
    )
    topo, _ = parse_topology(text.encode())
    small = json.loads(envoy.render(topo, config_dir="/cfg")["eds/small/endpoints.json"])["resources"][0]
    ep = small["endpoints"][0]["lb_endpoints"][0]
    assert ep["load_balancing_weight"] == 24
    assert ep["metadata"] == {"filter_metadata": {"confgen": {"gpu": "l4", "worker": "127.0.0.1:9002"}}}


def test_static_bootstrap_samples_endpoints_across_localities() -> None:
    """`max_endpoints` keeps the first endpoints of a pool in locality order and drops
    emptied localities, so Envoy's validate-mode parse stays bounded on huge pools."""
    eps = [envoy.Endpoint(f"10.0.0.{i}", 8000, zone=("a" if i < 3 else "b"), worker=f"w{i}") for i in range(1, 7)]
    files = {
        "bootstrap.json": json.dumps({"node": {"id": "n", "cluster": "c"}, "dynamic_resources": {}}).encode(),
        "lds.json": json.dumps({"resources": []}).encode(),
        "cds.json": json.dumps(
            {"resources": [{"name": "p", "type": "EDS", "eds_cluster_config": {"service_name": "p"}}]}
        ).encode(),
        envoy.layout.eds_path("p"): envoy.render_eds("p", eps),
    }
    cluster = envoy.static_bootstrap(files, max_endpoints=3)["static_resources"]["clusters"][0]
    groups = cluster["load_assignment"]["endpoints"]
    kept = [ep["endpoint"]["address"]["socket_address"]["address"] for g in groups for ep in g["lb_endpoints"]]
    assert kept == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert [g["locality"]["zone"] for g in groups] == ["a", "b"]
    full = envoy.static_bootstrap(files)["static_resources"]["clusters"][0]
    assert sum(len(g["lb_endpoints"]) for g in full["load_assignment"]["endpoints"]) == 6
