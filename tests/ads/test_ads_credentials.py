"""Issue 26, attacks 4 and 5: a node id is a claim, a credential is a proof.

The control plane as shipped (`AdsPublisher` on the one gRPC builder, the transport
`grpc_transport_for` picks), real grpcio clients, no Envoy (the attack is on the control
plane; one client stands for the real Envoy):
- (a) the default transport (the Unix socket): one real node, then 100 fake node ids on the
  same socket that ACK the runtime layer. Counted Envoys stay 1, the shedding limit served
  stays what one Envoy gets (before: 101 and a limit cut ~100x);
- (b) mutual TLS with one group certificate (`<name>/<anything>`, the Kubernetes render's
  shape): the same, unchanged; a second, distinct certificate does count (the cap is per
  credential, not "always one");
- (c) who gets the API keys (ECDS): the socket is 0600 in a 0700 directory, there is no TCP
  port unless --grpc-plaintext-loopback and the topology both say so; over mTLS a client
  without a certificate gets nothing, one with the fleet's certificate gets the key.
Wall time: a few seconds.
"""

from __future__ import annotations

import asyncio
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from confgen.envoy.ads import API_KEYS, RUNTIME_LAYER
from confgen.model import XDS_SOCKET
from confgen.runtime import free_port
from confgen.topology import load
from sidecar.config import ConfigError, SidecarConfig, from_argv, grpc_transport_for
from sidecar.decide.saturation import PoolLoad, PoolSaturation
from sidecar.outputs.grpc import settings_for
from sidecar.outputs.xds.cache import ECDS, RTDS
from sidecar.outputs.xds.limits import RtdsLimiter
from sidecar.outputs.xds.publisher import AdsPublisher
from tests.support.certs import Cert, CertAuthority

API_KEY = "sk-credentials-test-0123456789abcdef"
FAKES = 100
DEADLINE_S = 30.0
TOPOLOGY = """\
version: 1
name: creds
listeners: [{{name: public, address: 127.0.0.1, port: 18080}}]
auth:
  api_keys:
    - {{client: team-a, file: {key_file}}}
sidecar: {{{sidecar}}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:{xds}"]}}
pools:
  - name: chat
    engine: vllm
    models: [m]
    capacity: 12
    workers: ["127.0.0.1:9"]
"""


def _topology(tmp: Path, xds: int, sidecar: str) -> Path:
    key_file = tmp / "api-key"
    key_file.write_text(API_KEY)
    key_file.chmod(0o600)
    path = tmp / "topology.yaml"
    path.write_text(TOPOLOGY.format(key_file=key_file, xds=xds, sidecar=sidecar))
    return path


async def _publisher(config: SidecarConfig) -> AdsPublisher:
    """Started as the ADS publisher's `build` makes it, the tree and a runtime layer in its cache."""
    topo, _ = load(config.topology)
    assert config.serve_xds is not None
    publisher = AdsPublisher(settings_for(grpc_transport_for(config, topo), config.serve_xds, XDS_SOCKET),
                             clock=asyncio.get_running_loop().time, max_nodes=config.xds_max_nodes,
                             per_credential=config.xds_nodes_per_identity)
    publisher._test_acks = _acks(publisher)  # type: ignore[attr-defined]
    await publisher.start()
    assert await publisher.publish_all(topo, {})
    publisher.set_runtime({"circuit_breakers.chat.default.max_requests": 48})
    return publisher


def _load(in_flight: float) -> PoolLoad:
    """A saturated pool: 12 slots, `in_flight` running and waiting (the engines' report)."""
    return PoolLoad(cap=48, saturation=PoolSaturation(saturated=True, full_share=1.0, capacity=12, fresh_capacity=12,
                                                      waiting=in_flight - 12, in_flight=in_flight, batch=12.0))


async def _limits(publisher: Any) -> dict[str, int]:
    """The shedding limit a fresh limiter serves after the same five saturated cycles."""
    limiter = RtdsLimiter(publisher)
    for cycle in range(5):
        await limiter.set_limits({"chat": _load(40.0)}, now=2.0 * cycle)
    return dict(limiter.in_force)


class _Counted:
    def __init__(self, count: int) -> None:
        self.count = count

    def counted(self) -> int:
        return self.count


class _Layer:
    """What the limiter needs of a publisher, with a chosen count of Envoys (what the attack made it)."""

    def __init__(self, count: int) -> None:
        self.nodes = _Counted(count)

    def set_runtime(self, values: Any) -> bool:
        return True


