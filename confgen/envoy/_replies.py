"""Answers Envoy makes itself (limits, overload, auth, no route, nothing healthy), mapped to the
OpenAI-style JSON every target sends (texts in confgen._openai).
"""

from __future__ import annotations

import json

from .._openai import canned_body, error_body, models_body, retry_after_seconds
from ..limits import needs_store
from ..model import Topology
from ._proto import Json

META_NS = "confgen"  # dynamic-metadata namespace the request's `model` is written to
# The status of the shed share's refusals (`_listener._shed_config`) and of the endpoint picker's (sent to it
# as stream metadata, x-confgen-shed-status): a code Envoy never answers on its own, so the mapper below can
# tell them from a rate limit's 429 (whose RL flag is set only after the reply is mapped) and make them 429
# `overloaded`. 507 (Insufficient Storage): the local rate limit filter takes only codes of
# envoy.type.v3.StatusCode.
SHED_STATUS = 507


def _json_format(body: Json) -> Json:
    # json_format lets Envoy encode substituted values, so they cannot break the JSON.
    return {"json_format": body, "content_type": "application/json"}


def _constant_json(body: Json) -> Json:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    # Envoy's text formatter expands %COMMANDS%; our texts cannot hold '%', escape anyway.
    return {"text_format_source": {"inline_string": text.replace("%", "%%")}, "content_type": "application/json"}


def _flag(flag: str) -> Json:
    return {"response_flag_filter": {"flags": [flag]}}


def _status(code: int) -> Json:
    return {
        "status_code_filter": {
            "comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": f"confgen.reply_{code}"}}
        }
    }


def _retry_after(topo: Topology, keep: bool = False) -> list[Json]:
    """retry-after on Envoy's own answers; `keep`: unless the answer already has one (a global
    budget's 429 carries the seconds until its window resets, from the rate limit service)."""
    header = {"key": "retry-after", "value": str(retry_after_seconds(topo))}
    return [{"header": header, "append_action": "ADD_IF_ABSENT" if keep else "OVERWRITE_IF_EXISTS_OR_ADD"}]


def _models_fallback(topo: Topology) -> list[Json]:
    """GET /v1/models is asked of the sidecar; when Envoy cannot reach it (not running, not
    answering in time) the answer is the full list from the topology, not an error."""
    if not (topo.models_endpoint and topo.sidecar.models):
        return []
    unreachable = [_flag(flag) for flag in ("UF", "UH", "URX", "UC", "UT", "UO")]
    return [{
        "filter": {"and_filter": {"filters": [
            {"header_filter": {"header": {"name": ":path", "string_match": {"exact": "/v1/models"}}}},
            {"or_filter": {"filters": unreachable}},
        ]}},
        "status_code": 200,
        "body_format_override": {"text_format_source": {"inline_string": models_body(topo).replace("%", "%%")},
                                 "content_type": "application/json"},
    }]


def local_reply_config(topo: Topology, *, shedding: bool, picker: bool = False) -> Json:
    """`shedding`: some pool gets a shed share (`Plan.sheddable_pools`, from the render's plan); `picker`: the
    endpoint picker answers its admission refusals with SHED_STATUS too (and its own retry-after)."""
    mappers: list[Json] = [
        *_models_fallback(topo),
        # First: a failed attempt whose retry was refused by the retry budget carries UO too,
        # and is a worker failure, not overload.
        {
            "filter": {"or_filter": {"filters": [_flag("UF"), _flag("URX"), _flag("UC")]}},
            "body_format_override": _json_format(error_body("upstream_failed")),
        },
        {  # circuit breaker: the pool is at its share of capacity (backpressure)
            "filter": _flag("UO"),
            "status_code": 429,
            "headers_to_add": _retry_after(topo),
            "body_format_override": _json_format(error_body("overloaded")),
        },
        *([{  # a sheddable request refused by its pool's shed share (the route's direct_response), or a
            # request the picker's admission refused (with its own retry-after: kept)
            "filter": _status(SHED_STATUS),
            "status_code": 429,
            "headers_to_add": _retry_after(topo, keep=True),
            "body_format_override": _json_format(error_body("overloaded")),
        }] if shedding or picker else []),
        {  # local rate limit: its RL flag is set after the reply is mapped, so match the status
            "filter": _status(429),
            "headers_to_add": _retry_after(topo, keep=needs_store(topo)),
            "body_format_override": _json_format(error_body("rate_limited")),
        },
    ]
    if topo.last_resort is not None:
        mappers.append(
            {
                "filter": _flag("UH"),
                "status_code": topo.last_resort.status,
                "body_format_override": _constant_json(canned_body(topo)),
            }
        )
    else:
        mappers.append(
            {
                "filter": _flag("UH"),
                "status_code": 503,
                "headers_to_add": _retry_after(topo),
                "body_format_override": _json_format(error_body("no_healthy")),
            }
        )
    mappers += [
        {
            "filter": _flag("NR"),
            "status_code": 404,
            "body_format_override": _json_format(
                error_body("model_not_found", model=f"%DYNAMIC_METADATA({META_NS}:model)%")
            ),
        },
        {
            "filter": _status(401),
            "body_format_override": _json_format(error_body("unauthorized")),
        },
        {
            "filter": _status(403),
            "body_format_override": _json_format(error_body("forbidden")),
        },
        {
            "filter": _status(413),
            "body_format_override": _json_format(error_body("too_large")),
        },
        {
            "filter": {"or_filter": {"filters": [_flag("UT"), _flag("SI")]}},
            "body_format_override": _json_format(error_body("upstream_timeout")),
        },
    ]
    return {"mappers": mappers}
