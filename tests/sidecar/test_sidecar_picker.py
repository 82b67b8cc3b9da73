"""The endpoint picker's parts without a proxy: prompt hashing, the datastore, the scorers and
picker (seeded randomness, no clock), and the ext_proc protocol driven message by message."""

from __future__ import annotations

import json
import random

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as hs

from sidecar.outputs.picker.datastore import BlockLRU, Datastore, EndpointFacts, PoolFacts
from sidecar.outputs.picker.extproc import DESTINATION, PickerServicer, _Stream
from sidecar.outputs.picker.metrics import PickerMetrics
from sidecar.outputs.picker.prompt import block_hashes, parse_body
from sidecar.outputs.picker.scheduling import Picker, PickerPolicy, PickRequest


def _chat(messages: list[dict[str, str]], **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def test_a_growing_conversation_keeps_its_earlier_blocks() -> None:
    first = parse_body(_chat([SYSTEM, {"role": "user", "content": "hello"}]))
    second = parse_body(_chat([SYSTEM, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                               {"role": "user", "content": "more"}]))
    assert first is not None and second is not None
    h1, h2 = block_hashes(first.text, "m"), block_hashes(second.text, "m")
    full = len(first.text) // 64  # the trailing partial block of turn 1 is not a block of turn 2
    assert full >= 5 and h2[:full] == h1[:full]
    assert block_hashes(first.text, "other-model")[0] != h1[0]  # the model seeds the chain
    assert len(block_hashes("x" * 64 * 1000, "m", max_blocks=256)) == 256


def test_parse_body_prompt_forms_and_garbage() -> None:
    p = parse_body(b'{"model": "m", "prompt": ["abc"], "max_tokens": 7}')
    assert p is not None and p.text == "abc" and p.max_tokens == 7
    p = parse_body(b'{"prompt": "x", "max_completion_tokens": 9, "max_tokens": 1}')
    assert p is not None and p.max_tokens == 9 and p.model is None
    assert parse_body(b"not json") is None
    assert parse_body(b"[" * 200_000 + b"]" * 200_000) is None  # nested past Python's recursion limit
    assert parse_body(b"[1, 2]") is None
    assert parse_body(b'{"model": "m"}') is None
    p = parse_body(_chat([{"role": "user", "content": [{"type": "text", "text": "part"}]}]))  # type: ignore[dict-item]
    assert p is not None and "part" in p.text


def test_lru_matches_the_chain_up_to_the_first_miss_and_evicts_oldest() -> None:
    lru = BlockLRU(4)
    lru.add([1, 2, 3])
    assert lru.match([1, 2, 3, 4]) == 3
    assert lru.match([1, 9, 3]) == 1
    lru.add([5, 6])  # 1 evicted
    assert len(lru) == 4 and lru.match([1, 2]) == 0
    lru.resize(1)
    assert len(lru) == 1


def _facts(addr: str, **kw: object) -> EndpointFacts:
    return EndpointFacts(address=addr, serving=bool(kw.pop("serving", True)), capacity=int(kw.pop("capacity", 8)),
                         **kw)  # type: ignore[arg-type]


def _store(*facts: EndpointFacts) -> Datastore:
    store = Datastore()
    store.update([PoolFacts("chat", ("m",), facts)])
    return store


def test_datastore_keeps_counts_and_indexes_across_updates_and_caps_memory() -> None:
    store = Datastore(default_blocks=100, total_blocks=150)
    store.update([PoolFacts("chat", ("m",), (_facts("a:1"), _facts("b:1", kv_blocks=10)))])
    a, b = store.endpoints("chat")
    assert a.index.capacity == 75 and b.index.capacity == 10  # 150 shared by 2; b's engine reports 10
    a.in_flight = 3
    a.index.add([1, 2])
    store.update([PoolFacts("chat", ("m",), (_facts("a:1", waiting=2.0),))])
    (kept,) = store.endpoints("chat")
    assert kept is a and kept.in_flight == 3 and kept.index.match([1, 2]) == 2 and kept.facts.waiting == 2.0
    assert store.pool_for("m") == "chat" and store.pool_for("x") is None
    store.update([PoolFacts("chat", ("m",), (_facts("a:1"),))], {"m": "chat", "o": "other", None: "other"})
    assert store.pool_for("o") is None and store.pool_for(None) is None


def _pick(store: Datastore, text: str, *, max_tokens: int | None = None, subset: frozenset[str] | None = None,
          policy: PickerPolicy | None = None) -> tuple[str, str]:
    prompt = parse_body(json.dumps({"model": "m", "prompt": text, "max_tokens": max_tokens}).encode())
    assert prompt is not None
    hashes = block_hashes(prompt.text, "m")
    pick = Picker(policy, rng=random.Random(1)).pick(PickRequest("chat", prompt, hashes, subset),
                                                     store.endpoints("chat"))
    if pick.endpoints:
        pick.endpoints[0].index.add(hashes)
        return pick.endpoints[0].address, pick.reason
    return "", pick.reason


PROMPT = "the shared context of one conversation " * 30


def test_the_prefix_holder_wins_while_loads_are_close_and_spills_when_they_diverge() -> None:
    store = _store(_facts("a:1"), _facts("b:1"), _facts("c:1"))
    home, reason = _pick(store, PROMPT)
    assert reason == "load"
    ep = {e.address: e for e in store.endpoints("chat")}
    for load in (0, 1, 2):  # within the spill margin (max(2, 0.25 x 8) = 2 requests)
        ep[home].in_flight = load
        assert _pick(store, PROMPT + " next turn") == (home, "prefix")
    ep[home].in_flight = 3  # 3 more than the others: balance wins
    where, reason = _pick(store, PROMPT + " next turn")
    assert where != home and reason == "spill"


def test_engine_queue_counts_when_it_exceeds_the_pickers_own_count() -> None:
    store = _store(_facts("a:1", waiting=10.0), _facts("b:1"))
    store.endpoints("chat")[0].index.add(block_hashes(PROMPT, "m"))  # a holds the prefix but has 10 queued
    assert _pick(store, PROMPT)[0] == "b:1"


def test_weighted_rule_long_generations_go_where_they_finish_soonest_short_ones_follow_the_prefix() -> None:
    # a holds the prefix but decodes 3x slower than b (the earlier, weighted rule).
    weighted = PickerPolicy(rule="weighted")
    store = _store(_facts("a:1", token_latency_s=0.06), _facts("b:1", token_latency_s=0.02))
    store.endpoints("chat")[0].index.add(block_hashes(PROMPT, "m"))
    assert _pick(store, PROMPT, max_tokens=8, policy=weighted)[0] == "a:1"
    assert _pick(store, PROMPT + "x", max_tokens=2000, policy=weighted)[0] == "b:1"


def test_filters_subset_and_serving() -> None:
    store = _store(_facts("a:1"), _facts("b:1", serving=False), _facts("c:1"))
    for _ in range(5):
        assert _pick(store, "p" * 10)[0] in ("a:1", "c:1")
    assert _pick(store, "p", subset=frozenset({"c:1"}))[0] == "c:1"
    assert _pick(store, "p", subset=frozenset({"b:1"})) == ("", "none")


def test_ties_are_broken_at_random_not_on_the_first() -> None:
    store = _store(*(_facts(f"e{i}:1") for i in range(4)))
    picker = Picker(rng=random.Random(7))
    chosen = {picker.pick(PickRequest("chat", None, []), store.endpoints("chat")).endpoints[0].address
              for _ in range(40)}
    assert len(chosen) == 4


# -- the ext_proc protocol, message by message ---------------------------------------------


def _servicer(*facts: EndpointFacts, hint: bool = False) -> PickerServicer:
    store = _store(*facts)
    return PickerServicer(store, Picker(rng=random.Random(3)), PickerMetrics(None, store.pools),
                          honour_subset_hint=hint)


def _headers(end: bool = False, **headers: str) -> pb.ProcessingRequest:
    from envoy.config.core.v3 import base_pb2

    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end))


