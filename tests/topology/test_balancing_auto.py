"""`balancing.policy: auto`, the default: the endpoint picker for pools whose engine reports metrics
and whose picker Envoy can reach as configured; least_request otherwise, with the reason, which
`validate` prints as a note (never a failure, even with --strict). A default never makes a valid
topology invalid: each reason is a check that refuses an explicit prefix_affinity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from confgen import envoy, parse_topology
from confgen.balancing import choose, picker_wanted, policy_of
from confgen.cli import main
from confgen.deploy._canonical import topology_yaml as canonical_yaml
from confgen.errors import Severity, TopologyError
from confgen.model import PICKER_MAX_BODY_BYTES
from confgen.nginx._features import unsupported as feature_warnings

BASE = """
version: 1
name: auto
listeners: [{{name: main, port: 18080{listener}}}]
default_pool: chat
{top}
pools:
  - name: chat
    engine: {engine}
    models: [m]
    workers: ['{worker}']
{pool}
"""


def _text(engine: str = "vllm", worker: str = "10.0.0.1:8000", pool: str = "", top: str = "",
          listener: str = "") -> str:
    return BASE.format(engine=engine, worker=worker, pool=pool, top=top, listener=listener)


def _choice(**kw: str) -> tuple[str, str]:
    topo, diags = parse_topology(_text(**kw).encode())
    assert not [d for d in diags if d.severity is Severity.ERROR], diags
    c = choose(topo, topo.pools[0])
    return c.policy, c.reason


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tgi", "llamacpp"])
def test_auto_is_the_picker_for_engines_with_metrics(engine: str) -> None:
    topo, _ = parse_topology(_text(engine=engine).encode())
    assert topo.pools[0].balancing.policy == "auto"
    assert policy_of(topo, topo.pools[0]) == "prefix_affinity" and picker_wanted(topo)
    cds = json.loads(envoy.render(topo, config_dir="/etc/envoy")[envoy.layout.CDS])["resources"]
    chat = next(c for c in cds if c["name"] == "chat")
    assert "lb_policy" not in chat
    assert chat["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"] == \
        "envoy.load_balancing_policies.override_host"


@pytest.mark.parametrize(("kw", "why"), [
    ({"engine": "openai"}, "engine openai reports no load metrics"),
    ({"pool": "    discovery: strict_dns", "worker": "vllm.internal:8000"}, "discovery strict_dns"),
    ({"top": "sidecar: {address: 10.0.0.9}"}, "set sidecar.grpc_tls"),
    ({"listener": f", max_request_bytes: {PICKER_MAX_BODY_BYTES + 1}"}, "max_request_bytes"),
    ({"top": "sidecar: {grpc_plaintext_loopback: true, grpc_port: 18080}"}, "sidecar.grpc_port 18080 is taken"),
    ({"top": "sidecar: {grpc_plaintext_loopback: true}\nenvoy: {xds: {mode: ads, servers: ['127.0.0.1:18000', "
             "'127.0.0.1:18001']}}"}, "two control planes on one host"),
])
def test_auto_is_least_request_where_the_picker_cannot_work_and_says_why(kw: dict[str, str], why: str) -> None:
    policy, reason = _choice(**kw)
    assert policy == "least_request"
    assert reason.startswith("auto is least_request here: ") and why in reason, reason


def test_mutual_tls_lets_a_remote_sidecar_be_the_picker() -> None:
    tls = "sidecar: {address: 10.0.0.9, grpc_tls: {cert: /t/c.pem, key: /t/k.pem, ca: /t/ca.pem}}"
    assert _choice(top=tls)[0] == "prefix_affinity"


def test_the_same_topologies_with_prefix_affinity_named_are_refused() -> None:
    """Each reason auto falls back for is a refusal of the explicit policy (so auto never turns a
    topology that validated before into one that does not, and never hides a misconfiguration)."""
    named = "    balancing: {policy: prefix_affinity}"
    for kw, field in (({"top": "sidecar: {address: 10.0.0.9}"}, "sidecar.address"),
                      ({"listener": f", max_request_bytes: {PICKER_MAX_BODY_BYTES + 1}"},
                       "listeners[0].max_request_bytes")):
        with pytest.raises(TopologyError) as refused:
            parse_topology(_text(pool=named, **kw).encode())
        assert [d.path for d in refused.value.diagnostics if d.severity is Severity.ERROR] == [field]
    for kw in ({"top": "sidecar: {address: 10.0.0.9}"},
               {"listener": f", max_request_bytes: {PICKER_MAX_BODY_BYTES + 1}"}):
        _, diags = parse_topology(_text(**kw).encode())
        assert not [d for d in diags if d.severity is Severity.ERROR], kw


def test_an_explicit_policy_is_itself() -> None:
    for policy in ("least_request", "round_robin", "prefix_affinity"):
        assert _choice(pool=f"    balancing: {{policy: {policy}}}") == (policy, "")


def test_validate_notes_the_fallback_with_its_place_and_still_passes_strict(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(_text(engine="openai"))
    assert main(["validate", "--strict", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}:8:5: ")  # the pool's entry: balancing is not written
    assert "pools[0].balancing.policy: note: auto is least_request here" in out[0]
    assert out[-1] == f"{path}: ok"
    assert main(["validate", "--format", "json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["path"], r["severity"]) for r in report] == [("pools[0].balancing.policy", "note")]
    path.write_text(_text())  # the picker: nothing to explain
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{path}: ok"]


def test_nginx_says_nothing_of_the_picker_for_auto_and_warns_when_it_is_named() -> None:
    topo, _ = parse_topology(_text().encode())
    assert "pools[0].balancing.policy" not in dict(feature_warnings(topo))
    topo, _ = parse_topology(_text(pool="    balancing: {policy: prefix_affinity}").encode())
    assert "prefix_affinity is Envoy-only" in dict(feature_warnings(topo))["pools[0].balancing.policy"]


def test_the_canonical_topology_keeps_auto_implicit_and_writes_a_named_policy() -> None:
    topo, _ = parse_topology(_text().encode())
    assert "policy" not in canonical_yaml(topo)
    topo, _ = parse_topology(_text(pool="    balancing: {policy: least_request}").encode())
    assert "policy: least_request" in canonical_yaml(topo)


def test_validate_notes_that_several_proxy_pods_each_pick_alone(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A `kubernetes:` section (one that sets something: a real one sets at least its image) with 2
    proxy pods in file mode: each pod's picker knows only its own requests; validate says so as a
    note (never a failure; render and the loader say nothing), and not for 1 pod or without a picker."""
    path = tmp_path / "t.yaml"
    path.write_text(_text(top="kubernetes: {namespace: inference, replicas: 2}\n"))
    assert main(["validate", "--strict", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kubernetes.replicas: note: 2 proxy pods each run their own endpoint picker for chat" in out
    assert "envoy.xds.mode: ads" in out
    path.write_text(_text(top="kubernetes: {namespace: inference, replicas: 1}\n"))
    assert main(["validate", str(path)]) == 0
    assert "kubernetes.replicas" not in capsys.readouterr().out
    # no picker pool: nothing to say
    path.write_text(_text(engine="openai", top="kubernetes: {namespace: inference, replicas: 3}\n"))
    assert main(["validate", str(path)]) == 0
    assert "kubernetes.replicas" not in capsys.readouterr().out


def test_a_pools_admission_budgets_decode_and_validate_says_where_they_do_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pools[].admission` is the picker's (per pool, per class): read as written; on a pool the picker does
    not see (least_request, or nginx) validate warns that it does nothing; a sheddable budget above the
    standard one is a warning (standard traffic would be refused first); a negative one an error with its
    place."""
    adm = "    admission: {standard: 0.8, sheddable: 0.05, min_wait: 250ms}"
    topo, diags = parse_topology(_text(pool=adm).encode())
    assert not diags
    a = topo.pools[0].admission
    assert (a.standard, a.sheddable, a.min_wait.seconds if a.min_wait else None) == (0.8, 0.05, 0.25)
    assert "pools[0].admission" in dict(feature_warnings(topo))  # nginx: the limiter alone
    assert "pools[0].admission" not in dict(feature_warnings(parse_topology(_text().encode())[0]))
    path = tmp_path / "t.yaml"
    path.write_text(_text(pool=adm))
    assert main(["validate", "--strict", str(path)]) == 0
    capsys.readouterr()
    path.write_text(_text(pool=adm + "\n    balancing: {policy: least_request}"))
    assert main(["validate", "--strict", "--format", "json", str(path)]) != 0
    report = json.loads(capsys.readouterr().out)
    found = [r for r in report if r["path"] == "pools[0].admission"]
    assert [r["severity"] for r in found] == ["error"] and "do nothing" in found[0]["message"], report  # strict
    path.write_text(_text(pool="    admission: {standard: 0.2, sheddable: 0.5}"))
    assert main(["validate", "--strict", "--format", "json", str(path)]) != 0
    report = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in report if r["severity"] == "error"] == ["pools[0].admission.sheddable"], report
    path.write_text(_text(pool="    admission: {standard: -1}"))
    assert main(["validate", str(path)]) != 0
    err = capsys.readouterr()
    assert "pools[0].admission.standard" in err.out + err.err
