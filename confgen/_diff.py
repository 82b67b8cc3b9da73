"""What would change: `render --check --diff`, for a person reviewing a drift.

For every file that differs, lines a reviewer can act on:
- an Envoy EDS file: per worker, added / removed / which of weight, health, zone, labels
  changed and how;
- any other JSON file: the field paths that changed, with old and new values;
- text (nginx.conf, manifests): a unified diff.
Each file's description is capped, so a huge drift stays readable. Pure: bytes in, lines out.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

__all__ = ["describe_change"]

MAX_LINES_PER_FILE = 40


def describe_change(rel: str, old: bytes, new: bytes) -> list[str]:
    """Lines saying how `rel` would change from `old` (on disk) to `new` (rendered). API keys are never shown
    (a drift check's output lands in CI logs): nginx's key maps by count of lines, Envoy's credentials by a
    digest of each key."""
    if rel.startswith("auth/"):
        changed = len(set(old.splitlines()) ^ set(new.splitlines()))
        return [f"(holds API keys, not shown: {changed} lines differ)"]
    lines = _json_change(old, new)
    if lines is None:
        lines = _text_change(rel, old, new)
    if len(lines) > MAX_LINES_PER_FILE:
        lines = [*lines[:MAX_LINES_PER_FILE], f"... {len(lines) - MAX_LINES_PER_FILE} more"]
    return lines


def _json_change(old: bytes, new: bytes) -> list[str] | None:
    try:
        before, after = _scrub(json.loads(old)), _scrub(json.loads(new))
    except (ValueError, UnicodeDecodeError):
        return None
    endpoints_before, endpoints_after = _endpoints(before), _endpoints(after)
    if endpoints_before is not None and endpoints_after is not None:
        return _endpoint_change(endpoints_before, endpoints_after)
    return [f"{path or '<document>'}: {_show(a)} -> {_show(b)}" for path, a, b in _walk("", before, after)]


_MISSING = object()


def _scrub(value: Any) -> Any:
    """`value` with every API key (a credential: {"key": ..., "client": ...}) replaced by a short digest."""
    if isinstance(value, dict):
        out = {k: _scrub(v) for k, v in value.items()}
        if "client" in value and isinstance(value.get("key"), str):
            out["key"] = "sha256:" + hashlib.sha256(value["key"].encode()).hexdigest()[:8]
        return out
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _walk(path: str, a: Any, b: Any) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            yield from _walk(f"{path}.{key}" if path else str(key), a.get(key, _MISSING), b.get(key, _MISSING))
    elif isinstance(a, list) and isinstance(b, list):
        named_a, named_b = _by_name(a), _by_name(b)
        if named_a is not None and named_b is not None:  # listeners, clusters, routes: by name, not position
            for name in sorted(set(named_a) | set(named_b)):
                yield from _walk(f"{path}[{name}]", named_a.get(name, _MISSING), named_b.get(name, _MISSING))
            return
        for i in range(max(len(a), len(b))):
            yield from _walk(f"{path}[{i}]", a[i] if i < len(a) else _MISSING, b[i] if i < len(b) else _MISSING)
    elif a != b or type(a) is not type(b):
        yield path, a, b


def _by_name(items: list[Any]) -> dict[str, Any] | None:
    named: dict[str, Any] = {}
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name in named:
            return None
        named[name] = item
    return named or None


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _endpoints(doc: Any) -> dict[str, dict[str, Any]] | None:
    """worker -> its routing-relevant fields, when `doc` is a ClusterLoadAssignment file."""
    try:
        resources = doc["resources"]
        cla = resources[0]
        if len(resources) != 1 or "cluster_name" not in cla:
            return None
        found: dict[str, dict[str, Any]] = {}
        for group in cla.get("endpoints", []):
            zone = group.get("locality", {}).get("zone")
            for lb in group.get("lb_endpoints", []):
                sock = lb["endpoint"]["address"]["socket_address"]
                meta = dict(lb.get("metadata", {}).get("filter_metadata", {}).get("confgen", {}))
                name = meta.pop("worker", None) or f"{sock['address']}:{sock['port_value']}"
                found[str(name)] = {
                    "address": f"{sock['address']}:{sock['port_value']}",
                    "weight": lb.get("load_balancing_weight", 1),
                    "health": lb.get("health_status", "HEALTHY"),
                    "zone": zone,
                    "labels": meta,
                }
        return found
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def _endpoint_change(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for worker in sorted(set(before) | set(after)):
        old, new = before.get(worker), after.get(worker)
        if old is None and new is not None:
            lines.append(f"worker {worker}: added (weight {new['weight']}, {new['health']})")
        elif new is None and old is not None:
            lines.append(f"worker {worker}: removed (was weight {old['weight']}, {old['health']})")
        elif old is not None and new is not None and old != new:
            changed = ", ".join(f"{key} {_show(old[key])} -> {_show(new[key])}"
                                for key in old if old[key] != new[key])
            lines.append(f"worker {worker}: {changed}")
    return lines or ["only the file's version or layout differs (same workers, weights and health)"]


def _text_change(rel: str, old: bytes, new: bytes) -> list[str]:
    before = old.decode("utf-8", errors="replace").splitlines()
    after = new.decode("utf-8", errors="replace").splitlines()
    diff = difflib.unified_diff(before, after, fromfile=f"{rel} (on disk)", tofile=f"{rel} (rendered)",
                                lineterm="", n=1)
    return list(diff)
