"""The picker `render --target gateway-api` deploys, live: started with the rendered container's arguments
(paths and ports moved to this machine), called over mutual TLS by a plain Envoy configured as the Gateway API
Inference Extension documents for an endpoint picker (ext_proc FULL_DUPLEX_STREAMED, an ORIGINAL_DST cluster
reading x-gateway-destination-endpoint): the data plane a gateway runs for an InferencePool."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from confgen import parse_topology
from confgen.deploy.gateway_api import EPP_TLS_DIR, render_gateway_api
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, fleet_topology, run_fleet_in_thread
from tests.sidecar_live.rig import FAST_ARGS, Rig, SidecarProcess, poll, worker_specs
from tests.sidecar_live.test_picker_live import _plain_envoy_bootstrap, chat, conversation_system, picks, unpicked
from tests.support.certs import CertAuthority

pytestmark = pytest.mark.timeout(240)


def _local_args(args: list[str], topology: Path, tls: Path, listen: int, grpc: int, xds: int) -> list[str]:
    """The rendered container's arguments on this machine: the same flags, files under `tls`, loopback ports."""
    moved = {"--topology": str(topology), "--listen": f"127.0.0.1:{listen}", "--grpc-listen": f"127.0.0.1:{grpc}",
             "--serve-xds": f"127.0.0.1:{xds}"}
    out = []
    for flag, value in zip(args[::2], args[1::2], strict=True):
        out += [flag, moved.get(flag, value.replace(EPP_TLS_DIR, str(tls)))]
    return out


def _with_client_tls(boot: dict[str, Any], ca: Path, cert: Path, key: Path) -> dict[str, Any]:
    """The ext_proc cluster over TLS with a client certificate, checking the picker's against the CA."""
    (cluster,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "ext_proc"]
    cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["h2"],
            "tls_certificates": [{"certificate_chain": {"filename": str(cert)}, "private_key": {"filename": str(key)}}],
            "validation_context": {"trusted_ca": {"filename": str(ca)}}}}}
    return boot


def test_a_documented_envoy_routes_through_the_rendered_gateway_picker_over_mtls(tmp_path: Path) -> None:
    """Growing conversations from plain clients through the plain Envoy: every request picked by the rendered
    picker (over mTLS, client certificate required) and each conversation kept on one worker."""
    pki = CertAuthority.create(tmp_path / "pki")
    server = pki.issue("confgen-live-epp", ["IP:127.0.0.1", "DNS:confgen-live-epp"])
    gateway = pki.issue("gateway", ["DNS:gateway"])
    tls = tmp_path / "epp-tls"  # the Secret's entries, as cert-manager names them
    tls.mkdir()
    for src, name in ((server.cert, "tls.crt"), (server.key, "tls.key"), (pki.cert, "ca.crt")):
        shutil.copy(src, tls / name)
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["a", "b", "c"]), seed=7)) as fleet:
        listen, grpc, xds = free_port(), free_port(), free_port()
        text = fleet_topology(
            name="live", admin=free_port(), port=free_port(),
            workers=[f"127.0.0.1:{w.port}" for w in fleet.workers], models=["sim-model"], capacity=8,
            pool=["balancing: {policy: prefix_affinity}", "health: {enabled: false}",
                  "outlier_detection: {enabled: false}", "pod_labels: {app: sim}"],
            tail=[f"sidecar: {{port: {listen}, grpc_port: {grpc}}}",
                  "kubernetes: {gateway: gw, sidecar_image: registry.example/confgen:1}"])
        topology = tmp_path / "topology.yaml"
        topology.write_text(text)
        topo, _ = parse_topology(text.encode())
        docs = list(yaml.safe_load_all(render_gateway_api(topo)["gateway-api.yaml"]))
        (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
        assert pool["spec"]["endpointPickerRef"]["port"] == {"number": grpc}
        (container,) = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
        # the picker runs on the topology its ConfigMap carries (sidecar.grpc_tls: the gateway calls it over mTLS)
        (configmap,) = [d for d in docs if d["kind"] == "ConfigMap" and "topology.yaml" in d.get("data", {})]
        topology.write_text(configmap["data"]["topology.yaml"])
        args = _local_args(container["args"], topology, tls, listen, grpc, xds)
        sidecar = SidecarProcess([*args, *FAST_ARGS], tmp_path / "sidecar.log", listen)
        envoy_port = free_port()
        plain = _plain_envoy_bootstrap(envoy_port, free_port(), grpc)
        for cluster in plain["static_resources"]["clusters"]:  # a gateway calls the picker over TCP (mTLS)
            if cluster["name"] == "ext_proc":
                (lb,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
                lb["endpoint"]["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": grpc}}
        boot = _with_client_tls(plain, pki.cert, gateway.cert, gateway.key)
        sidecar.start()
        try:
            sidecar.wait_ready()
            serving = [e for e in sidecar.events() if e.get("event") == "tls.serving"]
            assert any("picker" in str(e.get("service")) and e.get("client_auth") == "required"
                       for e in serving), serving
            with EnvoyProcess(boot) as proxy:
                plain = Rig(fleet, proxy, sidecar, topology, tmp_path, envoy_port, 0)
                warm = [{"role": "user", "content": "warm up"}]
                assert poll(lambda: chat(plain, warm)[0] == 200 and picks(sidecar) > 0, timeout=30), \
                    sidecar.log_tail()
                before, behind = picks(sidecar), unpicked(sidecar, "behind")
                homes: dict[int, Counter[str]] = {}
                for i in range(6):
                    messages = [{"role": "system", "content": conversation_system(300 + i)}]
                    homes[i] = Counter()
                    for turn in range(3):
                        messages.append({"role": "user", "content": f"turn {turn}"})
                        status, worker = chat(plain, messages)
                        assert status == 200, (status, sidecar.log_tail())
                        homes[i][worker] += 1
                        messages.append({"role": "assistant", "content": "ok"})
                # every request picked, none fell open; but one the picker's loop took up late (a loaded
                # machine: Envoy balances it)
                late = unpicked(sidecar, "behind") - behind
                assert picks(sidecar) - before + late == 18 and late <= 2, (late, sidecar.log_tail())
                moved = sum(3 - c.most_common(1)[0][1] for c in homes.values())
                assert moved <= late, homes
        finally:
            code = sidecar.stop()
        assert code == 0, f"sidecar exited {code} on SIGTERM:\n{sidecar.log_tail()}"
