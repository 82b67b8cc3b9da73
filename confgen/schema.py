"""JSON Schema (draft-07) of the topology, generated from the model for editor completion.

The committed copy (schema/topology.schema.json) is tested to equal this output.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal, Union

from ._decode import _hints
from ._fields import DURATION_HINT, PATTERNS, Duration, key_pattern, spec_of, yaml_key
from .model import Topology, Worker

SCHEMA_ID = "https://confgen.dev/schema/topology.schema.json"


def _type_schema(tp: Any, pattern: str | None, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return {"anyOf": [*(_type_schema(a, pattern, defs) for a in args), {"type": "null"}]}
    if origin is Literal:
        return {"type": "string", "enum": list(typing.get_args(tp))}
    if origin is list:
        return {"type": "array", "items": _type_schema(typing.get_args(tp)[0], pattern, defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(str, pattern, defs),
                "propertyNames": _type_schema(str, key_pattern(pattern), defs)}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        if pattern is None:
            return {"type": "string"}
        return {"type": "string", "pattern": f"^(?:{PATTERNS[pattern][0]})$"}
    if tp is Duration:
        return {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(ms|s|m|h)$", "description": DURATION_HINT}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # placeholder against recursion
            defs[name] = _object_schema(tp, defs)
        return {"$ref": f"#/definitions/{name}"}
    raise TypeError(f"no schema for {tp!r}")


def _default(value: Any) -> Any:
    if isinstance(value, Duration):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return None
    return value


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = _hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for fld in dataclasses.fields(cls):
        spec = spec_of(fld)
        prop = _type_schema(hints[fld.name], spec.pattern, defs)
        prop = {**prop, "description": spec.doc}
        if isinstance(spec.minimum, Duration):  # a string in the file: say it in words
            prop["description"] += f" At least {spec.minimum}."
        elif spec.minimum is not None:
            prop["minimum"] = spec.minimum
        if isinstance(spec.maximum, Duration):
            prop["description"] += f" At most {spec.maximum}."
        elif spec.maximum is not None:
            prop["maximum"] = spec.maximum
        if spec.min_items is not None:
            prop["minItems"] = spec.min_items
        if fld.default is not dataclasses.MISSING:
            default = _default(fld.default)
            if default is not None:
                prop["default"] = default
        elif fld.default_factory is dataclasses.MISSING:
            required.append(yaml_key(fld))
        props[yaml_key(fld)] = prop
    body: dict[str, Any] = {
        "type": "object",
        "properties": props,
        "patternProperties": {"^x-": {}},  # extension keys, ignored (a place for anchors)
        "additionalProperties": False,
    }
    if required:
        body["required"] = required
    if cls is Worker:
        return {"anyOf": [body, {"type": "string", "description": "host:port shorthand"}]}
    return body


def schema() -> dict[str, Any]:
    defs: dict[str, Any] = {}
    root = _object_schema(Topology, defs)
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": SCHEMA_ID,
        "title": "confgen topology",
        **root,
        "definitions": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"
