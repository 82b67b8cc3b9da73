"""Traffic classes under overload: critical traffic (a route's `class`, or an API-key client's)
rides Envoy's HIGH-priority circuit breaker, which the sidecar never lowers; standard and
sheddable traffic use DEFAULT, the one the sidecar's shedding limit sets; a runtime share of the
sheddable traffic (`confgen.shed.<pool>.sheddable`, a percentage) is refused before it reaches
the breaker. Checked on the real Envoy by setting the runtime keys as the sidecar does."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from confgen import envoy, parse_topology
from confgen.nginx import unsupported
from confgen.runtime import EnvoyProcess, free_port
from tests.support.backends import backends
from tests.support.envoy import request, running_envoy, wait_until

TOPOLOGY = """
version: 1
name: classes
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
auth:
  api_keys:
    - {{client: ops, env: KEY_OPS, class: critical}}
    - {{client: batch, env: KEY_BATCH, class: sheddable}}
    - {{client: web, env: KEY_WEB}}
routes:
  - {{name: urgent, pool: chat, class: critical, match: {{headers: [{{name: x-tier, exact: urgent}}]}}}}
  - {{name: bulk, pool: chat, class: sheddable, match: {{headers: [{{name: x-tier, exact: bulk}}]}}}}
pools:
  - name: chat
    engine: vllm
    models: [chat-model]
    health: {{enabled: false}}
    workers: ["127.0.0.1:{a}"]
