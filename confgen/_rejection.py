"""A real proxy's refusal, said in the topology's terms.

`validate --envoy/--nginx` runs the real proxy on what we render. When it refuses, its
words are about the rendered config: Envoy prints a protobuf dump of the whole bootstrap
followed by a chain of validation causes, nginx names a directive in a file of ours. A
user needs the topology field that led there. Each function here takes the proxy's text
and what was rendered, and returns (topology field path, one short line); the path is ""
when no field can be named, and the caller pins it to the file's top.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from .model import Topology

__all__ = ["Refusal", "explain_envoy", "explain_nginx"]


class Refusal(NamedTuple):
    """One thing a real proxy refused, in the topology's terms."""

    field: str  # topology field path; "" when none can be named (pinned to the file's top)
    message: str  # one short line

_MAX_MESSAGE = 300
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\[[^\]]*\]\[[^\]]*\]\[[^\]]*\] \[[^\]]*\] ")
_PROTO_CAUSES = re.compile(r"Proto constraint validation failed \((?P<chain>.*)\)\s*$", re.S)
_CAUSE = re.compile(r"^\w+ValidationError\.(?P<field>\w+)(?P<index>\[\d+\])?(?:: (?P<reason>.*))?$", re.S)

# Sub-paths of an Envoy cluster -> the pool field that sets them (longest prefix wins).
_CLUSTER_FIELDS = {
    "connect_timeout": "timeouts.connect",
    "health_checks[0].timeout": "health.timeout",
    "health_checks[0].interval": "health.interval",
    "health_checks[0].no_traffic_interval": "health.no_traffic_interval",
    "health_checks[0].unhealthy_threshold": "health.unhealthy_threshold",
    "health_checks[0].healthy_threshold": "health.healthy_threshold",
    "health_checks[0].http_health_check": "health.path",
    "health_checks": "health",
    "outlier_detection.interval": "outlier_detection.interval",
    "outlier_detection.base_ejection_time": "outlier_detection.base_ejection_time",
    "outlier_detection.max_ejection_percent": "outlier_detection.max_ejection_percent",
    "outlier_detection.consecutive_gateway_failure": "outlier_detection.consecutive_gateway_failure",
    "outlier_detection": "outlier_detection",
    "circuit_breakers.thresholds[0].retry_budget": "retries",
    "circuit_breakers": "capacity",
    "load_assignment": "workers",
    "least_request_lb_config": "balancing",
    "ring_hash_lb_config": "balancing",
    "maglev_lb_config": "balancing",
    "lb_policy": "balancing.policy",
}
# Words in a listener's sub-path -> the top-level block that sets them.
_LISTENER_WORDS = (("token_bucket", "limits"), ("local_ratelimit", "limits"), ("api_key", "auth"),
                   ("rbac", "auth"), ("max_request_bytes", "limits"))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _first_line(text: str) -> str:
    """The first line that says something: no log prefix, no protobuf dump."""
    text = re.sub(r"goo\.gle/debugonly.*?\n: ", "", text, flags=re.S)  # the bootstrap dump Envoy prints
    for raw in text.splitlines():
        line = _LOG_PREFIX.sub("", raw).strip()
        line = re.sub(r"^error initializing configuration '[^']*': ", "", line)
        if line:
            return line if len(line) <= _MAX_MESSAGE else line[: _MAX_MESSAGE - 3] + "..."
    return "refused, without a message"


def _envoy_path(text: str) -> tuple[str, str] | None:
    """(path in the bootstrap, reason) from Envoy's chain of validation causes."""
    found = _PROTO_CAUSES.search(text)
    if found is None:
        return None
    parts: list[str] = []
    reason = ""
    for cause in found.group("chain").split(" | caused by "):
        match = _CAUSE.match(cause.strip())
        if match is None:
            return None
        parts.append(_snake(match.group("field")) + (match.group("index") or ""))
        reason = match.group("reason") or reason
    return ".".join(parts), reason


def _index(path: str, key: str) -> tuple[int, str] | None:
    match = re.match(rf"^static_resources\.{key}\[(\d+)\]\.?(.*)$", path)
    return (int(match.group(1)), match.group(2)) if match else None


