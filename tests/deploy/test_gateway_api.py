"""`confgen render --target gateway-api`: InferencePools whose endpoint picker is confgen-sidecar."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from confgen import load_topology, parse_topology
from confgen.deploy.gateway_api import render_gateway_api
from confgen.errors import DeployError
from sidecar.config import from_argv
from tests.deploy.gateway_schemas import SCHEMAS, cel_rules
from tests.deploy.pss import violations
from tests.deploy.test_kustomize import ids, kustomize, write

ROOT = Path(__file__).resolve().parents[2]
GIE = ROOT / "tests/golden/inputs/gateway-api.yaml"
ONE = """\
version: 1
name: agents
listeners: [{name: public, port: 8080}]
kubernetes: {namespace: inference, gateway: gw}
pools:
  - name: llama-8b
    engine: vllm
    models: [m]
    balancing: {policy: prefix_affinity}
    pod_labels: {app: vllm}
    workers: ["vllm.inference.svc.cluster.local:8000"]
"""


def docs_of(files: dict[str, bytes]) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(files["gateway-api.yaml"]) if d is not None]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def schema_errors(doc: dict[str, Any]) -> list[str]:
    schema = SCHEMAS[(doc["apiVersion"], doc["kind"])]
    found = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    return found + cel_rules(doc)


@pytest.mark.parametrize("text", [GIE.read_text(), ONE], ids=["two-pools", "one-pool"])
def test_every_rendered_object_is_valid_and_kustomize_builds_them(text: str, tmp_path: Path) -> None:
    """InferencePool and HTTPRoute validate against the v1 APIs' schemas (unknown fields refused, CEL rules
    checked), the picker's ConfigMap, Deployment and Service strictly against Kubernetes 1.30, its pod meets
    Pod Security "restricted", and the real `kubectl kustomize` builds the base to the same objects."""
    topo, _ = parse_topology(text.encode(), "t.yaml")
    files = render_gateway_api(topo)
    docs = docs_of(files)
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in SCHEMAS:
            assert schema_errors(doc) == [], doc
        else:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
    assert violations(by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]) == []
    write(files, tmp_path)
    assert ids(kustomize(tmp_path)) == ids(docs)


def test_the_schemas_refuse_what_the_api_refuses() -> None:
    """The check can fail: no target port, an unknown field, a bad failure mode, duplicate ports, a Service
    reference without its port, a route rule without matches' shape."""
    topo, _ = parse_topology(ONE.encode(), "t.yaml")
    pool = by_kind(docs_of(render_gateway_api(topo)), "InferencePool")[0]
    route = by_kind(docs_of(render_gateway_api(topo)), "HTTPRoute")[0]
    spec = pool["spec"]
    broken = [
        {**pool, "spec": {**spec, "targetPorts": []}},
        {**pool, "spec": {**spec, "extensionRef": {"name": "x"}}},  # the v1alpha2 name of endpointPickerRef
        {**pool, "spec": {**spec, "endpointPickerRef": {**spec["endpointPickerRef"], "failureMode": "Open"}}},
        {**pool, "spec": {**spec, "targetPorts": [{"number": 8000}, {"number": 8000}]}},
        {**pool, "spec": {**spec, "endpointPickerRef": {"name": "epp"}}},
        {**route, "spec": {**route["spec"], "rules": [{"matches": {"path": "/"}}]}},
    ]
    for doc in broken:
        assert schema_errors(doc), doc