class _Clients:
    """grpcio clients acting as Envoys: each node id opens a stream, takes the runtime layer, ACKs it."""

    def __init__(self, target: str, creds: grpc.ChannelCredentials | None) -> None:
        self._target, self._creds = target, creds
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[Any] = []
        self._stop = asyncio.Event()

    def _channel(self) -> grpc.aio.Channel:
        options = [("grpc.use_local_subchannel_pool", 1)]  # its own connection: 8 streams per connection
        if self._creds is None:
            return grpc.aio.insecure_channel(self._target, options=options)
        return grpc.aio.secure_channel(self._target, self._creds, options=options)

    async def ack_runtime(self, nodes: list[str]) -> None:
        for i, node in enumerate(nodes):
            if i % 8 == 0:
                self._channels.append(self._channel())
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channels[-1])
            queue: asyncio.Queue[Any] = asyncio.Queue()
            queue.put_nowait(discovery_pb2.DiscoveryRequest(node={"id": node}, type_url=RTDS,
                                                            resource_names=[RUNTIME_LAYER]))

            async def requests(queue: asyncio.Queue[Any] = queue) -> AsyncIterator[Any]:
                while True:
                    yield await queue.get()

            call = stub.StreamAggregatedResources(requests(), timeout=DEADLINE_S * 2)
            self._calls.append(call)
            async with asyncio.timeout(DEADLINE_S):
                response = await call.read()
            queue.put_nowait(discovery_pb2.DiscoveryRequest(  # the ACK
                type_url=RTDS, resource_names=[RUNTIME_LAYER], version_info=response.version_info,
                response_nonce=response.nonce))

    async def close(self) -> None:
        for call in self._calls:
            call.cancel()
        for channel in self._channels:
            await channel.close()


def _acks(publisher: AdsPublisher) -> asyncio.Event:
    """Set on every ACK the control plane records (the servicer calls `Nodes.ack`)."""
    event = asyncio.Event()
    record = publisher.nodes.ack

    def ack(node: str, type_url: str, version: str) -> None:
        record(node, type_url, version)
        event.set()

    publisher.nodes.ack = ack  # type: ignore[method-assign]
    return event


async def _until_acked(publisher: AdsPublisher, nodes: int) -> None:
    """Bounded wait for the condition: `nodes` connected, each having ACKed the runtime layer."""
    acked = getattr(publisher, "_test_acks", None)
    assert isinstance(acked, asyncio.Event)
    async with asyncio.timeout(DEADLINE_S):
        while sum(1 for n in publisher.nodes.view() if RTDS in n.acked) < nodes:
            acked.clear()
            await acked.wait()


def test_fake_nodes_on_the_default_socket_move_nothing(tmp_path: Path) -> None:
    """(a) Without TLS the control plane serves its Unix socket; 100 more node ids on it ACK the limits:
    all are served, none counts beyond the one local credential, the limit served is the one Envoy's."""
    xds = free_port()
    topology = _topology(tmp_path, xds, f"grpc_socket_dir: {tmp_path / 's'}")
    config = from_argv(["--topology", str(topology), "--serve-xds", f"127.0.0.1:{xds}"])

    async def main() -> None:
        publisher = await _publisher(config)
        clients = _Clients(f"unix:{tmp_path / 's' / XDS_SOCKET}", None)
        try:
            await clients.ack_runtime(["envoy-0"])
            await _until_acked(publisher, 1)
            assert publisher.nodes.counted() == 1
            honest = await _limits(publisher)
            await clients.ack_runtime([f"fake-{i}" for i in range(FAKES)])
            await _until_acked(publisher, FAKES + 1)
            assert len(publisher.nodes) == FAKES + 1  # every one served ...
            assert publisher.nodes.counted() == 1  # ... none of them counted
            assert publisher.view().counted == 1 and publisher.view().transport == "unix"
            assert await _limits(publisher) == honest
            # what the attack did before: the count of Envoys the limit is divided by was theirs
            assert await _limits(_Layer(FAKES + 1)) != honest
        finally:
            await clients.close()
            await publisher.close(0)

    asyncio.run(main())


def _pki(tmp: Path) -> tuple[CertAuthority, Cert, Cert, Cert]:
    ca = CertAuthority.create(tmp / "pki")
    return (ca, ca.issue("control-plane", ["IP:127.0.0.1"]), ca.issue("creds-envoy", ["DNS:creds-envoy"]),
            ca.issue("other-envoy", ["DNS:other-envoy"]))


def _creds(ca: CertAuthority, cert: Cert | None) -> grpc.ChannelCredentials:
    if cert is None:
        return grpc.ssl_channel_credentials(ca.cert.read_bytes())
    return grpc.ssl_channel_credentials(ca.cert.read_bytes(), cert.key.read_bytes(), cert.cert.read_bytes())


def _mtls_config(tmp: Path, xds: int, ca: CertAuthority, server: Cert, group: Cert) -> SidecarConfig:
    tls = f"grpc_tls: {{cert: {group.cert}, key: {group.key}, ca: {ca.cert}}}"
    topology = _topology(tmp, xds, tls)
    return from_argv(["--topology", str(topology), "--serve-xds", f"127.0.0.1:{xds}", "--grpc-tls-cert",
                      str(server.cert), "--grpc-tls-key", str(server.key), "--grpc-client-ca", str(ca.cert)])