def _body(data: bytes, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def _destination(out: pb.ProcessingResponse, kind: str) -> str | None:
    common = getattr(out, kind).response
    for h in common.header_mutation.set_headers:
        if h.header.key == DESTINATION:
            value = h.header.raw_value.decode()
            listed = out.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
            assert listed.split(",")[0] == value
            return listed
    assert DESTINATION in common.header_mutation.remove_headers
    return None


def test_buffered_mode_answers_headers_at_once_then_picks_on_the_body() -> None:
    svc = _servicer(_facts("10.0.0.1:8000"), _facts("10.0.0.2:8000"))
    st = _Stream(None)
    (first,) = svc._step(st, _headers(**{DESTINATION: "6.6.6.6:1"}))
    assert first.HasField("request_headers") and _destination(first, "request_headers") is None  # client's removed
    (second,) = svc._step(st, _body(_chat([SYSTEM])))
    value = _destination(second, "request_body")
    assert value is not None and value.split(",")[0] in ("10.0.0.1:8000", "10.0.0.2:8000")
    assert len(value.split(",")) == 2  # the pick, then a fallback
    chosen = st.endpoint
    assert chosen is not None and chosen.in_flight == 1
    svc._step(st, pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert chosen.in_flight == 0 and st.endpoint is None
    svc.release(st)  # idempotent
    assert chosen.in_flight == 0


def test_full_duplex_mode_holds_the_headers_and_sends_the_body_back() -> None:
    svc = _servicer(_facts("10.0.0.1:8000"))
    st = _Stream(None)
    cfg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(), protocol_config=pb.ProtocolConfiguration(
        request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
        response_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED))
    assert svc._step(st, cfg) == []
    body = _chat([SYSTEM])
    assert svc._step(st, _body(body[:50], end=False)) == []
    headers, chunk = svc._step(st, _body(body[50:], end=True))
    assert _destination(headers, "request_headers") == "10.0.0.1:8000"
    streamed = chunk.request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream
    (echo,) = svc._step(st, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x", end_of_stream=True)))
    assert echo.response_body.response.body_mutation.streamed_response.body == b"data: x"
    assert st.endpoint is None  # released at the response's end


def _hinted_headers(*addresses: str) -> pb.ProcessingRequest:
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": list(addresses)})
    msg = _headers()
    msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return msg


def test_a_subset_with_nothing_ready_is_a_503_and_no_pool_leaves_it_to_the_proxy() -> None:
    svc = _servicer(_facts("10.0.0.1:8000"), hint=True)
    st = _Stream(None)
    svc._step(st, _hinted_headers("10.9.9.9:1"))
    (out,) = svc._step(st, _body(_chat([SYSTEM])))
    assert out.immediate_response.status.code == 503
    st2 = _Stream(None)
    (out2,) = svc._step(st2, _body(b'{"model": "unknown", "prompt": "x"}'))
    assert _destination(out2, "request_body") is None


def test_a_subset_hint_is_ignored_unless_configured() -> None:
    """Attack 8's hint: confgen's render never has Envoy send one, so a client's is not obeyed."""
    for hint, expected in ((False, {"10.0.0.1:8000", "10.0.0.2:8000"}), (True, {"10.0.0.2:8000"})):
        svc = _servicer(_facts("10.0.0.1:8000"), _facts("10.0.0.2:8000"), hint=hint)
        seen = set()
        for i in range(40):
            st = svc.open(None)
            svc._step(st, _hinted_headers("10.0.0.2:8000"))
            (out,) = svc._step(st, _body(_chat([{"role": "user", "content": f"question {i}"}])))
            value = _destination(out, "request_body")
            assert value is not None
            seen.add(value.split(",")[0])
            svc.finish(st)
        assert seen == expected
        assert sum(e.in_flight for e in svc.store.endpoints("chat")) == 0


def test_a_body_over_the_cap_is_left_to_the_proxy_and_not_held() -> None:
    from sidecar.outputs.picker.extproc import ExtProcLimits

    store = _store(_facts("10.0.0.1:8000"), _facts("10.0.0.2:8000"))
    metrics = PickerMetrics(None)
    svc = PickerServicer(store, Picker(), metrics, limits=ExtProcLimits(body_cap=1024))
    st = svc.open("chat")
    svc._step(st, _headers())
    (out,) = svc._step(st, _body(_chat([{"role": "user", "content": "x" * 5000}])))
    assert _destination(out, "request_body") is None and st.endpoint is None
    assert store.index_size() == 0  # nothing hashed
    assert metrics.unpicked.labels(reason="body_too_large")._value.get() == 1
    # full duplex: the cap counts every message; past it the held body goes back, the rest passes unread
    duplex = svc.open("chat")
    svc._step(duplex, pb.ProcessingRequest(request_headers=pb.HttpHeaders(), protocol_config=pb.ProtocolConfiguration(
        request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED)))
    assert svc._step(duplex, _body(b"a" * 600, end=False)) == []
    headers, held, chunk = svc._step(duplex, _body(b"b" * 600, end=False))
    assert _destination(headers, "request_headers") is None
    assert held.request_body.response.body_mutation.streamed_response.body == b"a" * 600
    assert chunk.request_body.response.body_mutation.streamed_response.body == b"b" * 600
    for _ in range(10):
        (passed,) = svc._step(duplex, _body(b"c" * 600, end=False))
        assert passed.request_body.response.body_mutation.streamed_response.body == b"c" * 600
        assert len(duplex.body) == 0
    svc.finish(duplex)
    assert metrics.unpicked.labels(reason="body_too_large")._value.get() == 2


# A client's body decides nothing but its own pick: an exception while deciding would end the stream
# and Envoy (failure_mode_allow) would send the request on unpicked and unadmitted.
HOSTILE_BODIES = (
    b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',  # a lone surrogate
    b'{"model": "m", "prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}",  # past a float
    b'{"model": "m", "prompt": "hi", "max_completion_tokens": 1' + b"0" * 4000 + b"}",
    b'{"model": "m", "prompt": "hi", "max_tokens": 1' + b"0" * 300 + b"}",  # a float, absurd
    b'{"model": "m\\udfff", "prompt": "\\ud800\\udbff", "max_tokens": 5}',
)


def test_hostile_bodies_are_picked_for_like_any_other() -> None:
    """Found by review: a lone surrogate in `model` raised UnicodeEncodeError and a max_tokens of 400
    digits OverflowError, out of the decision (the stream ended UNKNOWN with the exception's text)."""
    for rule in ("predicted", "weighted"):
        svc = _servicer(_facts("10.0.0.1:8000", token_latency_s=0.02), _facts("10.0.0.2:8000", token_latency_s=0.03))
        svc.picker = Picker(PickerPolicy(rule=rule), rng=random.Random(3))
        for body in HOSTILE_BODIES:
            st = svc.open("chat")
            svc._step(st, _headers())
            (out,) = svc._step(st, _body(body))
            assert _destination(out, "request_body") is not None, (rule, body[:60])
            assert st.endpoint is not None and st.endpoint.in_flight == 1
            if rule == "predicted":
                assert st.predicted is not None and st.predicted < 1e9  # bounded, not 1e297 seconds
            svc.finish(st)
            assert sum(e.in_flight for e in svc.store.endpoints("chat")) == 0
    from sidecar.outputs.picker.prompt import MAX_TOKENS

    prompt = parse_body(HOSTILE_BODIES[1])
    assert prompt is not None and prompt.max_tokens == MAX_TOKENS


_ANY_TEXT = hs.text(hs.characters(codec=None, categories=None), max_size=12)  # surrogates included
_JSON = hs.recursive(hs.none() | hs.booleans() | hs.integers() | hs.floats(allow_nan=False) | _ANY_TEXT,
                     lambda inner: hs.lists(inner, max_size=4) | hs.dictionaries(_ANY_TEXT, inner, max_size=4),
                     max_leaves=12)
_FIELD = hs.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "role", "content"])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(hs.dictionaries(_FIELD, _JSON | hs.integers(min_value=-(10**500), max_value=10**500)
                       | hs.lists(hs.fixed_dictionaries({"role": _ANY_TEXT, "content": _JSON}), max_size=3),
                       max_size=5))
