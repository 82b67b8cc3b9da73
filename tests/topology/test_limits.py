"""Rate limits in the topology: scope, unit, window, per-client lists, the store; every
impossible combination is an error at the field's place; the budgets the render and the
rate limit service share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from confgen import limits
from confgen.errors import Severity, TopologyError
from confgen.model import limit_list
from confgen.topology import parse

ROOT = Path(__file__).resolve().parents[2]

BASE = """\
version: 1
name: t
listeners: [{name: public, port: 8080}]
pools:
  - {name: p, engine: vllm, models: [m], workers: ["127.0.0.1:8000"]}
auth:
  api_keys:
    - {client: alice, env: A}
    - client: bob
      env: B
      rate_limit:
        - {requests: 10, per: 1s}
        - {scope: global, unit: total_tokens, tokens: 5000, window: minute, per_model: true}
"""

STORE = """\
limits:
  store: {redis: "127.0.0.1:6379"}
  per_key:
    - {requests: 600, per: 1m}
    - {scope: global, requests: 600, window: minute}
    - {scope: global, unit: output_tokens, tokens: 100000, window: hour, fail_closed: true}
"""


def _errors(text: str) -> list[tuple[int, int, str, str]]:
    with pytest.raises(TopologyError) as info:
        parse(text.encode(), "t.yaml")
    return [(d.line, d.col, d.path, d.message) for d in info.value.diagnostics if d.severity is Severity.ERROR]


def test_a_valid_topology_resolves_local_buckets_and_global_budgets() -> None:
    topo, warnings = parse((BASE + STORE).encode(), "t.yaml")
    assert not [w for w in warnings if w.severity is Severity.ERROR]
    assert topo.auth is not None
    assert limits.local_client_limits(topo) == [
        ("alice", limit_list(topo.limits.per_key)[0]),  # limits.per_key's local bucket
        ("bob", limit_list(topo.auth.api_keys[1].rate_limit)[0]),  # bob's own
    ]
    found = {b.id: b for b in limits.budgets(topo)}
    assert list(found) == ["per_key/1", "per_key/2", "client/bob/1"]
    assert found["per_key/1"].except_clients == ("bob",)  # bob's own list replaces limits.per_key
    assert found["per_key/1"].amount == 600 and found["per_key/1"].window_seconds == 60
    assert found["per_key/2"].tokens and found["per_key/2"].limit.fail_closed
    assert found["client/bob/1"].clients == ("bob",) and found["client/bob/1"].limit.per_model
    assert found["per_key/2"].path == "limits.per_key[2]"
    assert limits.domain(topo) == "confgen.t"


@pytest.mark.parametrize(("snippet", "where", "message"), [
    ("limits:\n  per_key: {scope: global, requests: 5, window: minute}\n",
     (15, 3), "limits: scope: global limits are counted in a shared store"),
    ("limits:\n  store: {redis: 'r:6379'}\n  per_key: {unit: total_tokens, tokens: 5, per: 1s}\n",
     (16, 19), "limits.per_key.unit: total_tokens limits need scope: global"),
    ("limits:\n  store: {redis: 'r:6379'}\n  per_key: {scope: global, requests: 5, per: 1m}\n",
     (16, 12), "limits.per_key.window: a global limit needs window"),
    ("limits:\n  store: {redis: 'r:6379'}\n  per_key: {scope: global, requests: 5, window: minute, burst: 9}\n",
     (16, 64), "limits.per_key.burst: burst is for local token buckets"),
    ("limits:\n  store: {redis: 'r:6379'}\n  per_key: {scope: global, unit: input_tokens, requests: 5, window: day}\n",
     (16, 58), "limits.per_key.requests: unit input_tokens counts tokens"),
    ("limits:\n  store: {redis: 'r:6379'}\n  per_key: {requests: 5, window: day}\n",
     (16, 34), "limits.per_key.window: window is for scope: global limits"),
    ("limits:\n  per_key: [{requests: 5, per: 1s}, {requests: 6, per: 1m}]\n",
     (15, 37), "limits.per_key[1].scope: one local limit per place"),
    ("limits:\n  store: {redis: 'r:6379'}\n  global: {scope: global, tokens: 5, window: second}\n",
     (16, 35), "limits.global.tokens: tokens needs a token unit"),
    ("limits:\n  store: {redis: 'no port'}\n  per_key: {scope: global, requests: 5, window: second}\n",
     (15, 18), "limits.store.redis: 'no port' is not valid"),
])
def test_impossible_combinations_are_errors_at_the_field(snippet: str, where: tuple[int, int], message: str) -> None:
    found = _errors(BASE + snippet)
    shown = [f"{path}: {msg}" for _, _, path, msg in found]
    hits = [(line, col) for line, col, path, msg in found if f"{path}: {msg}".startswith(message)]
    assert hits, shown
    assert hits[0] == where, shown


def test_global_limits_in_ads_mode_are_counted_by_the_control_plane() -> None:
    """envoy.xds.mode ads: validate accepts global limits (the control plane serves the rate limit service);
    beyond loopback only over mTLS, as for ADS itself; each control-plane server is one floor while the store is
    away (limits.store.envoys defaults to the servers, not the Envoys), which the outage warning says."""
    ads = "envoy: {xds: {mode: ads, servers: ['127.0.0.1:18000', 'localhost:18001']}}\n"
    text = BASE + ads + "limits:\n  store: {redis: '127.0.0.1:6379'}\n  per_key: {scope: global, requests: 60, " \
        "window: minute}\n"
    topo, warnings = parse(text.encode(), "t.yaml")
    assert limits.envoys(topo) == 2
    floor = [w.message for w in warnings if w.path == "limits.per_key"]
    assert floor and "each of the 2 control planes (limits.store.envoys) admits 30 requests a minute" in floor[0], floor
    # and when the checks themselves fail open: each Envoy's ceiling (twice the budget, then the budget)
    assert "each Envoy admits up to its ceiling of 120 in that minute and 60 a minute after" in floor[0], floor
    topo, _ = parse(text.replace("window: minute}", "window: minute}\n  store: {redis: '127.0.0.1:6379', envoys: 1}")
                    .replace("  store: {redis: '127.0.0.1:6379'}\n", "", 1).encode(), "t.yaml")
    assert limits.envoys(topo) == 1  # said explicitly: kept
    remote = BASE.replace("127.0.0.1:8000", "10.0.0.1:8000") + \
        "envoy: {xds: {mode: ads, servers: ['10.0.0.5:18000', '10.0.0.6:18000']}}\n" + STORE
    assert [f[2] for f in _errors(remote)] == ["envoy.xds.servers[0]"]  # ADS's own mTLS rule, once


@pytest.mark.parametrize(("store", "where", "message"), [
    ("{timeout: 50ms}", "limits.store", "give redis (host:port) or sentinel"),
    ("{redis: 'r:6379', sentinel: {addresses: ['s:26379'], master: m}}", "limits.store.sentinel", "not both"),
    ("{sentinel: {addresses: [], master: m}}", "limits.store.sentinel.addresses", ""),
    ("{sentinel: {addresses: ['s1:26379', 's1:26379', 's2:26379'], master: m}}",
     "limits.store.sentinel.addresses[1]", "listed twice"),
    ("{sentinel: {addresses: ['s1'], master: m}}", "limits.store.sentinel.addresses[0]", ""),
    ("{sentinel: {addresses: ['s1:26379'], master: 'Not A Name'}}", "limits.store.sentinel.master", ""),
    ("{sentinel: {addresses: ['s1:26379']}}", "limits.store.sentinel.master", "required"),
])
def test_a_sentinel_store_is_checked_at_its_fields(store: str, where: str, message: str) -> None:
    """limits.store.sentinel (a Redis that fails over): exactly one of redis or sentinel, at least one Sentinel
    address (host:port, each once), a master name; each error at its field."""
    text = BASE + f"limits:\n  store: {store}\n  per_key: {{scope: global, requests: 5, window: second}}\n"
    found = [(path, msg) for _, _, path, msg in _errors(text)]
    assert any(path == where and message in msg for path, msg in found), found


def test_a_sentinel_store_resolves_and_warns_about_two_sentinels() -> None:
    text = BASE + "limits:\n  store: {sentinel: {addresses: ['10.0.0.1:26379', '10.0.0.2:26379'], master: rl}}\n" \
        "  per_key: [{requests: 5, per: 1s}, {scope: global, requests: 5, window: second}]\n"
    topo, warnings = parse(text.encode(), "t.yaml")
    assert topo.limits.store is not None and topo.limits.store.redis is None
    assert topo.limits.store.sentinel is not None and topo.limits.store.sentinel.master == "rl"
    assert [w.path for w in warnings if "quorum" in w.message] == ["limits.store.sentinel.addresses"]
    assert not [w for w in warnings if w.severity is Severity.ERROR]
    from confgen._pod_fit import loopback_store

    local, _ = parse(text.replace("10.0.0.1:26379", "127.0.0.1:26379").encode(), "t.yaml")
    assert [path for path, _ in loopback_store(local)] == ["limits.store.sentinel.addresses[0]"]  # in Kubernetes
    with pytest.raises(TopologyError) as info:  # the rendered Redis has no Sentinels
        parse((text + "kubernetes: {redis: true}\n").encode(), "t.yaml")
    assert "kubernetes.redis" in [d.path for d in info.value.diagnostics if d.severity is Severity.ERROR]


def test_the_rate_limit_service_off_loopback_needs_mtls_and_its_port_must_differ() -> None:
    """Off loopback the sidecar serves gRPC only over mTLS: without sidecar.grpc_tls, an error at the address."""
    found = _errors(BASE + STORE + "sidecar: {address: 10.0.0.9}\n")
    assert [f[2] for f in found] == ["sidecar.address"]
    assert "rate limit service" in found[0][3] and "sidecar.grpc_tls" in found[0][3]
    tls = "grpc_tls: {cert: /etc/tls/e.crt, key: /etc/tls/e.key, ca: /etc/tls/ca.crt}"
    _, warnings = parse((BASE + STORE + f"sidecar: {{address: 10.0.0.9, {tls}}}\n").encode(), "t.yaml")
    assert not [w for w in warnings if w.path.startswith("sidecar")]
    found = _errors(BASE + STORE + "sidecar: {port: 9300, grpc_port: 9300}\n")
    assert [f[2] for f in found] == ["sidecar.grpc_port"]


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFGEN_")}
    return subprocess.run([sys.executable, "-m", "confgen", *map(str, args)], capture_output=True, text=True,
                          timeout=60, check=False, env=env, cwd=ROOT)


def test_nginx_refuses_global_and_token_limits_with_the_fields_place(tmp_path: Path) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text(BASE + STORE)
    rendered = _cli("render", topo, "--target", "nginx", "-o", tmp_path / "out", "--placeholder-secrets")
    assert rendered.returncode == 1
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert f"{topo}:13:19: auth.api_keys[1].rate_limit[1].scope: open-source nginx cannot call a rate limit " \
        "service" in rendered.stderr
    assert f"{topo}:18:15: limits.per_key[1].scope:" in rendered.stderr
    assert f"{topo}:19:15: limits.per_key[2].scope:" in rendered.stderr
    # the Envoy render takes the same file
    assert _cli("render", topo, "-o", tmp_path / "envoy", "--placeholder-secrets").returncode == 0
    # validate --nginx refuses it too, before running nginx, every place in file order
    checked = _cli("validate", "--nginx", topo)
    assert checked.returncode == 1
    lines = [line for line in checked.stderr.splitlines() if "open-source nginx cannot call" in line]
    assert [line.split(": ")[0] for line in lines] == [f"{topo}:13:19", f"{topo}:18:15", f"{topo}:19:15"]


def test_each_requests_budget_that_fails_open_has_a_ceiling_of_twice_its_amount() -> None:
    """The bound on checks that fail open (confgen.limits.Ceiling): every requests budget that fails
    open gets a bucket of twice its amount refilled by its amount each window, for the clients it
    counts (limits.per_key: every client without its own rate_limit); token budgets (known only at the
    answer's end) and fail_closed budgets (refused by Envoy when the service cannot answer) get none."""
    topo, _ = parse((BASE + STORE).encode(), "t.yaml")
    found = limits.ceilings(topo)
    assert [(c.budget.id, c.max_tokens, c.tokens_per_fill, c.fill_seconds) for c in found] == [
        ("per_key/1", 1200, 600, 60)]
    assert limits.budget_clients(topo, found[0].budget) == ("alice",)  # bob's own rate_limit replaces per_key
    assert all(b.tokens or b.limit.fail_closed for b in limits.budgets(topo) if b.id != "per_key/1")
