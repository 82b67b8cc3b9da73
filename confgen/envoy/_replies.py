"""Answers Envoy makes itself (limits, overload, auth, no route, nothing healthy) as
OpenAI-style JSON errors, so clients' SDKs surface a readable message and back off.
"""

from __future__ import annotations

import json
import math

from ..model import Topology
from ._proto import Json

META_NS = "confgen"  # dynamic-metadata namespace the request's `model` is written to


def _error(message: str, kind: str, code: str) -> Json:
    return {"error": {"message": message, "type": kind, "code": code}}


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


def _retry_after(topo: Topology) -> list[Json]:
    seconds = max(1, math.ceil(topo.backpressure.retry_after.seconds))
    return [{"header": {"key": "retry-after", "value": str(seconds)}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]


def canned_body(topo: Topology) -> Json:
    canned = topo.last_resort
    assert canned is not None
    if canned.kind == "error":
        return _error(canned.message, "service_unavailable", "no_capacity")
    return {
        "id": "confgen-canned",
        "object": "chat.completion",
        "created": 0,
        "model": "confgen-canned",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": canned.message},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def local_reply_config(topo: Topology) -> Json:
    mappers: list[Json] = [
        {  # circuit breaker: the pool is at its share of capacity (backpressure)
            "filter": _flag("UO"),
            "status_code": 429,
            "headers_to_add": _retry_after(topo),
            "body_format_override": _json_format(
                _error(
                    "The model is overloaded. Retry after the time in the retry-after header.",
                    "server_overloaded",
                    "overloaded",
                )
            ),
        },
        {  # local rate limit: its RL flag is set after the reply is mapped, so match the status
            "filter": _status(429),
            "headers_to_add": _retry_after(topo),
            "body_format_override": _json_format(
                _error(
                    "Rate limit exceeded. Retry after the time in the retry-after header.",
                    "rate_limit_error",
                    "rate_limit_exceeded",
                )
            ),
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
                "body_format_override": _json_format(
                    _error(
                        "No healthy worker can serve this model right now.",
                        "service_unavailable",
                        "no_healthy_upstream",
                    )
                ),
            }
        )
    mappers += [
        {
            "filter": _flag("NR"),
            "status_code": 404,
            "body_format_override": _json_format(
                _error(
                    f"The model '%DYNAMIC_METADATA({META_NS}:model)%' does not exist or is not served here.",
                    "invalid_request_error",
                    "model_not_found",
                )
            ),
        },
        {
            "filter": _status(401),
            "body_format_override": _json_format(
                _error(
                    "Missing or invalid API key. Send it as Authorization: Bearer <key>.",
                    "invalid_request_error",
                    "invalid_api_key",
                )
            ),
        },
        {
            "filter": _status(403),
            "body_format_override": _json_format(
                _error("This API key is not allowed to use this model.", "invalid_request_error", "permission_denied")
            ),
        },
        {
            "filter": _status(413),
            "body_format_override": _json_format(
                _error("The request body is too large.", "invalid_request_error", "request_too_large")
            ),
        },
        {
            "filter": {"or_filter": {"filters": [_flag("UF"), _flag("URX"), _flag("UC")]}},
            "body_format_override": _json_format(
                _error("The worker failed before answering.", "upstream_error", "upstream_failure")
            ),
        },
        {
            "filter": {"or_filter": {"filters": [_flag("UT"), _flag("SI")]}},
            "body_format_override": _json_format(
                _error("The worker did not answer in time.", "timeout", "upstream_timeout")
            ),
        },
    ]
    return {"mappers": mappers}