def test_any_json_body_is_decided_without_an_exception(fields: dict[str, object]) -> None:
    """Any JSON object a client sends (any types in the fields the picker reads, lone surrogates, integers
    of hundreds of digits) is decided (a pick, or left to the proxy), never an exception."""
    svc = _servicer(_facts("10.0.0.1:8000", token_latency_s=0.02), _facts("10.0.0.2:8000", token_latency_s=0.03))
    body = json.dumps({"model": "m", **fields}).encode("utf-8", "surrogatepass")
    st = svc.open("chat")
    svc._step(st, _headers())
    (out,) = svc._step(st, _body(body))
    assert out.HasField("request_body")
    svc.finish(st)
    assert sum(e.in_flight for e in svc.store.endpoints("chat")) == 0


def test_pool_metadata_names_only_a_pool_the_picker_serves() -> None:
    """The gRPC metadata naming a pool is a caller's hint: a name the picker does not serve is ignored
    (the model's pool is used), so no caller grows the picker's per-pool state with names."""
    svc = _servicer(_facts("10.0.0.1:8000"), _facts("10.0.0.2:8000"))
    st = svc.open("no-such-pool")
    svc._step(st, _headers())
    (out,) = svc._step(st, _body(_chat([{"role": "user", "content": "hi"}])))
    assert _destination(out, "request_body") is not None and st.pool == "chat"
    svc.finish(st)
    late = svc.open("no-such-pool-either")
    assert svc._pool_of(late, None) is None
    svc.finish(late)


