"""ADS over mutual TLS, with real Envoys: who gets the configuration (and the API keys in it).

One sidecar (`python -m sidecar.main --serve-xds ... --xds-tls-cert/-key --xds-client-ca`: the
deprecated names of --grpc-tls-*, kept working for one release, and tested so here)
and certificates from a throwaway CA (openssl CLI). Envoys start from `confgen render` of a
topology with `envoy.xds.tls`:
- envoy-0 with its own certificate: connected, served, traffic with the API key -> 200;
- envoy-1 presenting envoy-0's certificate: refused (PERMISSION_DENIED), no listener;
- an Envoy with no client certificate: the handshake fails, no listener;
and grpcio clients: no certificate / plaintext -> UNAVAILABLE before any request; a valid
certificate speaking for another node -> PERMISSION_DENIED with nothing received; a
certificate from another CA -> UNAVAILABLE. The key never appears in what a refused
client received. Wall time ~15 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import SidecarProcess, ads_bootstrap, control_plane, poll, worker_specs
from tests.support.certs import Cert, CertAuthority

API_KEY = "sk-mtls-test-key-0123456789abcdef"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
ECDS = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"  # the API keys (apart from LDS)

TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: {admin}}}
listeners:
  - {{name: public, address: 127.0.0.1, port: {port}}}
auth:
  api_keys:
    - {{client: team-a, file: {key_file}}}
envoy:
  xds:
    mode: ads
    servers: ["127.0.0.1:{xds}"]
    protocol: {protocol}
    tls: {{cert: {cert}, key: {key}, ca: {ca}}}
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 4
    balancing: {{policy: least_request}}  # ADS over mTLS here; the picker over it: test_ads_picker.py
    health: {{enabled: false}}
    outlier_detection: {{enabled: false}}
    workers:
{workers}
"""


@dataclass
class Pki:
    ca: CertAuthority
    server: Cert
    envoys: dict[str, Cert]
    stranger: Cert  # signed by another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = CertAuthority.create(root / "ca")
    other = CertAuthority.create(root / "other", name="not-our-ca")
    return Pki(ca, ca.issue("xds", ["IP:127.0.0.1"]),
               {name: ca.issue(name, [f"DNS:{name}"]) for name in ("envoy-0", "envoy-1")},
               other.issue("envoy-0", ["DNS:envoy-0"]))


def _tls_context(bootstrap: dict[str, Any]) -> dict[str, Any]:
    cluster = bootstrap["static_resources"]["clusters"][0]
    assert cluster["name"] == "confgen_xds"
    context: dict[str, Any] = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    return context


async def _ask(port: int, node: str, creds: grpc.ChannelCredentials | None,
               type_url: str = ECDS) -> tuple[str, bytes]:
    """One SotW request for the API keys (or `type_url`) as `node`; (status code name, bytes received)."""
    received = b""
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.secure_channel(target, creds) if creds is not None else grpc.aio.insecure_channel(target)
    async with channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)

        async def requests() -> AsyncIterator[Any]:
            names = ["envoy.filters.http.api_key_auth"] if type_url == ECDS else []
            yield discovery_pb2.DiscoveryRequest(node={"id": node}, type_url=type_url, resource_names=names)
            await asyncio.sleep(30)  # keep the stream open; the call's timeout ends it

        try:
            async for response in stub.StreamAggregatedResources(requests(), timeout=5):
                received += response.SerializeToString()
                return "OK", received
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, received
    return "CLOSED", received


def _creds(pki: Pki, cert: Cert | None) -> grpc.ChannelCredentials:
    if cert is None:
        return grpc.ssl_channel_credentials(pki.ca.cert.read_bytes())
    return grpc.ssl_channel_credentials(pki.ca.cert.read_bytes(), cert.key.read_bytes(), cert.cert.read_bytes())


def _send(port: int) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 2}).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


@contextlib.contextmanager
def _envoy(bootstrap: dict[str, Any], node: str, fetch_timeout: str | None = None) -> Iterator[EnvoyProcess]:
    config = copy.deepcopy(bootstrap)
    config["admin"]["address"]["socket_address"]["port_value"] = 0  # EnvoyProcess reads the one it got
    if fetch_timeout is not None:  # a refused Envoy: ready (empty) after this instead of Envoy's 15 s
        for key in ("cds_config", "lds_config"):
            config["dynamic_resources"][key]["initial_fetch_timeout"] = fetch_timeout
        for layer in config["layered_runtime"]["layers"]:
            if "rtds_layer" in layer:
                layer["rtds_layer"]["rtds_config"]["initial_fetch_timeout"] = fetch_timeout
    proxy = EnvoyProcess(config, extra_args=["--service-node", node])
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


