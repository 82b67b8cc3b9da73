r"""The second guard between topology values and the nginx config: Jinja filters that refuse.

The model's patterns already keep `;{}#$"'\`, whitespace and control characters out of
every string field. These filters check again at the last moment, on every value the
templates interpolate, so a value that skipped validation (a new field, a secret, a
caller building a model by hand) raises instead of changing the structure of the file.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import UnsafeValueError

__all__ = ["FILTERS", "UnsafeValueError", "bare", "js_literal", "json_body", "quoted"]

# A bare nginx token: no whitespace, quotes, `;`, braces, `#`, `$` or backslash.
_BARE = re.compile(r"[A-Za-z0-9._:/@+=,~\[\]-]+")
# Text inside a single-quoted nginx string: no quote, backslash, `$` (variable
# expansion in `return`) or control character.
_QUOTED_FORBIDDEN = re.compile(r"['\\$\x00-\x1f\x7f]")


def bare(value: Any) -> str:
    """`value` as one bare nginx token; raises unless every character is in the safe set."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise UnsafeValueError(f"refusing to write a {type(value).__name__} into the nginx config")
    text = str(value)
    if not _BARE.fullmatch(text):
        raise UnsafeValueError(f"refusing to write {text!r} into the nginx config (unsafe characters)")
    return text


def quoted(value: Any) -> str:
    """`value` as a single-quoted nginx string (for JSON bodies); raises on unsafe characters."""
    if not isinstance(value, str) or not value:
        raise UnsafeValueError(f"refusing to write {value!r} as an nginx string")
    if _QUOTED_FORBIDDEN.search(value):
        raise UnsafeValueError(f"refusing to write {value!r} as an nginx string (quote, \\, $ or control)")
    return f"'{value}'"


def js_literal(value: Any) -> str:
    """`value` as a JavaScript literal (JSON, ASCII only, so no line terminator can appear)."""
    text = json.dumps(value, ensure_ascii=True, sort_keys=True, separators=(",", ":"))
    if "</" in text:  # never expected; keeps the generated module plain data
        raise UnsafeValueError("refusing '</' in generated JavaScript data")
    return text


def json_body(value: Any) -> str:
    """A compact JSON document written as a single-quoted nginx string."""
    return quoted(json.dumps(value, ensure_ascii=True, sort_keys=True, separators=(",", ":")))


FILTERS = {"ngx": bare, "ngx_sq": quoted, "js": js_literal, "ngx_json": json_body}
