"""What clients see when the proxy answers by itself, the same for every target.

OpenAI-style error objects (`{"error": {"message", "type", "code"}}`) so clients' SDKs
show a readable message and back off on 429; the canned last answer; the /v1/models list.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from typing import Any

from .model import Topology
from .plan import fallback_chain

Json = dict[str, Any]

# name -> (message, type, code). "{model}" is filled in by the target that knows it.
REPLIES: dict[str, tuple[str, str, str]] = {
    "rate_limited": (
        "Rate limit exceeded. Retry after the time in the retry-after header.",
        "rate_limit_error",
        "rate_limit_exceeded",
    ),
    "overloaded": (
        "The model is overloaded. Retry after the time in the retry-after header.",
        "server_overloaded",
        "overloaded",
    ),
    "no_healthy": ("No healthy worker can serve this model right now.", "service_unavailable", "no_healthy_upstream"),
    "model_not_found": (
        "The model '{model}' does not exist or is not served here.",
        "invalid_request_error",
        "model_not_found",
    ),
    "unauthorized": (
        "Missing or invalid API key. Send it as Authorization: Bearer <key>.",
        "invalid_request_error",
        "invalid_api_key",
    ),
    "forbidden": ("This API key is not allowed to use this model.", "invalid_request_error", "permission_denied"),
    "too_large": ("The request body is too large.", "invalid_request_error", "request_too_large"),
    "upstream_failed": ("The worker failed before answering.", "upstream_error", "upstream_failure"),
    "upstream_timeout": ("The worker did not answer in time.", "timeout", "upstream_timeout"),
    "not_found_path": ("Not found.", "invalid_request_error", "not_found"),
}


# A request body is read for `model` only with one of these Content-Types, or none: Envoy's
# json_to_metadata compares the whole header value with a list (no media-type parsing), so
# both targets use exactly this list (docs/targets.md, "How the body's model is read").
MODEL_CONTENT_TYPES = (
    "application/json",
    "application/json; charset=utf-8",
    "application/json;charset=utf-8",
    "application/json; charset=UTF-8",
    "application/json;charset=UTF-8",
)


def error_body(name: str, **fill: str) -> Json:
    message, kind, code = REPLIES[name]
    return {"error": {"message": message.format(**fill) if fill else message, "type": kind, "code": code}}


def retry_after_seconds(topo: Topology) -> int:
    return max(1, math.ceil(topo.backpressure.retry_after.seconds))


def canned_body(topo: Topology) -> Json:
    canned = topo.last_resort
    assert canned is not None
    if canned.kind == "error":
        return {"error": {"message": canned.message, "type": "service_unavailable", "code": "no_capacity"}}
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


def models_body(topo: Topology, in_rotation: Collection[str] | None = None) -> str:
    """The GET /v1/models answer, byte for byte the same from every target (and the sidecar)."""
    return json.dumps(models_list(topo, in_rotation), sort_keys=True, separators=(",", ":"))


def models_list(topo: Topology, in_rotation: Collection[str] | None = None) -> Json:
    """Every model name the pools serve; with `in_rotation` (the pools that have a worker in
    rotation now), only the names some pool serves whose fallback chain has one of them:
    what a client can actually be answered by a model, not by the canned last resort."""
    if in_rotation is None:
        names = sorted({n for p in topo.pools for n in p.served_names})
    else:
        live = set(in_rotation)
        names = sorted({n for p in topo.pools if any(q.name in live for q in fallback_chain(topo, p))
                        for n in p.served_names})
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": 0, "owned_by": "confgen"} for n in names],
    }