def test_fake_nodes_behind_one_group_certificate_move_nothing(tmp_path: Path) -> None:
    """(b) mTLS, the Envoys' one shared certificate: 100 more `<name>/<anything>` node ids ACK the limits with
    it; the count and the limit stay the real Envoy's. A second, distinct certificate is a second Envoy."""
    ca, server, group, other = _pki(tmp_path)
    xds = free_port()
    config = _mtls_config(tmp_path, xds, ca, server, group)

    async def main() -> None:
        publisher = await _publisher(config)
        shared = _Clients(f"127.0.0.1:{xds}", _creds(ca, group))
        second = _Clients(f"127.0.0.1:{xds}", _creds(ca, other))
        try:
            await shared.ack_runtime(["creds-envoy/real"])
            await _until_acked(publisher, 1)
            honest = await _limits(publisher)
            await shared.ack_runtime([f"creds-envoy/fake-{i}" for i in range(FAKES)])
            await _until_acked(publisher, FAKES + 1)
            assert len(publisher.nodes) == FAKES + 1
            assert publisher.nodes.counted() == 1
            assert publisher.view().transport == "mtls"
            assert await _limits(publisher) == honest
            await second.ack_runtime(["other-envoy"])
            await _until_acked(publisher, FAKES + 2)
            assert publisher.nodes.counted() == 2  # proved distinct: counted
        finally:
            await shared.close()
            await second.close()
            await publisher.close(0)

    asyncio.run(main())


async def _ask_keys(target: str, creds: grpc.ChannelCredentials | None, node: str) -> tuple[str, bytes]:
    """One SotW request for the API keys (ECDS); (status code name or OK, bytes received)."""
    received = b""
    channel = grpc.aio.secure_channel(target, creds) if creds is not None else grpc.aio.insecure_channel(target)
    async with channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)

        async def requests() -> AsyncIterator[Any]:
            yield discovery_pb2.DiscoveryRequest(node={"id": node}, type_url=ECDS, resource_names=[API_KEYS])
            await asyncio.Event().wait()  # the stream stays open; the call's timeout ends it

        try:
            async for response in stub.StreamAggregatedResources(requests(), timeout=5):
                return "OK", received + response.SerializeToString()
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, received
    return "CLOSED", received


def test_without_the_sockets_permission_or_a_certificate_no_keys(tmp_path: Path) -> None:
    """(c) The default: ADS on a 0600 socket in a 0700 directory, no TCP port (another uid cannot be had in
    tests: the modes are what keeps it out); the TCP port only with both opt-ins; over mTLS a client without a
    certificate gets no byte, the fleet's certificate gets the key (the check can fail)."""
    xds = free_port()
    sockets = tmp_path / "s"
    topology = _topology(tmp_path, xds, f"grpc_socket_dir: {sockets}")
    config = from_argv(["--topology", str(topology), "--serve-xds", f"127.0.0.1:{xds}"])
    topo, _ = load(topology)
    with pytest.raises(ConfigError, match="grpc_plaintext_loopback"):  # the flag alone: refused
        grpc_transport_for(from_argv(["--topology", str(topology), "--serve-xds", f"127.0.0.1:{xds}",
                                      "--grpc-plaintext-loopback"]), topo)
    plain = tmp_path / "plain.yaml"
    plain.write_text(topology.read_text().replace(f"grpc_socket_dir: {sockets}", "grpc_plaintext_loopback: true"))
    with pytest.raises(ConfigError, match="--grpc-plaintext-loopback"):  # the topology alone: refused
        grpc_transport_for(from_argv(["--topology", str(plain), "--serve-xds", f"127.0.0.1:{xds}"]), load(plain)[0])
    both = from_argv(["--topology", str(plain), "--serve-xds", f"127.0.0.1:{xds}", "--grpc-plaintext-loopback"])
    assert grpc_transport_for(both, load(plain)[0]).kind == "plaintext"

    async def default() -> None:
        publisher = await _publisher(config)
        try:
            path = sockets / XDS_SOCKET
            assert stat.S_ISSOCK(path.lstat().st_mode)
            assert stat.S_IMODE(path.lstat().st_mode) == 0o600
            assert stat.S_IMODE(sockets.lstat().st_mode) == 0o700 and sockets.lstat().st_uid == path.lstat().st_uid
            with pytest.raises(OSError), socket.create_connection(("127.0.0.1", xds), timeout=2):
                pass  # nothing on the TCP port
            status, body = await _ask_keys(f"unix:{path}", None, "envoy-0")  # the socket's owner: served
            assert status == "OK" and API_KEY.encode() in body
        finally:
            await publisher.close(0)
        assert not (sockets / XDS_SOCKET).exists()  # removed on close

    asyncio.run(default())

    ca, server, group, _ = _pki(tmp_path)
    mtls = _mtls_config(tmp_path, xds, ca, server, group)

    async def over_mtls() -> None:
        publisher = await _publisher(mtls)
        try:
            target = f"127.0.0.1:{xds}"
            for creds in (_creds(ca, None), None):  # TLS without a client certificate; plaintext
                status, body = await _ask_keys(target, creds, "creds-envoy/x")
                assert status == "UNAVAILABLE" and body == b"", status
            status, body = await _ask_keys(target, _creds(ca, group), "creds-envoy/x")
            assert status == "OK" and API_KEY.encode() in body
        finally:
            await publisher.close(0)

    asyncio.run(over_mtls())
