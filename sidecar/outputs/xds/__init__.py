"""The sidecar as an xDS control plane: Aggregated Discovery over gRPC (`--serve-xds`).

    cache.py      the resources every Envoy gets (LDS, CDS, EDS, ECDS: the API keys, RTDS) as
                  protobuf Any, per-resource and per-type versions, a change signal for the streams
    nodes.py      connected Envoys by node id: streams, ACKed and NACKed versions per type;
                  how many share the limits (ACKed RTDS, capped)
    server.py     the gRPC servicer: state of the world and delta, on one grpc.aio server over
                  the shared transport (`sidecar.outputs.tls`: mTLS, a node id bound to its
                  certificate; plaintext on loopback only), bounded per client (`AdsBounds`)
    publisher.py  what the daemon talks to: endpoints per pool, the tree, the limits

Resources are confgen's Envoy renderer's JSON (`confgen.envoy.ads.resources`,
`confgen.envoy.build_cla`) parsed into Envoy's protobuf types (xds-protos) with
google.protobuf.json_format; nothing here builds Envoy config by hand.
"""

from sidecar.fleet import NodeView
from sidecar.outputs.xds.cache import CDS, EDS, LDS, RTDS, TYPE_ORDER, XdsCache
from sidecar.outputs.xds.nodes import Nodes
from sidecar.outputs.xds.publisher import AdsPublisher

__all__ = ["CDS", "EDS", "LDS", "RTDS", "TYPE_ORDER", "AdsPublisher", "NodeView", "Nodes", "XdsCache"]
