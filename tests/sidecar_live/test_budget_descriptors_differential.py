"""The picker's budget check against Envoy's own: the same descriptors, request by request.

The endpoint picker decides the global budgets in its ext_proc call by evaluating the route's
rendered rate limit actions itself (sidecar.outputs.picker.budgets); Envoy's rate limit filter
then makes no call. Here a real Envoy runs the rendered config against a recorder standing in
for the sidecar on its socket: its ext_proc side records what the picker would see (headers,
the route's name, the forwarded metadata) and marks nothing, so Envoy's filter then sends its
own descriptors, which the recorder's rate limit side records and admits. For every request,
what the picker's evaluator makes of the first must be exactly the second. A disagreement is a
bug in the evaluator (or an action it should have declined, `budgets.Unknown`).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from confgen import envoy, parse_topology
from confgen.envoy import route_checks
from confgen.limits import PHASE_KEY
from confgen.output import write_tree
from confgen.plan import plan
from confgen.runtime import EnvoyProcess, free_port
from sidecar.outputs.contract import Descriptor
from sidecar.outputs.picker.budgets import RouteChecks
from sidecar.outputs.picker.extproc import PICKER_FILTER_NAME
from tests.sidecar_live.glimits import KEYS, topology_text

pytestmark = pytest.mark.xdist_group("envoy")

Seen = dict[str, Any]  # what the picker's side saw of one request


class _Recorder(pb_grpc.ExternalProcessorServicer, rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.seen: list[Seen] = []

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest], context: Any
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        seen: Seen = {}
        async for msg in requests:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                attrs = msg.attributes.get(PICKER_FILTER_NAME)
                seen["route"] = attrs.fields["xds.route_name"].string_value if attrs is not None else None
                seen["headers"] = [(h.key, h.raw_value.decode() or h.value)
                                   for h in msg.request_headers.headers.headers]
                self.seen.append(seen)
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "request_body":
                seen["metadata"] = {
                    ns: {k: v.string_value for k, v in s.fields.items() if v.WhichOneof("kind") == "string_value"}
                    for ns, s in msg.metadata_context.filter_metadata.items()}
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    async def ShouldRateLimit(self, request: Any, context: Any) -> Any:
        # The request-time checks of the request whose ext_proc stream came last (one at a time); two
        # calls with fail_closed budgets (the filter that fails closed is a second one); the stream-done
        # call (the charges) carries a "phase" descriptor.
        if not any(e.key == PHASE_KEY for d in request.descriptors for e in d.entries):
            self.seen[-1].setdefault("sent", []).extend(
                Descriptor(tuple((e.key, e.value) for e in d.entries),
                           d.hits_addend.value if d.HasField("hits_addend") else None)
                for d in request.descriptors)
        return rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)


@contextlib.contextmanager
def _serve(recorder: _Recorder, socket: Path) -> Iterator[None]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(recorder, server)
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(recorder, server)
        server.add_insecure_port(f"unix:{socket}")
        await server.start()
        started.set()
        await stop.wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


# (client, body, chunked): budgets of requests and of tokens, per client, per model, fail_closed,
# listener-wide; bodies with max_tokens, max_completion_tokens, neither, a model no route names,
# a chunked body (no content-length)
_REQUESTS: list[tuple[str, dict[str, Any], bool]] = [
    ("req", {"model": "sim-model", "prompt": "a", "max_tokens": 4}, False),
    ("tok", {"model": "sim-model", "prompt": "bb", "max_tokens": 17}, False),
    ("tok", {"model": "sim-model", "prompt": "bb", "max_completion_tokens": 9, "max_tokens": 30}, False),
    ("tok", {"model": "sim-model", "prompt": "ccc"}, False),
    ("tok", {"model": "sim-model", "prompt": "chunked " * 40, "max_tokens": 5}, True),
    ("out", {"model": "sim-model", "prompt": "d", "max_tokens": 3, "stream": True}, False),
    ("out", {"model": "sim-model", "prompt": "d", "max_tokens": 2.5}, False),
    ("closed", {"model": "sim-model", "prompt": "e", "max_tokens": 1}, False),
    ("free", {"model": "sim-model", "prompt": "f", "max_tokens": 1}, False),
    ("free", {"model": "other-model", "prompt": "g", "max_tokens": 1}, False),
    ("free", {"prompt": "no model", "max_tokens": 1}, False),
    ("sec", {"model": "sim-model", "prompt": "h", "max_tokens": "12"}, False),
]


def _send(port: int, client: str, body: dict[str, Any], chunked: bool) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    data = json.dumps(body).encode()
    headers = {"authorization": f"Bearer {KEYS[client]}", "content-type": "application/json"}
    try:
        if chunked:
            conn.request("POST", "/v1/completions", body=iter([data[:20], data[20:]]), headers=headers,
                         encode_chunked=True)
        else:
            conn.request("POST", "/v1/completions", body=data, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_the_pickers_descriptors_are_envoys(tmp_path: Path) -> None:
    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    port, admin = free_port(), free_port()
    text = topology_text([f"127.0.0.1:{free_port()}"], admin=admin, port=port, listen=free_port(), grpc=free_port(),
                         redis="127.0.0.1:6379", sockets=sockets,
                         per_key="{scope: global, requests: 1000, window: minute, per_model: true}",
                         listener="[{scope: global, requests: 100000, window: hour, per_model: true}, "
                                  "{scope: global, unit: input_tokens, tokens: 1000000, window: day}]")
    topo, _ = parse_topology(text.encode())
    xds = tmp_path / "envoy"
    write_tree(envoy.render(topo, config_dir=str(xds), secrets=KEYS), xds, rank=envoy.layout.write_rank)
    checks = RouteChecks(route_checks(topo, plan(topo)))
    assert len(checks) > 0 and not checks.left, checks.left
    recorder = _Recorder()
    with _serve(recorder, sockets / "grpc.sock"), EnvoyProcess(xds / "bootstrap.json"):
        for client, body, chunked in _REQUESTS:
            _send(port, client, body, chunked)  # the workers are not there: the answer does not matter
    assert len(recorder.seen) == len(_REQUESTS), recorder.seen
    compared = 0
    for (client, body, _), seen in zip(_REQUESTS, recorder.seen, strict=True):
        envoys = seen.get("sent", [])
        if seen["route"] not in checks:  # no route (a model nothing serves): nothing to check, no call
            assert envoys == [], (client, body, envoys)
            continue
        headers: dict[str, str] = {}
        for name, value in seen["headers"]:
            if name in checks.headers:
                headers.setdefault(name, value)
        ours = checks.descriptors(seen["route"], headers, seen.get("metadata", {}))
        assert ours == envoys, (client, body, ours, envoys)
        compared += len(ours)
    assert compared >= 2 * len(_REQUESTS)  # the listener's budgets and a client's on almost every request
    print(f"\n{len(_REQUESTS)} requests, {compared} descriptors: the picker's are Envoy's")
