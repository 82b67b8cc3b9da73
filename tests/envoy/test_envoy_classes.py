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
from confgen.envoy._listener import SHED_FILTER
from confgen.envoy._proto import Json
from confgen.nginx import unsupported
from confgen.runtime import EnvoyProcess, free_port
from tests.support.backends import backends
from tests.support.envoy import request, request_from, running_envoy, wait_until

TOPOLOGY = """
version: 1
name: classes
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}, trusted_headers: {{names: [x-tier], from: [127.0.0.1/32]}}}}
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


def _routes(topo_text: str) -> tuple[list[Json], list[str]]:
    topo, _ = parse_topology(topo_text.encode(), "classes.yaml")
    files = envoy.render(topo, config_dir="/etc/confgen", secrets=SECRETS)
    hcm = json.loads(files["lds.json"])["resources"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return ([r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if r["name"] != "models-list"],
            [f["name"] for f in hcm["http_filters"]])


def _kind(route: Json) -> str:
    shed = SHED_FILTER in route.get("typed_per_filter_config", {})
    return route["route"].get("priority", "DEFAULT") + ("+shed" if shed else "")


def test_render_gives_sheddable_routes_the_shed_share_after_the_critical_copy() -> None:
    """Order per route: the critical clients' HIGH copy, then (on a standard route) the
    sheddable clients' copy carrying the shed share, then the route (carrying it when the route
    is sheddable); a critical route has neither. The shed filter runs after rbac, before the
    router; without sheddable traffic there is no shed filter, setting or 507 mapper."""
    routes, filters = _routes(TOPOLOGY.format(admin=1, port=2, a=3))
    assert [(r["name"], _kind(r)) for r in routes] == [
        ("urgent", "HIGH"),
        ("bulk/critical", "HIGH"), ("bulk", "DEFAULT+shed"),
        ("model/chat-model/critical", "HIGH"), ("model/chat-model/sheddable", "DEFAULT+shed"),
        ("model/chat-model", "DEFAULT"),
    ]
    assert filters.index(SHED_FILTER) > filters.index("envoy.filters.http.json_to_metadata")
    assert filters.index(SHED_FILTER) < filters.index("envoy.filters.http.router")
    copy = next(r for r in routes if r["name"] == "model/chat-model/sheddable")
    assert {"name": "x-confgen-client", "string_match": {"safe_regex": {"regex": "^(batch)$"}}} in \
        copy["match"]["headers"]
    shed = copy["typed_per_filter_config"][SHED_FILTER]
    assert shed["filter_enabled"] == {"default_value": {"numerator": 0, "denominator": "HUNDRED"},
                                      "runtime_key": envoy.shed_runtime_key("chat")}
    assert shed["stat_prefix"] == envoy.shed_stat_prefix("chat")
    plain = TOPOLOGY.replace(", class: sheddable", "").replace(
        "  - {{name: bulk, pool: chat, class: sheddable, match: {{headers: [{{name: x-tier, exact: bulk}}]}}}}\n", "")
    routes, filters = _routes(plain.format(admin=1, port=2, a=3))
    assert SHED_FILTER not in filters and all("+shed" not in _kind(r) for r in routes)
    topo, _ = parse_topology(plain.format(admin=1, port=2, a=3).encode(), "classes.yaml")
    lds = envoy.render(topo, config_dir="/etc/confgen", secrets=SECRETS)["lds.json"].decode()
    # no shed share without sheddable traffic: a 507 left is the endpoint picker's refusal status (sent to it as
    # stream metadata, mapped to 429 `overloaded`), there only where the picker is
    from confgen.balancing import picker_wanted

    assert ("507" in lds) == picker_wanted(topo) == ("x-confgen-shed-status" in lds)


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
    (bounds for 200 draws: 25-75 %); back at 0 all pass. Envoy counts the refusals per pool
    (`confgen_shed_chat.http_local_rate_limit.rate_limited`); the first request on each
    sheddable route once the share is on passes (the bucket's single token, refilled daily:
    Envoy counts it as `ok`)."""
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
                assert request(url, body, headers)[0] == 200  # the route's single token, once
                upstream += 1
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
            stats = proc.stats()
            prefix = f"{envoy.shed_stat_prefix('chat')}.http_local_rate_limit"
            assert stats[f"{prefix}.ok"] == 2, stats  # each sheddable route's single token
            assert stats[f"{prefix}.rate_limited"] == 3 + refused, stats


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


def test_a_class_header_from_an_untrusted_peer_changes_nothing_on_the_real_envoy(tmp_path: Path) -> None:
    """x-tier is trusted from 127.0.0.1 only (the listener's trusted_headers): sent from 127.0.0.2 it
    never reaches the worker and never selects the critical route; with DEFAULT shut (the sidecar's
    limit at its extreme) such a request gets 429 `overloaded` whichever key sends it, while the
    same header from the trusted peer, and the critical key from any peer, ride HIGH and pass. Before
    trusted_headers (issue 26, attack 3) the forged header made any client critical."""
    port, admin = free_port(), free_port()
    with backends("a") as (a,):
        text = TOPOLOGY.format(admin=admin, port=port, a=a.port)
        with running_envoy(text, tmp_path / "out", secrets=SECRETS) as proc:
            url = f"http://127.0.0.1:{port}/v1/completions"
            body = {"model": "chat-model"}
            assert wait_until(lambda: request(url, body, _auth("web"))[0] == 200)
            urgent = {**_auth("web"), "x-tier": "urgent", "X-Tier": "urgent"}
            assert request_from("127.0.0.2", port, body, urgent)[0] == 200
            assert "x-tier" not in {k.lower() for k in a.requests[-1]["headers"]}
            assert request_from("127.0.0.1", port, body, urgent)[0] == 200
            assert a.requests[-1]["headers"].get("x-tier") == "urgent"
            _set_runtime(proc, {f"circuit_breakers.chat.default.{k}": 0 for k in ("max_requests",
                                                                                    "max_pending_requests")})
            for client in ("web", "batch"):
                status, _, answer = request_from("127.0.0.2", port, body, {**_auth(client), "x-tier": "urgent"})
                assert status == 429 and json.loads(answer)["error"]["code"] == "overloaded", answer
            assert request_from("127.0.0.1", port, body, urgent)[0] == 200
            assert request_from("127.0.0.2", port, body, _auth("ops"))[0] == 200


def test_validate_warns_that_a_strict_dns_pool_sheds_sheddable_traffic_like_standard() -> None:
    """The shed share is the sidecar's (eds pools only): a strict_dns pool that gets sheddable
    traffic (a sheddable route, or a sheddable client) is warned about at its discovery."""
    text = TOPOLOGY.format(admin=1, port=2, a=3).replace("    workers:", "    discovery: strict_dns\n    workers:")
    _, warnings = parse_topology(text.encode(), "classes.yaml")
    found = [d for d in warnings if "shed share" in d.message]
    assert [d.path for d in found] == ["pools[0].discovery"], warnings
    _, warnings = parse_topology(TOPOLOGY.format(admin=1, port=2, a=3).encode(), "classes.yaml")
    assert not [d for d in warnings if "shed share" in d.message]
