"""The edge through the real Envoy and the simulated fleet: API keys, the internal client
header, and the admin interface kept on loopback."""

from __future__ import annotations

import json
import socket
import string
from pathlib import Path
from urllib.parse import urlsplit

from confgen import envoy, parse_topology
from confgen.simulate import FleetSpec, WorkerSpec
from tests.integration._stack import stack

TOPOLOGY = """
version: 1
name: edge
admin: {address: 127.0.0.1, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
auth:
  api_keys:
    - {client: alice, env: KEY_ALICE}
    - {client: bob, env: KEY_BOB}
routes:
  - {name: vip, pool: vip, match: {models: [vip-model]}, allow_clients: [alice]}
pools:
  - name: open
    engine: vllm
    models: [open-model]
    health: {enabled: false}
    workers: ["$w_open"]
  - name: vip
    engine: vllm
    models: [vip-model]
    health: {enabled: false}
    workers: ["$w_vip"]
"""
SECRETS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-9876543210"}


def _fleet() -> FleetSpec:
    return FleetSpec(
        workers=(
            WorkerSpec(name="open", models=("open-model",), decode_ms=1.0),
            WorkerSpec(name="vip", models=("vip-model",), decode_ms=1.0),
        ),
        seed=6,
    )


def _key(client: str) -> dict[str, str]:
    return {"authorization": f"Bearer {SECRETS[client]}"}


def test_api_keys_and_a_forged_client_header_on_the_fleet(tmp_path: Path) -> None:
    """No key or a wrong key: 401; bob on alice's route: 403, also when bob sends
    `x-confgen-client: alice` himself; across every request the workers never saw an
    Authorization header or a key, and always saw the authenticated client id."""
    with stack(TOPOLOGY, _fleet(), tmp_path / "out", secrets=SECRETS) as s:
        vip = {"model": "vip-model", "prompt": "secret", "max_tokens": 1}
        opened = {"model": "open-model", "prompt": "hello", "max_tokens": 1}
        assert s.post(opened, _key("alice")).status == 200

        for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": "Bearer "}):
            answer = s.post(opened, headers)
            assert answer.status == 401, headers
            assert answer.json()["error"]["code"] == "invalid_api_key"

        for headers in (_key("bob"), {**_key("bob"), "x-confgen-client": "alice"}):
            answer = s.post(vip, headers)
            assert answer.status == 403, headers
            assert answer.json()["error"]["code"] == "permission_denied"
        assert s.worker("vip").stats()["inference_received"] == 0

        answer = s.post(vip, {**_key("alice"), "x-confgen-client": "bob"})
        assert (answer.status, answer.worker) == (200, "vip")
        assert s.worker("vip").stats()["last_inference_headers"]["x-confgen-client"] == "alice"
        answer = s.post(opened, {**_key("bob"), "x-confgen-client": "alice"})
        assert (answer.status, answer.worker) == (200, "open")
        seen = s.worker("open").stats()["last_inference_headers"]
        assert seen["x-confgen-client"] == "bob"

        for name in ("open", "vip"):
            stats = s.worker(name).stats()
            assert stats["authorization_seen"] == 0, name
            assert not any("sk-" in v for v in stats["last_inference_headers"].values()), name


ADMIN_TOPOLOGY = """
version: 1
name: admin
admin: {address: $address, port: $admin}
listeners:
  - {name: public, address: 127.0.0.1, port: $port}
pools:
  - name: chat
    engine: vllm
    models: [chat]
    health: {enabled: false}
    workers: ["$w_a"]
"""


def test_admin_interface_listens_on_loopback_only(tmp_path: Path) -> None:
    """The rendered bootstrap binds Envoy's admin to 127.0.0.1 and the running Envoy
    answers there but refuses 127.0.0.2 (so it is bound to 127.0.0.1, not a wildcard);
    a topology putting admin on a non-loopback address gets a validate warning."""
    spec = FleetSpec(workers=(WorkerSpec(name="a", models=("chat",), decode_ms=1.0),), seed=1)
    text = ADMIN_TOPOLOGY.replace("$address", "127.0.0.1")
    with stack(text, spec, tmp_path / "out") as s:
        boot = json.loads((s.out / "bootstrap.json").read_text())
        admin = boot["admin"]["address"]["socket_address"]
        assert admin["address"] == "127.0.0.1"
        url = urlsplit(s.envoy.admin_url)
        assert (url.hostname, url.port) == ("127.0.0.1", admin["port_value"])
        assert s.envoy.admin_get("/ready")[0] == 200
        with socket.create_connection(("127.0.0.1", admin["port_value"]), timeout=2):
            pass
        refused = False
        try:
            with socket.create_connection(("127.0.0.2", admin["port_value"]), timeout=2):
                pass
        except ConnectionRefusedError:
            refused = True
        assert refused, "the admin port accepts on 127.0.0.2: it is bound to a wildcard address"

    def offline(address: str) -> bytes:
        values = {"address": address, "admin": "9901", "port": "8080", "w_a": "127.0.0.1:9000"}
        return string.Template(ADMIN_TOPOLOGY).substitute(values).encode()

    for address in ("0.0.0.0", "10.1.2.3"):
        topo, warnings = parse_topology(offline(address))
        assert [w.path for w in warnings if "loopback" in w.message] == ["admin.address"], address
        rendered = json.loads(envoy.render(topo, config_dir="/cfg")["bootstrap.json"])
        assert rendered["admin"]["address"]["socket_address"]["address"] == address
    _, warnings = parse_topology(offline("127.0.0.1"))
    assert not [w for w in warnings if "loopback" in w.message]