"""
SECRETS = {"ops": "sk-ops-123", "batch": "sk-batch-456", "web": "sk-web-789"}


def _auth(client: str) -> dict[str, str]:
    return {"authorization": f"Bearer {SECRETS[client]}"}


def test_render_gives_critical_traffic_the_high_priority_breaker() -> None:
    """The critical route and a copy of every other route for the critical clients carry
    priority HIGH; the pool has a HIGH threshold at the safety cap beside DEFAULT, both
    tracking what remains; nginx is told it honours no class."""
    topo, _ = parse_topology(TOPOLOGY.format(admin=1, port=2, a=3).encode(), "classes.yaml")
    files = envoy.render(topo, config_dir="/etc/confgen", secrets=SECRETS)
    lds = json.loads(files["lds.json"])
    hcm = lds["resources"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    priority = {r["name"]: r["route"].get("priority", "DEFAULT") for r in routes if "route" in r}
    assert priority["urgent"] == "HIGH"
    assert "urgent/critical" not in priority  # critical already
    assert priority["model/chat-model/critical"] == "HIGH" and priority["model/chat-model"] == "DEFAULT"
    copy = next(r for r in routes if r["name"] == "model/chat-model/critical")
    assert {"name": "x-confgen-client", "string_match": {"safe_regex": {"regex": "^(ops)$"}}} in \
        copy["match"]["headers"]
    cds = json.loads(files["cds.json"])
    chat = next(c for c in cds["resources"] if c["name"] == "chat")
    thresholds = {t["priority"]: t for t in chat["circuit_breakers"]["thresholds"]}
    assert thresholds["HIGH"]["max_requests"] == thresholds["DEFAULT"]["max_requests"]
    assert thresholds["HIGH"]["track_remaining"] and thresholds["DEFAULT"]["track_remaining"]
    assert {path for path, _ in unsupported(topo)} >= {"routes[0].class", "routes[1].class",
                                                       "auth.api_keys[0].class", "auth.api_keys[1].class"}


def _names(topo_text: str) -> list[tuple[str, str]]:
    topo, _ = parse_topology(topo_text.encode(), "classes.yaml")
    files = envoy.render(topo, config_dir="/etc/confgen", secrets=SECRETS)
    lds = json.loads(files["lds.json"])
    hcm = lds["resources"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return [(r["name"], "shed" if "direct_response" in r else r.get("route", {}).get("priority", "DEFAULT"))
            for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if r["name"] != "models-list"]


def test_render_puts_the_shed_route_after_critical_and_before_the_route() -> None:
    """Order per route: the critical clients' HIGH copy, then the shed share (the sheddable route
    itself, or a copy for the sheddable clients), then the route; a critical route has neither."""
    assert _names(TOPOLOGY.format(admin=1, port=2, a=3)) == [
        ("urgent", "HIGH"),
        ("bulk/critical", "HIGH"), ("bulk/shed", "shed"), ("bulk", "DEFAULT"),
        ("model/chat-model/critical", "HIGH"), ("model/chat-model/shed", "shed"), ("model/chat-model", "DEFAULT"),
    ]
    topo, _ = parse_topology(TOPOLOGY.format(admin=1, port=2, a=3).encode(), "classes.yaml")
    files = envoy.render(topo, config_dir="/etc/confgen", secrets=SECRETS)
    routes = json.loads(files["lds.json"])["resources"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    shed = next(r for r in routes if r["name"] == "model/chat-model/shed")
    assert shed["match"]["runtime_fraction"] == {"default_value": {"numerator": 0, "denominator": "HUNDRED"},
                                                 "runtime_key": envoy.shed_runtime_key("chat")}
    assert {"name": "x-confgen-client", "string_match": {"safe_regex": {"regex": "^(batch)$"}}} in \
        shed["match"]["headers"]
    bulk = next(r for r in routes if r["name"] == "bulk/shed")
    assert [h["name"] for h in bulk["match"]["headers"]] == ["x-tier"]  # everyone's traffic is sheddable there
    # No sheddable traffic: no shed route and no 529 mapper (the output is as before).
    plain = TOPOLOGY.replace(", class: sheddable", "").replace(
        "  - {{name: bulk, pool: chat, class: sheddable, match: {{headers: [{{name: x-tier, exact: bulk}}]}}}}\n", "")
    assert all(kind != "shed" for _, kind in _names(plain.format(admin=1, port=2, a=3)))
    topo, _ = parse_topology(plain.format(admin=1, port=2, a=3).encode(), "classes.yaml")
    assert "529" not in envoy.render(topo, config_dir="/etc/confgen", secrets=SECRETS)["lds.json"].decode()


def _set_runtime(proc: EnvoyProcess, values: dict[str, int]) -> None:
    keys = "&".join(f"{k}={v}" for k, v in values.items())
    with urllib.request.urlopen(urllib.request.Request(f"{proc.admin_url}/runtime_modify?{keys}", method="POST"),
                                timeout=10) as answer:
        assert answer.status == 200


def test_the_shed_share_refuses_sheddable_traffic_first_on_the_real_envoy(tmp_path: Path) -> None:
    """The pool's shed key at 100 %: the sheddable client and the sheddable route get 429
    `overloaded` + retry-after at once (the body of the breaker's overflow, not a rate limit's),
    without reaching a worker; standard and critical traffic pass; a critical client on the
    sheddable route is critical. At 50 % about half of the sheddable requests are refused
    (bounds for 200 draws: 25-75 %); back at 0 all pass."""
    port, admin = free_port(), free_port()
    with backends("a") as (a,):
        text = TOPOLOGY.format(admin=admin, port=port, a=a.port)
        with running_envoy(text, tmp_path / "out", secrets=SECRETS) as proc:
            url = f"http://127.0.0.1:{port}/v1/completions"
            body = {"model": "chat-model"}
            assert wait_until(lambda: request(url, body, _auth("batch"))[0] == 200)
            upstream = proc.stats()["cluster.chat.upstream_rq_total"]
            _set_runtime(proc, {envoy.shed_runtime_key("chat"): 100})
            for headers in (_auth("batch"), {**_auth("web"), "x-tier": "bulk"}):
                status, answer_headers, answer_body = request(url, body, headers)
                assert status == 429, answer_body
                assert json.loads(answer_body)["error"]["code"] == "overloaded"
                assert answer_headers["retry-after"] and answer_headers["content-type"] == "application/json"
            assert proc.stats()["cluster.chat.upstream_rq_total"] == upstream  # refused at the edge
            assert request(url, body, _auth("web"))[0] == 200
            assert request(url, body, _auth("ops"))[0] == 200
            assert request(url, body, {**_auth("ops"), "x-tier": "bulk"})[0] == 200  # critical client wins
            assert request(url, body, {**_auth("batch"), "x-tier": "urgent"})[0] == 200  # critical route wins
            assert request(url, body, {**_auth("batch"), "x-confgen-client": "web"})[0] == 429  # no forging
            _set_runtime(proc, {envoy.shed_runtime_key("chat"): 50})
            refused = sum(request(url, body, _auth("batch"))[0] == 429 for _ in range(200))
            assert 50 <= refused <= 150, refused
            _set_runtime(proc, {envoy.shed_runtime_key("chat"): 0})
            assert all(request(url, body, _auth("batch"))[0] == 200 for _ in range(20))


def test_with_default_shut_critical_traffic_still_passes_on_the_real_envoy(tmp_path: Path) -> None:
    """DEFAULT's max_requests at 0 (what the sidecar's limit does at its extreme): the
    sheddable client gets 429 `overloaded` at once; the critical client and the critical
    route are served; a forged client header does not make a request critical."""
    port, admin = free_port(), free_port()
    with backends("a") as (a,):
        text = TOPOLOGY.format(admin=admin, port=port, a=a.port)
        with running_envoy(text, tmp_path / "out", secrets=SECRETS) as proc:
            url = f"http://127.0.0.1:{port}/v1/completions"
            body = {"model": "chat-model"}
            assert wait_until(lambda: request(url, body, _auth("batch"))[0] == 200)
            keys = "&".join(f"circuit_breakers.chat.default.{k}=0" for k in ("max_requests", "max_pending_requests"))
            with urllib.request.urlopen(urllib.request.Request(f"{proc.admin_url}/runtime_modify?{keys}",
                                                               method="POST"), timeout=10) as answer:
                assert answer.status == 200
            status, headers, answer_body = request(url, body, _auth("batch"))
            assert status == 429, answer_body
            assert json.loads(answer_body)["error"]["code"] == "overloaded" and headers["retry-after"]
            assert request(url, body, _auth("ops"))[0] == 200
            assert request(url, body, {**_auth("batch"), "x-tier": "urgent"})[0] == 200
            assert request(url, body, {**_auth("batch"), "x-confgen-client": "ops"})[0] == 429