def test_only_the_envoy_holding_its_certificate_is_served(tmp_path: Path, pki: Pki) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY)
    key_file.chmod(0o600)
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["w1", "w2"], max_num_seqs=4), seed=5)) as fleet:
        xds, port = free_port(), free_port()
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)

        def text(cert: Cert, protocol: str = "delta") -> str:
            return TOPOLOGY.format(admin=free_port(), port=port, key_file=key_file, xds=xds, protocol=protocol,
                                   cert=cert.cert, key=cert.key, ca=pki.ca.cert, workers=workers)

        topology = tmp_path / "topology.yaml"
        topology.write_text(text(pki.envoys["envoy-0"]))
        with control_plane(topology, xds, tmp_path / "sidecar.log",
                           "--xds-tls-cert", str(pki.server.cert), "--xds-tls-key", str(pki.server.key),
                           "--xds-client-ca", str(pki.ca.cert), clean_exit=True) as sidecar:
            assert sidecar.state()["xds"]["transport"] == "mtls"
            # the deprecated names (--xds-tls-*, envoy.xds.tls) still work for one release, with a warning
            assert any(e.get("event") == "startup.deprecated" and "--grpc-tls-cert" in str(e.get("note"))
                       for e in sidecar.events()), sidecar.log_tail()
            _check_envoys(sidecar, pki, tmp_path, text, port)
            _check_grpc_clients(sidecar, pki, xds)
            log = sidecar.log_path.read_text(errors="replace")
            assert API_KEY not in log
            assert "Traceback" not in log, sidecar.log_tail()
            # refused handshakes are not logged one line each by gRPC core (GRPC_VERBOSITY=ERROR by default)
            assert "Handshake failed" not in log


def _check_envoys(sidecar: SidecarProcess, pki: Pki, tmp: Path, text: Any, port: int) -> None:
    good = ads_bootstrap(text(pki.envoys["envoy-0"]), tmp / "envoy-0")
    assert _tls_context(good)["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}]
    with _envoy(good, "envoy-0") as proxy:
        assert poll(lambda: "envoy-0" in sidecar.state()["xds"]["nodes"], timeout=10)
        assert poll(lambda: _send(port) == 200, timeout=10)
        assert [_send(port) for _ in range(10)] == [200] * 10
        assert proxy.stats().get("cluster.confgen_xds.ssl.handshake", "0") != "0"

        # envoy-1 holding envoy-0's certificate (sotw, to cover both protocols): refused, never served.
        impostor = ads_bootstrap(text(pki.envoys["envoy-0"], "sotw"), tmp / "envoy-1")
        before = sidecar.state()["xds"]["refused"].get("PERMISSION_DENIED", 0)
        with _envoy(impostor, "envoy-1", fetch_timeout="1s") as refused:
            assert poll(lambda: sidecar.state()["xds"]["refused"].get("PERMISSION_DENIED", 0) > before, timeout=10)
            assert "envoy-1" not in sidecar.state()["xds"]["nodes"]
            status, body = refused.admin_get("/listeners?format=json")
            assert status == 200 and json.loads(body).get("listener_statuses", []) == [], body
            assert API_KEY not in refused.admin_get("/config_dump?include_eds")[1]

        # No client certificate at all: the handshake fails, nothing is served.
        bare = copy.deepcopy(good)
        del _tls_context(bare)["tls_certificates"]
        with _envoy(bare, "envoy-0", fetch_timeout="1s") as refused:
            assert poll(lambda: int(refused.stats().get("cluster.confgen_xds.ssl.connection_error", "0")) +
                        int(refused.stats().get("cluster.confgen_xds.upstream_cx_destroy_remote", "0")) > 0,
                        timeout=10), refused.stats()
            status, body = refused.admin_get("/listeners?format=json")
            assert json.loads(body).get("listener_statuses", []) == [], body
        # The served Envoy kept its stream through all of it.
        assert sidecar.state()["xds"]["nodes"]["envoy-0"]["streams"] == 1
        assert _send(port) == 200


def _check_grpc_clients(sidecar: SidecarProcess, pki: Pki, xds: int) -> None:
    async def run() -> dict[str, tuple[str, bytes]]:
        return {
            "valid": await _ask(xds, "envoy-1", _creds(pki, pki.envoys["envoy-1"])),
            "listeners": await _ask(xds, "envoy-1", _creds(pki, pki.envoys["envoy-1"]), LDS),
            "group": await _ask(xds, "envoy-1/pod-a", _creds(pki, pki.envoys["envoy-1"])),
            "another node": await _ask(xds, "envoy-0", _creds(pki, pki.envoys["envoy-1"])),
            "another group": await _ask(xds, "envoy-0/pod-a", _creds(pki, pki.envoys["envoy-1"])),
            "no certificate": await _ask(xds, "envoy-0", _creds(pki, None)),
            "other CA": await _ask(xds, "envoy-0", _creds(pki, pki.stranger)),
            "plaintext": await _ask(xds, "envoy-0", None),
        }

    results = asyncio.run(run())
    assert results["valid"][0] == "OK" and API_KEY.encode() in results["valid"][1]
    # the keys travel apart from the listeners (ECDS): a listener update carries none
    assert results["listeners"][0] == "OK" and API_KEY.encode() not in results["listeners"][1]
    assert results["group"][0] == "OK"
    for case in ("another node", "another group"):
        assert results[case] == ("PERMISSION_DENIED", b""), case
    for case in ("no certificate", "other CA", "plaintext"):
        assert results[case] == ("UNAVAILABLE", b""), case
    # its streams end with the calls (the server sees the cancellation a moment later)
    assert poll(lambda: "envoy-1" not in sidecar.state()["xds"]["nodes"], timeout=10)
