"""The picker's budget check, in process: the actions evaluated as Envoy does, the x-ratelimit-*
headers as Envoy writes them, and the servicer's part (a refusal is a 429 and no pick; an
admitted request leaves marked checked; a late loop leaves it to Envoy's filter). The whole
path against a real Envoy and Redis: tests/sidecar_live/test_global_limits_live.py and
test_budget_descriptors_differential.py (the evaluator against Envoy's own descriptors)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import struct_pb2

from confgen.limits import BUDGET_NS, CHECKED_HEADER
from sidecar.outputs.contract import BudgetAnswer, Budgets, Descriptor
from sidecar.outputs.picker.budgets import RouteChecks
from sidecar.outputs.picker.datastore import Datastore
from sidecar.outputs.picker.extproc import PICKER_FILTER_NAME, PickerServicer
from sidecar.outputs.picker.metrics import PickerMetrics
from sidecar.outputs.picker.scheduling import Picker
from sidecar.outputs.ratelimit.service import rate_limit_headers

_SELECT = ({"generic_key": {"descriptor_key": "confgen_limit", "descriptor_value": "per_key/0"}},
           {"request_headers": {"header_name": "x-client", "descriptor_key": "client"}})
_UNCHECKED = {"header_value_match": {"descriptor_key": "confgen_check", "descriptor_value": "envoy",
                                     "expect_match": False,
                                     "headers": [{"name": CHECKED_HEADER, "present_match": True}]}}
_ONLY_BOB = {"header_value_match": {"descriptor_key": "confgen_limit", "descriptor_value": "client/bob/0",
                                    "expect_match": True,
                                    "headers": [{"name": "x-client", "string_match": {"exact": "bob"}}]}}
_NOT_AB = {"header_value_match": {"descriptor_key": "confgen_limit", "descriptor_value": "per_key/1",
                                  "expect_match": False,
                                  "headers": [{"name": "x-client",
                                               "string_match": {"safe_regex": {"regex": "^(a|b)$"}}}]}}
_TOKENS = (*_SELECT, _UNCHECKED, {"request_headers": {"header_name": "x-request-id", "descriptor_key": "request_id"}},
           {"metadata": {"descriptor_key": "max_output", "source": "DYNAMIC",
                         "metadata_key": {"key": "confgen.usage", "path": [{"key": "max_output"}]},
                         "default_value": "4096"}},
           {"request_headers": {"header_name": "content-length", "descriptor_key": "body_bytes",
                                "skip_if_absent": True}},
           {"generic_key": {"descriptor_key": "hold_s", "descriptor_value": "600"}})


def _checks() -> RouteChecks:
    return RouteChecks({
        "r": [((*_SELECT, _UNCHECKED), None), ((_ONLY_BOB, _SELECT[1], _UNCHECKED), None),
              ((_NOT_AB, _SELECT[1], _UNCHECKED), None), (_TOKENS, 0)],
        "odd": [(({"remote_address": {}},), None)],
    })


def test_actions_are_evaluated_as_envoy_does() -> None:
    checks = _checks()
    assert "r" in checks and "odd" not in checks and "remote_address" in checks.left["odd"]
    assert checks.headers == {"x-client", "x-request-id", "content-length"}  # never the mark: the proxy strips it
    bob = checks.descriptors("r", {"x-client": "bob", "x-request-id": "id1", "content-length": "80"},
                             {"confgen.usage": {"max_output": "17"}})
    assert bob == [
        Descriptor((("confgen_limit", "per_key/0"), ("client", "bob"), ("confgen_check", "envoy"))),
        Descriptor((("confgen_limit", "client/bob/0"), ("client", "bob"), ("confgen_check", "envoy"))),
        # per_key/1 excepts a and b: "bob" is not "b" (the regex matches the whole value)
        Descriptor((("confgen_limit", "per_key/1"), ("client", "bob"), ("confgen_check", "envoy"))),
        Descriptor((("confgen_limit", "per_key/0"), ("client", "bob"), ("confgen_check", "envoy"),
                    ("request_id", "id1"), ("max_output", "17"), ("body_bytes", "80"), ("hold_s", "600")), 0),
    ]
    # client b: not the exact match (bob's budget) and excepted by the regex; no content-length is skipped,
    # no max_output takes the default
    b = checks.descriptors("r", {"x-client": "b", "x-request-id": "id2"}, {})
    assert [d.entries[0][1] for d in b] == ["per_key/0", "per_key/0"]
    assert b[1].entries[4:] == (("max_output", "4096"), ("hold_s", "600"))
    # no client header: a request_headers action without skip_if_absent drops its whole descriptor
    assert checks.descriptors("r", {}, {}) == []


def test_the_headers_are_envoys_draft_03() -> None:
    unit = rls_pb2.RateLimitResponse.RateLimit
    statuses = [rls_pb2.RateLimitResponse.DescriptorStatus(
        code=rls_pb2.RateLimitResponse.OK, limit_remaining=remaining,
        current_limit=unit(name=name, requests_per_unit=rpu, unit=u),
        duration_until_reset={"seconds": reset}) for name, rpu, u, remaining, reset in
        (("first", 1, unit.MINUTE, 2, 3), ("second", 4, unit.HOUR, 5, 6))]
    # Envoy's own test case (ratelimit_headers_test.cc): the least remaining names the limit and the reset
    assert rate_limit_headers(statuses) == (
        ("x-ratelimit-limit", '1, 1;w=60;name="first", 4;w=3600;name="second"'),
        ("x-ratelimit-remaining", "2"), ("x-ratelimit-reset", "3"))
    assert rate_limit_headers([rls_pb2.RateLimitResponse.DescriptorStatus(code=rls_pb2.RateLimitResponse.OK)]) == ()


class _Decider:
    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed
        self.calls: list[Sequence[Descriptor]] = []

    async def check(self, descriptors: Sequence[Descriptor]) -> BudgetAnswer:
        self.calls.append(descriptors)
        headers = (("x-ratelimit-limit", "60, 60;w=60"), ("x-ratelimit-remaining", "0" if not self.allowed else "7"),
                   ("x-ratelimit-reset", "12"))
        return BudgetAnswer(self.allowed, headers if self.allowed else (*headers, ("retry-after", "12")))


class _Lag:
    def __init__(self, late: float) -> None:
        self.late = late

    def behind_s(self) -> float:
        return self.late


def _servicer(decider: _Decider, late: float = 0.0) -> PickerServicer:
    budgets = Budgets()
    budgets.check = decider
    svc = PickerServicer(Datastore(), Picker(), PickerMetrics(None), budgets=budgets, lag=_Lag(late))  # type: ignore[arg-type]
    svc.checks = _checks()
    return svc


def _headers(route: str = "r") -> pb.ProcessingRequest:
    attrs = struct_pb2.Struct()
    attrs.update({"xds.route_name": route})
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers={"headers": [
        {"key": "x-client", "raw_value": b"alice"}, {"key": "x-request-id", "raw_value": b"rid"}]}))
    msg.attributes[PICKER_FILTER_NAME].CopyFrom(attrs)
    return msg


async def _run(svc: PickerServicer, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    async def requests() -> Any:
        for m in messages:
            yield m

    class _Context:
        def invocation_metadata(self) -> tuple[()]:
            return ()

        def peer(self) -> str:
            return "ipv4:127.0.0.1:40000"

    return [out async for out in svc.Process(requests(), _Context())]  # type: ignore[arg-type]


_BODY = pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model": "m", "prompt": "x"}', end_of_stream=True))


def test_a_spent_budget_is_a_429_here_and_nothing_is_picked() -> None:
    decider = _Decider(allowed=False)
    svc = _servicer(decider)
    answers = asyncio.run(_run(svc, [_headers(), _BODY]))
    assert len(decider.calls) == 1 and [d.entries[0][1] for d in decider.calls[0]] == ["per_key/0", "per_key/1",
                                                                                       "per_key/0"]
    refused = answers[-1].immediate_response
    assert refused.status.code == 429
    headers = {h.header.key: h.header.raw_value.decode() for h in refused.headers.set_headers}
    assert headers["retry-after"] == "12" and headers["x-ratelimit-remaining"] == "0"
    assert headers["content-type"] == "application/json" and b"rate_limit_exceeded" in refused.body
    assert svc.metrics.budget_checks.labels(code="over_limit")._value.get() == 1
    assert svc.open_streams() == 0


def test_an_admitted_request_leaves_marked_with_its_headers_values() -> None:
    svc = _servicer(_Decider(allowed=True))
    answers = asyncio.run(_run(svc, [_headers(), _BODY]))
    body = answers[-1].request_body.response
    assert CHECKED_HEADER in {h.header.key for h in body.header_mutation.set_headers}
    values = dict(answers[-1].dynamic_metadata.fields[BUDGET_NS].struct_value)
    assert values == {"limit": "60, 60;w=60", "remaining": "7", "reset": "12"}


def test_a_late_loop_or_a_route_without_budgets_leaves_the_check_to_envoy() -> None:
    for svc, route in ((_servicer(_Decider(allowed=False), late=1.0), "r"), (_servicer(_Decider(False)), "other")):
        answers = asyncio.run(_run(svc, [_headers(route), _BODY]))
        assert not answers[-1].HasField("immediate_response")
        mutation = answers[-1].request_body.response.header_mutation
        assert CHECKED_HEADER not in {h.header.key for h in mutation.set_headers}
