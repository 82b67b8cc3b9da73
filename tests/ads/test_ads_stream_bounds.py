"""What one ADS stream can make the control plane hold, in process over real gRPC (loopback
plaintext): a stream that never names its node is ended, and a delta reconnect's list of what
Envoy holds is kept only where it may be answered. Both found by an adversarial review: 32 silent
streams held 32 of the server's stream slots for good; 100 streams each listing 10,000 unserved
resources grew the control plane by ~9 MiB a stream."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from sidecar.outputs.grpc import GrpcSettings
from sidecar.outputs.xds.cache import CDS, XdsCache
from sidecar.outputs.xds.nodes import Nodes
from sidecar.outputs.xds.server import AdsBounds, AdsServicer, ads_server

EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
NAMES = 4_000  # ~0.86 MiB of names a request: under the 1 MiB message cap
STREAMS = 10


async def _serving(bounds: AdsBounds, on_nodes: asyncio.Event | None = None) -> tuple[Any, AdsServicer, int]:
    loop = asyncio.get_running_loop()
    nodes = Nodes(loop.time, on_nodes.set if on_nodes is not None else None)
    servicer = AdsServicer(XdsCache(), nodes, bounds, loop.time)
    server = ads_server(servicer, GrpcSettings("127.0.0.1", 0))
    port = await server.start()
    return server, servicer, port


def test_a_stream_that_never_names_its_node_is_ended() -> None:
    async def main() -> tuple[str, float]:
        server, _, port = await _serving(AdsBounds(first_request_s=0.5))
        loop = asyncio.get_running_loop()
        forever = asyncio.Event()

        async def nothing() -> AsyncIterator[Any]:
            await forever.wait()
            yield discovery_pb2.DiscoveryRequest()  # never reached

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
                    nothing(), timeout=20)
                started = loop.time()
                try:
                    await call.read()
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name, loop.time() - started
                return "OK", loop.time() - started
        finally:
            forever.set()
            await server.stop(0)

    code, took = asyncio.run(main())
    assert code == "DEADLINE_EXCEEDED" and took < 10.0, (code, took)


def test_a_delta_reconnect_listing_unserved_resources_holds_almost_nothing() -> None:
    """Ten streams each list 4,000 unserved EDS resources as held, ten more 4,000 CDS ones (a wildcard
    type: at most 1,024 kept, to report removed). The streams stay open, never refused (a list like this
    is what every Envoy sends after a control plane restart), and what they hold is bounded."""
    def names(i: int) -> dict[str, str]:
        return {f"pool-{i:02d}-{j:05d}-" + "x" * 190: "1" for j in range(NAMES)}

    async def main() -> tuple[int, int]:
        connected = asyncio.Event()
        server, servicer, port = await _serving(AdsBounds(), connected)
        stop = asyncio.Event()
        tracemalloc.start()
        # a connection each: the server allows 8 streams on one
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(2 * STREAMS)]
        calls = []
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i, channel in enumerate(channels):  # half list EDS resources, half CDS ones
                async def requests(i: int = i) -> AsyncIterator[Any]:
                    yield discovery_pb2.DeltaDiscoveryRequest(node={"id": f"envoy-{i}"},
                                                              type_url=EDS if i < STREAMS else CDS,
                                                              initial_resource_versions=names(i))
                    await stop.wait()

                stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
                calls.append(stub.DeltaAggregatedResources(requests(), timeout=60))
            async with asyncio.timeout(30):
                # a node is connected within the call that applies its request (one step of this loop)
                while len(servicer.nodes.view()) < 2 * STREAMS:
                    connected.clear()
                    await connected.wait()
            return tracemalloc.get_traced_memory()[0] - base, sum(servicer.refused.values())
        finally:
            tracemalloc.stop()
            stop.set()
            for call in calls:
                call.cancel()
            for channel in channels:
                await channel.close()
            await server.stop(0)

    held, refused = asyncio.run(main())
    assert refused == 0
    # before: every listed name kept, 20 x 4,000 x ~330 bytes = ~26 MB; now 1,024 on each CDS stream
    assert held < 8 * 1024 * 1024, held