# -- over real gRPC: the stream's bounds and its end ---------------------------------------


def _grpc_case(body_timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    import asyncio

    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from sidecar.outputs.grpc import GrpcServer, GrpcSettings
    from sidecar.outputs.picker.extproc import ExtProcLimits

    store = _store(_facts("10.0.0.1:8000"), _facts("10.0.0.2:8000"))
    metrics = PickerMetrics(None, store.pools)
    svc = PickerServicer(store, Picker(), metrics, limits=ExtProcLimits(body_timeout_s=body_timeout_s))
    server = GrpcServer(GrpcSettings("127.0.0.1", 0))
    server.add(lambda s: pb_grpc.add_ExternalProcessorServicer_to_server(svc, s), "picker")
    return asyncio, pb_grpc, server, store, metrics


def test_a_stream_ends_its_request_when_the_proxy_resets_it() -> None:
    import grpc

    asyncio, pb_grpc, server, store, _ = _grpc_case()

    async def main() -> None:
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=20)
                await call.write(_headers())
                await call.read()
                await call.write(_body(_chat([SYSTEM])))
                picked = await call.read()
                assert _destination(picked, "request_body") is not None
                assert sum(e.in_flight for e in store.endpoints("chat")) == 1  # until the response ends
                call.cancel()  # what Envoy does when the client goes away
                for _ in range(200):
                    if sum(e.in_flight for e in store.endpoints("chat")) == 0:
                        break
                    await asyncio.sleep(0.02)
                assert sum(e.in_flight for e in store.endpoints("chat")) == 0
                # A normal end: Envoy half-closes the stream when the HTTP stream is done.
                call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=20)
                await call.write(_headers())
                await call.read()
                await call.write(_body(_chat([SYSTEM])))
                await call.read()
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
                assert sum(e.in_flight for e in store.endpoints("chat")) == 0
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_stream_that_never_sends_its_body_is_dropped() -> None:
    import grpc

    asyncio, pb_grpc, server, _, metrics = _grpc_case(body_timeout_s=0.3)

    async def main() -> None:
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=20)
                await call.write(_headers())
                await call.read()
                assert await asyncio.wait_for(call.read(), 10) == grpc.aio.EOF  # closed by the picker
        finally:
            await server.stop(0)

    asyncio.run(main())
    assert metrics.unpicked.labels(reason="timeout")._value.get() == 1


