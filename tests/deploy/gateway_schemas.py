"""JSON Schemas for the two Gateway API objects `render --target gateway-api` writes, for jsonschema.

Transcribed by hand from the published v1 APIs: InferencePool (inference.networking.k8s.io/v1, the CRD
config/crd/bases/inference.networking.k8s.io_inferencepools.yaml of kubernetes-sigs/gateway-api-inference-extension
at 84436a96b9e6ce2b59ddacd3d04c31b4fbd442de) and HTTPRoute (gateway.networking.k8s.io/v1, the standard channel's
config/crd/standard/gateway.networking.k8s.io_httproutes.yaml of kubernetes-sigs/gateway-api at
4564255ac2c35d582249b3cdf261bdf51c8bca32); both projects are Apache-2.0. Each schema keeps, for the fields
the render writes, the published types, required fields, enums, bounds and patterns, and, as kubectl's strict
field validation does, refuses a field the API does not have (`additionalProperties: false`). The two CEL
rules of InferencePool that bear on what we write (a Service reference needs a port; target port numbers
unique) are checked by `cel_rules`. Fields the render never writes are left out, so the schema refuses them
too: a new field in the render needs its line here, checked against the API.

These are not the published files (fetched files stay out of this repository); the rendered objects were also
validated against the published CRDs' openAPIV3Schema in the session that wrote this (no error, no unknown
field).
"""

from __future__ import annotations

from typing import Any

GROUP = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
KIND = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
HEADER_NAME = r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$"
NAMESPACE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
PORT_OBJ = _obj({"number": PORT}, ("number",))
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_TOP = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}

INFERENCE_POOL: dict[str, Any] = _obj({
    **_TOP,
    "spec": _obj({
        "appProtocol": {"type": "string", "enum": ["http", "kubernetes.io/h2c"]},
        "selector": _obj({"matchLabels": {
            "type": "object", "minProperties": 1, "maxProperties": 64,
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE}}}, ("matchLabels",)),
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT_OBJ},
        "endpointPickerRef": _obj({
            "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"]},
            "group": {"type": "string", "maxLength": 253, "pattern": GROUP},
            "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": KIND},
            "name": _NAME,
            "port": PORT_OBJ,
        }, ("name",)),
    }, ("selector", "targetPorts")),
}, ("spec",))

_PATH = _obj({"type": {"type": "string", "enum": ["Exact", "PathPrefix", "RegularExpression"]},
              "value": {"type": "string", "maxLength": 1024}})
_HEADER = _obj({"type": {"type": "string", "enum": ["Exact", "RegularExpression"]},
                "name": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": HEADER_NAME},
                "value": {"type": "string", "minLength": 1, "maxLength": 4096}}, ("name", "value"))
HTTP_ROUTE: dict[str, Any] = _obj({
    **_TOP,
    "spec": _obj({
        "parentRefs": {"type": "array", "maxItems": 32, "items": _obj({
            "group": {"type": "string", "maxLength": 253, "pattern": GROUP},
            "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": KIND},
            "name": _NAME,
            "namespace": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": NAMESPACE},
        }, ("name",))},
        "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": _obj({
            "matches": {"type": "array", "maxItems": 64, "items": _obj({
                "path": _PATH,
                "headers": {"type": "array", "maxItems": 16, "items": _HEADER},
            })},
            "backendRefs": {"type": "array", "maxItems": 16, "items": _obj({
                "group": {"type": "string", "maxLength": 253, "pattern": GROUP},
                "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": KIND},
                "name": _NAME,
            }, ("name",))},
        })},
    }),
}, ("spec",))

SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
           ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE}


def cel_rules(doc: dict[str, Any]) -> list[str]:
    """The published CEL rules (x-kubernetes-validations) a JSON Schema cannot say, for the fields we write."""
    if doc["kind"] != "InferencePool":
        return []
    spec, broken = doc["spec"], []
    ref = spec.get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
        broken.append("port is required when kind is 'Service' or unspecified (defaults to 'Service')")
    numbers = [p["number"] for p in spec["targetPorts"]]
    if len(set(numbers)) != len(numbers):
        broken.append("port number must be unique")
    return broken
