"""--target kubernetes with envoy.xds.mode: ads: a control plane (2 replicas) and Envoys without sidecars."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from confgen import parse_topology
from confgen.deploy import render_kubernetes
from confgen.errors import DeployError
from sidecar.config import from_argv
from sidecar.config.tls import TlsFiles
from sidecar.outputs.tls import node_bound

TOPOLOGY = """\
version: 1
name: fleet
listeners: [{name: public, port: 8080}]
kubernetes: {namespace: inference, replicas: 3, envoy_max_replicas: 12}
envoy:
  xds:
    mode: ads
    servers:
      - confgen-fleet-xds-0.confgen-fleet-xds.inference.svc:18000
      - confgen-fleet-xds-1.confgen-fleet-xds.inference.svc:18000
    tls: {cert: /etc/envoy/xds-tls/tls.crt, key: /etc/envoy/xds-tls/tls.key, ca: /etc/envoy/xds-ca/ca.crt}
pools:
  - name: chat
    engine: vllm
    models: [m]
    balancing: {policy: least_request}  # the picker's own objects: PICKER below
    workers: ["10.0.0.1:8000", "10.0.0.2:8000"]
"""


def test_ads_manifests_run_a_control_plane_and_sidecarless_envoys() -> None:
    """Every object validates strictly against Kubernetes 1.30; the control plane is 2 replicas serving ADS on
    the servers' port behind a headless Service (per-pod names); the Envoy pods carry no sidecar, take their node
    id from the pod name, and an HPA scales them on CPU between kubernetes.replicas and envoy_max_replicas."""
    topo, _ = parse_topology(TOPOLOGY.encode())
    docs = list(yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    cp = by[("StatefulSet", "confgen-fleet-xds")]["spec"]
    assert cp["replicas"] == 2 and cp["serviceName"] == "confgen-fleet-xds"
    (container,) = cp["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--serve-xds") + 1] == "0.0.0.0:18000"
    svc = by[("Service", "confgen-fleet-xds")]["spec"]
    assert svc["clusterIP"] == "None" and svc["ports"][0]["port"] == 18000
    assert svc["selector"]["app.kubernetes.io/component"] == "control-plane"

    pod = by[("Deployment", "confgen-fleet")]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["envoy"]
    envoy = pod["containers"][0]
    assert envoy["args"][envoy["args"].index("--service-node") + 1] == "confgen-fleet-envoy/$(POD_NAME)"
    assert pod["initContainers"][0]["command"][:2] == ["confgen", "render"]
    listeners = by[("Service", "confgen-fleet")]["spec"]
    assert listeners["selector"]["app.kubernetes.io/component"] == "envoy"  # never the control plane's pods
    hpa = by[("HorizontalPodAutoscaler", "confgen-fleet")]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (3, 12)
    assert hpa["metrics"][0]["resource"]["name"] == "cpu"


def test_ads_manifests_serve_over_mtls_behind_a_network_policy() -> None:
    """The control plane takes its certificate, key and client CA from the Secret confgen-fleet-xds-tls
    (cert-manager's entries) and its flags parse into mTLS; the Envoys mount confgen-fleet-envoy-tls where
    envoy.xds.tls says, and their node id is bound to the shared certificate's name; a NetworkPolicy lets only
    the Envoy pods reach the gRPC port and only scrapers reach /metrics."""
    topo, _ = parse_topology(TOPOLOGY.encode())
    docs = list(yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]))
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    cp = by[("StatefulSet", "confgen-fleet-xds")]["spec"]["template"]["spec"]
    (container,) = cp["containers"]
    config = from_argv(container["args"])
    assert config.xds_tls == TlsFiles(Path("/etc/confgen/xds-tls/tls.crt"), Path("/etc/confgen/xds-tls/tls.key"),
                                      Path("/etc/confgen/xds-tls/ca.crt"))
    assert config.serve_xds == ("0.0.0.0", 18000) and config.xds_max_nodes == 14  # HPA max 12 + surge
    volumes = {v["name"]: v for v in cp["volumes"]}
    assert volumes["xds-tls"]["secret"]["secretName"] == "confgen-fleet-xds-tls"
    assert {"name": "xds-tls", "mountPath": "/etc/confgen/xds-tls", "readOnly": True} in container["volumeMounts"]

    pod = by[("Deployment", "confgen-fleet")]["spec"]["template"]["spec"]
    envoy = pod["containers"][0]
    secret = {v["name"]: v for v in pod["volumes"]}["envoy-tls"]["secret"]
    assert secret["secretName"] == "confgen-fleet-envoy-tls"
    assert secret["items"] == [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"},
                               {"key": "ca.crt", "path": "ca.crt"}]
    mounts = {m["mountPath"] for m in envoy["volumeMounts"] if m["name"] == "envoy-tls"}
    assert mounts == {"/etc/envoy/xds-tls", "/etc/envoy/xds-ca"}
    node = envoy["args"][envoy["args"].index("--service-node") + 1].replace("$(POD_NAME)", "confgen-fleet-7f9-abc")
    assert node_bound(node, frozenset({"confgen-fleet-envoy"}))
    assert not node_bound(node, frozenset({"confgen-fleet-other"}))

    policy = by[("NetworkPolicy", "confgen-fleet-xds")]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "control-plane"
    assert policy["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = policy["ingress"]
    assert grpc_rule["ports"] == [{"protocol": "TCP", "port": 18000}]
    assert grpc_rule["from"] == [{"podSelector": {"matchLabels": by[("Deployment", "confgen-fleet")]["spec"][
        "selector"]["matchLabels"]}}]
    assert metrics_rule["ports"] == [{"protocol": "TCP", "port": 9109}]
    assert metrics_rule["from"] == [{"namespaceSelector": {},
                                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def test_ads_manifests_need_mtls() -> None:
    """Servers beyond loopback without TLS: validate refuses it (ADS serves the API keys) before any render."""
    from confgen.errors import TopologyError

    text = TOPOLOGY.replace("    tls: {cert: /etc/envoy/xds-tls/tls.crt, key: /etc/envoy/xds-tls/tls.key, "
                            "ca: /etc/envoy/xds-ca/ca.crt}\n", "")
    with pytest.raises(TopologyError) as err:
        parse_topology(text.encode())
    assert any(d.path == "envoy.xds.servers[0]" and "sidecar.grpc_tls" in d.message for d in err.value.diagnostics)
    same = TOPOLOGY.replace("/etc/envoy/xds-ca/ca.crt", "/etc/envoy/xds-ca/tls.crt")
    topo, _ = parse_topology(same.encode())
    with pytest.raises(DeployError, match="distinct file names"):
        render_kubernetes(topo)


PICKER = TOPOLOGY.replace('    balancing: {policy: least_request}  # the picker\'s own objects: PICKER below\n'
                          '    workers: ["10.0.0.1:8000", "10.0.0.2:8000"]\n',
                          '    balancing: {policy: prefix_affinity}\n'
                          '    workers: ["10.0.0.1:8000", "10.0.0.2:8000"]\n'
                          'sidecar:\n  grpc_port: 9300\n'
                          '  grpc_tls: {cert: /etc/envoy/xds-tls/tls.crt, key: /etc/envoy/xds-tls/tls.key, '
                          'ca: /etc/envoy/xds-ca/ca.crt}\n')


def test_the_control_plane_serves_the_picker_over_mtls() -> None:
    """A prefix_affinity pool: the control plane runs the endpoint picker beyond loopback with the xds Secret's
    certificate as its gRPC certificate (its flags parse into mTLS), exposes it on the headless Service, and the
    NetworkPolicy admits that port from the Envoy pods and, for the replicas' pickers as peers, its own pods;
    the Envoys' bootstrap needs nothing new (the picker's
    cluster, with its TLS context to the control plane's names, comes over ADS)."""
    from confgen import envoy as envoy_render

    topo, _ = parse_topology(PICKER.encode())
    docs = list(yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    cp = by[("StatefulSet", "confgen-fleet-xds")]["spec"]["template"]["spec"]
    (container,) = cp["containers"]
    config = from_argv(container["args"])
    assert config.grpc_listen == ("0.0.0.0", 9300)
    assert config.grpc_tls == config.xds_tls == TlsFiles(
        Path("/etc/confgen/xds-tls/tls.crt"), Path("/etc/confgen/xds-tls/tls.key"), Path("/etc/confgen/xds-tls/ca.crt"))
    assert {"name": "grpc", "containerPort": 9300} in container["ports"]
    svc = by[("Service", "confgen-fleet-xds")]["spec"]
    assert {"name": "grpc", "port": 9300, "targetPort": "grpc", "appProtocol": "grpc"} in svc["ports"]
    grpc_rule, peer_rule, metrics_rule = by[("NetworkPolicy", "confgen-fleet-xds")]["spec"]["ingress"]
    assert grpc_rule["ports"] == [{"protocol": "TCP", "port": 18000}, {"protocol": "TCP", "port": 9300}]
    assert grpc_rule["from"] == [{"podSelector": {"matchLabels": by[("Deployment", "confgen-fleet")]["spec"][
        "selector"]["matchLabels"]}}]
    # the replicas' pickers are peers: the picker's port (only) from the control plane's own pods
    assert peer_rule["ports"] == [{"protocol": "TCP", "port": 9300}]
    assert peer_rule["from"] == [{"podSelector": {"matchLabels": by[("StatefulSet", "confgen-fleet-xds")]["spec"][
        "selector"]["matchLabels"]}}]
    assert config.picker_peers and all(t.endswith(":9300") for t in config.picker_peers)
    assert metrics_rule["ports"] == [{"protocol": "TCP", "port": 9109}]
    # What the control plane serves the Envoys: the picker at its per-pod names, over mTLS with the Envoys'
    # certificate (mounted by the Deployment for ADS already).
    clusters = {c["name"]: c for c in envoy_render.ads_static_bootstrap(topo)["static_resources"]["clusters"]}
    cluster = clusters["confgen_sidecar_grpc"]
    hosts = [g["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["address"]
             for g in cluster["load_assignment"]["endpoints"]]
    assert hosts == ["confgen-fleet-xds-0.confgen-fleet-xds.inference.svc",
                     "confgen-fleet-xds-1.confgen-fleet-xds.inference.svc"]
    ctx = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    assert ctx["tls_certificates"][0]["certificate_chain"]["filename"] == "/etc/envoy/xds-tls/tls.crt"
    assert [m["matcher"]["exact"] for m in ctx["validation_context"]["match_typed_subject_alt_names"]] == hosts


def test_without_the_picker_the_control_plane_has_no_grpc_port() -> None:
    topo, _ = parse_topology(TOPOLOGY.encode())
    docs = list(yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]))
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (container,) = by[("StatefulSet", "confgen-fleet-xds")]["spec"]["template"]["spec"]["containers"]
    assert "--grpc-listen" not in container["args"]
    assert container["args"].count("--grpc-tls-cert") == 1  # one TLS setup (ADS's), no deprecated --xds-tls-*
    assert not [a for a in container["args"] if a.startswith("--xds-tls") or a == "--xds-client-ca"]
    # the Envoy pods share one certificate: it counts for the limits as many Envoys as the HPA may run
    assert container["args"][container["args"].index("--xds-nodes-per-identity") + 1] == "12"
    assert [p["port"] for p in by[("NetworkPolicy", "confgen-fleet-xds")]["spec"]["ingress"][0]["ports"]] == [18000]


def test_the_control_plane_serves_global_limits_and_the_rendered_redis_admits_it() -> None:
    """Global limits in mode ads: the control plane (not the Envoys, which have no sidecar) serves the rate limit
    service on sidecar.grpc_port over the same mTLS as ADS, with the CPU a sidecar with global limits gets; the
    NetworkPolicy admits that port from the Envoys; the rendered Redis admits the control plane's pods (the ones
    counting in it), not the Envoys'; the Envoys' rate limit filter calls the control plane over that mTLS."""
    from confgen import envoy as envoy_render

    text = TOPOLOGY.replace("kubernetes: {namespace: inference, replicas: 3, envoy_max_replicas: 12}",
                            "kubernetes: {namespace: inference, replicas: 3, envoy_max_replicas: 12, redis: true}")
    text += "limits:\n  store: {redis: 'confgen-fleet-redis:6379'}\n" \
        "  global: [{requests: 100, per: 1s}, {scope: global, requests: 6000, window: minute}]\n"
    topo, _ = parse_topology(text.encode())
    docs = list(yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (container,) = by[("StatefulSet", "confgen-fleet-xds")]["spec"]["template"]["spec"]["containers"]
    config = from_argv(container["args"])
    assert config.grpc_listen == ("0.0.0.0", 9110) and config.grpc_tls is not None
    assert container["resources"]["requests"]["cpu"] == "500m"
    grpc_rule, _ = by[("NetworkPolicy", "confgen-fleet-xds")]["spec"]["ingress"]
    assert [p["port"] for p in grpc_rule["ports"]] == [18000, 9110]
    redis_from = by[("NetworkPolicy", "confgen-fleet-redis")]["spec"]["ingress"][0]["from"]
    control_labels = by[("StatefulSet", "confgen-fleet-xds")]["spec"]["selector"]["matchLabels"]
    assert redis_from == [{"podSelector": {"matchLabels": control_labels}}]
    assert ("Deployment", "confgen-fleet-redis") in by
    served = envoy_render.ads_static_bootstrap(topo)
    clusters = {c["name"]: c for c in served["static_resources"]["clusters"]}
    assert "transport_socket" in clusters["confgen_sidecar_grpc"]
    assert '"envoy.filters.http.ratelimit"' in str(served).replace("'", '"')


def test_the_picker_in_kubernetes_needs_the_envoys_certificate(tmp_path: Path) -> None:
    """One TLS block: the deprecated envoy.xds.tls alone is read as sidecar.grpc_tls (a warning), for ADS and the
    picker alike; both given with other files is an error at envoy.xds.tls (the sidecar has one TLS setup)."""
    from confgen import envoy as envoy_render
    from confgen.errors import TopologyError
    from confgen.topology import load

    bare = PICKER.split("  grpc_tls:")[0]
    path = tmp_path / "topology.yaml"
    path.write_text(bare)
    topo, warnings = load(path)
    assert any(w.path == "envoy.xds.tls" and "deprecated" in w.message for w in warnings), warnings
    clusters = {c["name"]: c for c in envoy_render.ads_static_bootstrap(topo)["static_resources"]["clusters"]}
    ctx = clusters["confgen_sidecar_grpc"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert ctx["tls_certificates"][0]["certificate_chain"]["filename"] == "/etc/envoy/xds-tls/tls.crt"
    head, _, tail = PICKER.rpartition("/etc/envoy/xds-ca/ca.crt")  # the last one: grpc_tls's
    other = head + "/etc/envoy/grpc-ca/ca.crt" + tail
    with pytest.raises(TopologyError) as err:
        parse_topology(other.encode())
    assert any(d.path == "envoy.xds.tls" and "not the same as sidecar.grpc_tls" in d.message
               for d in err.value.diagnostics), err.value.diagnostics
    clash = PICKER.replace("grpc_port: 9300", "grpc_port: 18000")  # the ADS port: validate refuses it now
    with pytest.raises(TopologyError, match=r"envoy\.xds\.servers\[0\]: port 18000 is also the sidecar's gRPC"):
        parse_topology(clash.encode())
