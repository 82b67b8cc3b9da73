"""Field declarations shared by the model, its decoder and its JSON Schema.

A field's constraints live next to its type, once: the decoder enforces them and the
schema generator publishes them. String fields always name a pattern from `PATTERNS`;
none of them admits a control character or a character that has structure in an Envoy,
Nginx or shell file, so no topology value can change the structure of an output.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

# Each pattern is a whole-string match. None admits `;{}#$"'\` `, newline or NUL.
PATTERNS: dict[str, tuple[str, str]] = {
    "name": (r"[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?", "lowercase letters, digits, '-' and '_' (1-63)"),
    "model": (r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}", "letters, digits and . _ : / @ + - (1-128)"),
    "header": (r"[a-z0-9][a-z0-9-]{0,63}", "a lowercase HTTP header name"),
    "header_value": (r"[A-Za-z0-9._:/@+=,-]{1,128}", "letters, digits and . _ : / @ + = , -"),
    "http_path": (r"/[A-Za-z0-9._~/-]{0,255}", "an absolute URL path of letters, digits and . _ ~ / -"),
    "host": (
        r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
        "a DNS host name",
    ),
    "env_var": (r"[A-Za-z_][A-Za-z0-9_]{0,127}", "an environment variable name"),
    "file_path": (r"(?=/.{1,1023}$)(/[A-Za-z0-9._-]{0,255})+",
                  "an absolute file path of letters, digits and . _ / -, at most 255 between two slashes"),
    "text": (r"[A-Za-z0-9 .,:!?()/_+-]{1,512}", "plain text: letters, digits, spaces and . , : ! ? ( ) / _ + -"),
    "label": (r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}", "letters, digits and . _ / - (1-63)"),
    "cookie": (r"[A-Za-z0-9_-]{1,64}", "letters, digits, '_' and '-'"),
    "k8s_name": (r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?",
                 "a Kubernetes object name: lowercase letters, digits and '-' (1-63), alphanumeric at both ends"),
    "k8s_label_value": (r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?",
                        "a Kubernetes label value: letters, digits and - _ . (1-63), alphanumeric at both ends"),
    "k8s_label_key": (r"(?=[^/]{1,253}/|[^/]*$)([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                      r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?",
                      "a Kubernetes label key: an optional DNS prefix and '/', then letters, digits and - _ . (1-63), "
                      "alphanumeric at both ends"),
    "image": (
        r"[a-z0-9][a-z0-9._/-]{0,200}(:[A-Za-z0-9._-]{1,128})?(@sha256:[a-f0-9]{64})?",
        "a container image reference (registry/name:tag or @sha256:digest)",
    ),
    "url": (
        r"https?://[A-Za-z0-9]([A-Za-z0-9.-]{0,252})(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]{0,255})?",
        "an http:// or https:// URL (host, optional port and path)",
    ),
    "server": (
        r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):[0-9]{1,5}",
        "host:port ([v6]:port for IPv6)",
    ),
    "cidr": (r"[0-9A-Fa-f:.]{2,45}/[0-9]{1,3}", "an IP network in CIDR form, such as 10.0.0.0/8 or fd00::/8"),
    "scale_target": (
        r"(deployment|statefulset)/[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?",
        "deployment/<name> or statefulset/<name>",
    ),
}
COMPILED = {key: re.compile(rx) for key, (rx, _) in PATTERNS.items()}
# The keys of a mapping whose values take a pattern: `label` unless the values' pattern has keys of its own
# (Kubernetes labels). The decoder and the JSON Schema both read it.
_KEY_PATTERNS = {"k8s_label_value": "k8s_label_key"}


def key_pattern(value_pattern: str | None) -> str:
    return _KEY_PATTERNS.get(value_pattern or "", "label")


@dataclass(frozen=True)
class Spec:
    doc: str
    key: str | None = None  # the YAML key when it differs from the attribute name
    pattern: str | None = None  # for str and list[str] / dict[str, str] values
    # Numbers for int/float fields; Durations for Duration fields (e.g. Envoy's "> 0").
    minimum: float | Duration | None = None
    maximum: float | Duration | None = None
    min_items: int | None = None


def field(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    factory: Any = dataclasses.MISSING,
    key: str | None = None,
    pattern: str | None = None,
    minimum: float | Duration | None = None,
    maximum: float | Duration | None = None,
    min_items: int | None = None,
) -> Any:
    """A dataclass field carrying its YAML key, docs and constraints."""
    if pattern is not None and pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern}")
    meta = {"spec": Spec(doc, key, pattern, minimum, maximum, min_items)}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def spec_of(f: dataclasses.Field[Any]) -> Spec:
    spec = f.metadata.get("spec")
    if not isinstance(spec, Spec):
        raise TypeError(f"field {f.name} was not declared with confgen._fields.field")
    return spec


def yaml_key(f: dataclasses.Field[Any]) -> str:
    return spec_of(f).key or f.name


@dataclass(frozen=True, order=True)
class Duration:
    """A span of time written with a unit: 250ms, 5s, 2m, 1h. Stored in milliseconds."""

    ms: int

    @property
    def seconds(self) -> float:
        return self.ms / 1000

    def __str__(self) -> str:
        """As a topology writes it: whole seconds when exact, else milliseconds (5s, 1500ms)."""
        return f"{self.ms}ms" if self.ms % 1000 else f"{self.ms // 1000}s"


# ASCII digits only (`\d` would take "\u0665s", an Arabic-Indic five, as 5 s); bounded
# lengths keep int() cheap and exact.
_DURATION = re.compile(r"([0-9]{1,20})(?:\.([0-9]{1,20}))?(ms|s|m|h)", re.ASCII)
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
MAX_DURATION_MS = 30 * 86_400_000


def parse_duration(text: str) -> Duration | None:
    """A Duration for text like 250ms, 1.5s or 2m; None unless it is whole milliseconds
    of at most 30 days. Exact integer arithmetic: no float rounding, no overflow."""
    match = _DURATION.fullmatch(text)
    if match is None:
        return None
    whole, frac, unit = match.group(1), match.group(2) or "", match.group(3)
    scale = 10 ** len(frac)
    scaled = (int(whole) * scale + int(frac or "0")) * _UNIT_MS[unit]
    if scaled % scale or scaled // scale > MAX_DURATION_MS:
        return None
    return Duration(scaled // scale)


DURATION_HINT = "a duration with a unit, such as 250ms, 5s, 2m or 1h (at most 30 days)"
