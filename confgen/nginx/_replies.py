"""Answers nginx makes itself, as the same OpenAI-style JSON errors the Envoy target sends."""

from __future__ import annotations

import math
from typing import Any

from ..model import Topology


def _error(message: str, kind: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


def retry_after_seconds(topo: Topology) -> int:
    return max(1, math.ceil(topo.backpressure.retry_after.seconds))


def replies() -> dict[str, dict[str, Any]]:
    """Every fixed body, by the situation it answers (texts match the Envoy target's)."""
    return {
        "rate_limited": _error(
            "Rate limit exceeded. Retry after the time in the retry-after header.",
            "rate_limit_error",
            "rate_limit_exceeded",
        ),
        "overloaded": _error(
            "The model is overloaded. Retry after the time in the retry-after header.",
            "server_overloaded",
            "overloaded",
        ),
        "no_healthy": _error(
            "No healthy worker can serve this model right now.", "service_unavailable", "no_healthy_upstream"
        ),
        "unauthorized": _error(
            "Missing or invalid API key. Send it as Authorization: Bearer <key>.",
            "invalid_request_error",
            "invalid_api_key",
        ),
        "too_large": _error("The request body is too large.", "invalid_request_error", "request_too_large"),
        "not_found_path": _error("Not found.", "invalid_request_error", "not_found"),
    }