def test_the_pool_picks_with_the_rendered_picker_over_mutual_tls() -> None:
    """Each InferencePool's endpointPickerRef is the rendered picker Service's gRPC port, which is where the
    picker container listens (on the pod's addresses, so over mTLS: --grpc-tls-* from the Secret
    <base>-epp-tls, cert-manager's entries); it fails open like the render's own Envoy. The picker publishes
    to no Envoy (its ADS port on the pod's loopback), and the pool's selector and ports are the workers'."""
    topo, _ = load_topology(GIE)
    docs = docs_of(render_gateway_api(topo))
    service = by_kind(docs, "Service")[0]
    container = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    config = from_argv(container["args"])
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert config.grpc_listen == ("0.0.0.0", grpc["port"]) and grpc["targetPort"] == "grpc"
    assert config.grpc_tls is not None and str(config.grpc_tls.cert).startswith("/etc/confgen/epp-tls/")
    assert config.serve_xds is not None and config.serve_xds[0] == "127.0.0.1" and config.publisher == "ads"
    volume = next(v for v in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "epp-tls")
    assert volume["secret"]["secretName"] == "confgen-gie-epp-tls"
    pools = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "InferencePool")}
    assert set(pools) == {"chat", "big"}  # embed (least_request) has no picker
    for spec in pools.values():
        assert spec["endpointPickerRef"] == {"group": "", "kind": "Service", "name": service["metadata"]["name"],
                                             "port": {"number": grpc["port"]}, "failureMode": "FailOpen"}
        assert spec["targetPorts"] == [{"number": 8000}]
    assert pools["big"]["selector"] == {"matchLabels": {"app": "vllm-70b", "tier": "gpu"}}
    (route,) = by_kind(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway"}]
    rules = route["spec"]["rules"]
    chosen = {m["headers"][0]["value"]: r["backendRefs"][0]["name"] for r in rules for m in r["matches"]
              if "headers" in m}
    assert chosen == {"meta-llama/Llama-3.1-8B-Instruct": "chat", "chat": "chat",
                      "meta-llama/Llama-3.1-70B-Instruct": "big"}
    assert rules[-1] == {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                         "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                          "name": "chat"}]}  # default_pool takes requests naming no model


def test_two_pools_whose_inference_pools_would_share_a_name_are_refused() -> None:
    """Found by review: pools llama_8b and llama-8b both became InferencePool llama-8b (a Kubernetes name
    has no "_"): applied, the second replaced the first and its HTTPRoute rule sent the first's models to
    the second's pods."""
    two = ONE.replace("pools:\n", "pools:\n  - name: llama_8b\n    engine: vllm\n    models: [n]\n"
                      "    balancing: {policy: prefix_affinity}\n    pod_labels: {app: other}\n"
                      "    workers: [\"other.inference.svc.cluster.local:8000\"]\n")
    topo, _ = parse_topology(two.encode(), "t.yaml")
    with pytest.raises(DeployError) as err:
        render_gateway_api(topo)
    assert [p for p, _ in err.value.problems] == ["pools[1].name"]
    assert "'llama-8b'" in err.value.problems[0][1]


def test_more_picker_pools_than_one_http_route_holds_are_refused() -> None:
    """Found by review: 17 picker pools made an HTTPRoute of 17 rules (the API allows 16: refused at apply)
    while render said nothing. Refused at render; 16 render, and their route validates."""

    def topology(n: int) -> str:
        pools = "".join(f"  - name: p{i}\n    engine: vllm\n    models: [m{i}]\n    balancing: {{policy: "
                        f"prefix_affinity}}\n    pod_labels: {{app: p{i}}}\n"
                        f"    workers: [\"p{i}.inference.svc.cluster.local:8000\"]\n" for i in range(n))
        return ONE.split("pools:\n")[0] + "pools:\n" + pools

    topo, _ = parse_topology(topology(16).encode(), "t.yaml")
    route = by_kind(docs_of(render_gateway_api(topo)), "HTTPRoute")[0]
    assert len(route["spec"]["rules"]) == 16 and schema_errors(route) == []
    topo, _ = parse_topology(topology(17).encode(), "t.yaml")
    with pytest.raises(DeployError) as err:
        render_gateway_api(topo)
    assert [p for p, _ in err.value.problems] == ["pools"] and "17 rules" in err.value.problems[0][1]


def test_what_cannot_be_a_pool_is_refused_at_its_place(tmp_path: Path) -> None:
    """No pool label selector, no Gateway, no pool with the picker, ADS mode: render exits 1 with
    file:line:col and writes nothing."""
    topo, _ = parse_topology(ONE.encode(), "t.yaml")
    for changed, path in [
        (dataclasses.replace(topo, pools=[dataclasses.replace(topo.pools[0], pod_labels={})]), "pools[0].pod_labels"),
        (dataclasses.replace(topo, kubernetes=dataclasses.replace(topo.kubernetes, gateway=None)),
         "kubernetes.gateway"),
    ]:
        with pytest.raises(DeployError) as err:
            render_gateway_api(changed)
        assert [p for p, _ in err.value.problems] == [path]
    source = tmp_path / "t.yaml"
    source.write_text(ONE.replace("    pod_labels: {app: vllm}\n", ""))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "confgen", "render", str(source), "--target", "gateway-api",
                           "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and not out.exists()
    assert f"{source}:6:5: pools[0].pod_labels: an InferencePool selects its pods by label" in done.stderr
    source.write_text(ONE.replace("prefix_affinity", "least_request"))
    done = subprocess.run([sys.executable, "-m", "confgen", "render", str(source), "--target", "gateway-api",
                           "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no pool has balancing.policy prefix_affinity" in done.stderr


def test_a_pool_without_the_picker_is_said_to_be_left_out() -> None:
    """A pool that does not use prefix_affinity gets no InferencePool; render warns at its policy."""
    from confgen import targets

    topo, _ = load_topology(GIE)
    warnings = targets.get("gateway-api").warnings(topo)
    assert [p for p, _ in warnings] == ["pools[2].balancing.policy"]