def test_picker_overrides_from_the_command_line() -> None:
    import pytest

    policy = PickerPolicy().with_overrides(["prefix=2", "cost=0", "spill_min=4", "fallbacks=0"])
    assert dict(policy.weights) == {"prefix": 2.0, "load": 2.0, "kv": 1.0, "cost": 0.0}
    assert policy.spill_min == 4.0 and policy.fallbacks == 0
    for bad in ("nope=1", "prefix", "prefix=x", "long_tokens=0", "load=-1", "fallbacks=1.5"):
        with pytest.raises(ValueError, match="--picker"):
            PickerPolicy().with_overrides([bad])
    store = _store(_facts("a:1"), _facts("b:1"))
    pick = Picker(policy, rng=random.Random(1)).pick(PickRequest("chat", None, []), store.endpoints("chat"))
    assert len(pick.endpoints) == 1  # fallbacks=0


def test_overrides_keep_what_the_sidecar_set_before_them() -> None:
    """--ingresses sets the predicted rule's replicas before the --picker pairs apply; they used to be
    rebuilt from the class defaults, so replicas was 1 whatever --ingresses said."""
    assert PickerPolicy(replicas=3).with_overrides([]).replicas == 3
    policy = PickerPolicy(replicas=2, tie_s=0.01).with_overrides(["budget_standard=1", "externality=0.5"])
    assert (policy.replicas, policy.tie_s, policy.budget_standard, policy.cost.externality) == (2, 0.01, 1.0, 0.5)
    assert PickerPolicy(replicas=2).with_overrides(["replicas=4"]).replicas == 4