def _pool_field(topo: Topology, cluster: str, sub: str) -> str:
    names = [pool.name for pool in topo.pools]
    owner = cluster if cluster in names else next((n for n in names if cluster.startswith(f"{n}-")), None)
    if owner is None:
        return "pools"
    base = f"pools[{names.index(owner)}]"
    for prefix in sorted(_CLUSTER_FIELDS, key=len, reverse=True):
        if sub == prefix or sub.startswith((f"{prefix}.", f"{prefix}[")):
            return f"{base}.{_CLUSTER_FIELDS[prefix]}"
    return base


def _listener_field(topo: Topology, listener: str, sub: str) -> str:
    for word, block in _LISTENER_WORDS:
        if word in sub:
            return block
    names = [item.name for item in topo.listeners]
    return f"listeners[{names.index(listener)}]" if listener in names else "listeners"


_INVALID_PATH = re.compile(r"Invalid path: (?P<path>\S+)")


def _file_field(topo: Topology, path: str) -> str:
    """The topology field naming a file Envoy reads ("Invalid path": not readable on this machine, or under
    /dev, /sys or /proc), "" when none names it."""
    for where, tls in (("sidecar.grpc_tls", topo.sidecar.grpc_tls), ("envoy.xds.tls", topo.envoy.xds.tls)):
        for key in ("cert", "key", "ca"):
            if tls is not None and getattr(tls, key) == path:
                return f"{where}.{key}"
    return ""


def explain_envoy(text: str, bootstrap: Mapping[str, Any], topo: Topology) -> Refusal:
    """(topology field, short message) for one error record of `envoy --mode validate`
    run on `bootstrap` (the static bootstrap the check inlined)."""
    located = _envoy_path(text)
    if located is None:
        first = _first_line(text)
        invalid = _INVALID_PATH.search(first)
        return Refusal(_file_field(topo, invalid.group("path")) if invalid else "", f"Envoy refused it: {first}")
    path, reason = located
    message = f"Envoy refused {path}: {reason}" if reason else f"Envoy refused {path}"
    static = bootstrap.get("static_resources", {})
    if (hit := _index(path, "clusters")) is not None and hit[0] < len(static.get("clusters", [])):
        return Refusal(_pool_field(topo, str(static["clusters"][hit[0]].get("name", "")), hit[1]), message)
    if (hit := _index(path, "listeners")) is not None and hit[0] < len(static.get("listeners", [])):
        return Refusal(_listener_field(topo, str(static["listeners"][hit[0]].get("name", "")), hit[1]), message)
    return Refusal("", message)


_NGINX_WHERE = re.compile(r" in (?P<file>\S+?):(?P<line>\d+)\s*$")
_NGINX_DIRECTIVES = (("limit_conn", "backpressure"), ("limit_req", "limits"), ("listen", "listeners"),
                     ("server_name", "listeners"), ("client_max_body_size", "limits"), ("map", "auth"))


def explain_nginx(line: str, files: Mapping[str, bytes], prefix: str, topo: Topology) -> Refusal:
    """(topology field, short message) for one `nginx -t` error line about the files
    rendered under `prefix` (rel path -> content)."""
    text = re.sub(r"^nginx: ", "", line.strip()).replace(prefix.rstrip("/") + "/", "")
    where = _NGINX_WHERE.search(text)
    if where is None:
        return Refusal("", f"nginx refused it: {text}")
    rel, number = where.group("file"), int(where.group("line"))
    message = f"nginx refused {rel}:{number}: {text[: where.start()]}"
    if rel.startswith("upstreams/") and rel.endswith(".conf"):
        return Refusal(_pool_field(topo, rel.removeprefix("upstreams/").removesuffix(".conf"), ""), message)
    if rel.startswith("keys/"):
        return Refusal("auth", message)
    content = files.get(rel, b"").decode(errors="replace").splitlines()
    directive = content[number - 1].split()[0] if 0 < number <= len(content) and content[number - 1].split() else ""
    for name, block in _NGINX_DIRECTIVES:
        if directive == name or directive.startswith(f"{name}_"):
            return Refusal(block, message)
    return Refusal("", message)