def test_a_request_without_a_body_is_left_to_the_proxy() -> None:
    svc = _servicer(_facts("10.0.0.1:8000"))
    st = _Stream(None)
    (out,) = svc._step(st, _headers(end=True, **{DESTINATION: "10.0.0.1:8000"}))
    assert _destination(out, "request_headers") is None and st.endpoint is None
    hinted = _Stream(None)
    hinted.subset = frozenset({"10.0.0.1:8000"})
    (out,) = svc._step(hinted, _headers(end=True))
    assert _destination(out, "request_headers") == "10.0.0.1:8000"


def test_the_prefix_index_costs_what_its_docstring_says() -> None:
    """Issue 26, attack 10: a flood of distinct prompts fills the index to its cap; the
    docstring said ~100 MB for 1,000,000 blocks, RSS grew by 202 MiB (an OrderedDict at
    ~220 bytes a block, hash ints included). A dict in recency order: ~155 bytes a block."""
    import tracemalloc

    rng = random.Random(1)
    tracemalloc.start()
    try:
        lru = BlockLRU(200_000)
        for _ in range(1600):  # 409,600 distinct blocks through a 200,000-block index
            lru.add([rng.getrandbits(64) for _ in range(256)])
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 200_000 - 200_000 // 8 <= len(lru) <= 200_000
    assert held / len(lru) < 175, held / len(lru)  # bytes a block: ~130 MiB per million blocks
    hot = [rng.getrandbits(64) for _ in range(256)]
    lru.add(hot)
    for _ in range(100):  # a hot prefix stays while the cold ones go
        lru.add(hot[:8] + [rng.getrandbits(64) for _ in range(248)])
    assert lru.match(hot) >= 8


def test_the_refusals_a_service_reports_are_read_from_its_counter() -> None:
    """`PickerService.refused` (the daemon's reason="picker" in confgen_sidecar_shed_requests_total)
    is what confgen_picker_refused_total counted, by (pool, class): one count, not a copy kept beside it."""
    metrics = PickerMetrics(None)
    assert metrics.refusals() == {}
    for pool, cls in (("chat", "standard"), ("chat", "standard"), ("chat", "sheddable"), ("big", "standard")):
        metrics.refused.labels(pool=pool, **{"class": cls}).inc()
    assert metrics.refusals() == {("chat", "standard"): 2, ("chat", "sheddable"): 1, ("big", "standard"): 1}
