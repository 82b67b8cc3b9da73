"""Topology -> the values the nginx templates interpolate (and nothing else decides).

Mirrors the Envoy target: the same pools, the same route order (explicit routes, then one
route per served model to its primary pool, then the default pool), the same limits and
the same answers; where nginx can only approximate, `_features.unsupported` says so.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._fields import Duration
from .._openai import MODEL_CONTENT_TYPES, REPLIES, canned_body, error_body, models_body, retry_after_seconds
from ..balancing import is_hashing, nginx_method
from ..limits import local_client_limits, local_listener_limit
from ..model import MAX_NAME_ADDRESSES, NGINX_CAP_MAX, Pool, RateLimit, Topology, admin_tcp, is_ip, split_address
from ..plan import Plan, PlannedRoute, plan
from .upstream import UpstreamServer, upstream_name, upstream_path

UNAVAILABLE = "confgen_unavailable"  # named location answering when a whole chain failed
_NO_TIMEOUT = "24h"  # nginx has no "never" for proxy timeouts; Envoy's 0s means none


@dataclass(frozen=True)
class Context:
    main: dict[str, Any]
    upstreams: list[tuple[str, list[UpstreamServer], dict[str, Any]]]
    maps: dict[str, list[tuple[str, str]]]  # auth map file -> [(api key, value)]


def duration(d: Duration) -> str:
    """nginx's time text: whole seconds when exact, else milliseconds."""
    return f"{d.ms}ms" if d.ms % 1000 else f"{d.ms // 1000}s"


def timeout(d: Duration) -> str:
    """A proxy timeout; 0 (none) becomes nginx's longest sensible one."""
    return duration(d) if d.ms else _NO_TIMEOUT


def rate(limit: RateLimit) -> str:
    """nginx's rate for a token bucket: whole requests per second or per minute."""
    per_ms = limit.period.ms
    if (limit.rate * 1000) % per_ms == 0:
        return f"{limit.rate * 1000 // per_ms}r/s"
    return f"{max(1, round(limit.rate * 60_000 / per_ms))}r/m"


def burst(limit: RateLimit) -> int:
    """limit_req's burst: with nodelay nginx admits burst + 1 requests at once, the bucket's
    size. 0 (a one-token bucket) is written as no burst at all: nginx refuses `burst=0`."""
    return limit.bucket - 1


# An upstream's shared-memory zone holds its peers: 256k held ~330 of them (measured), and
# the sidecar may publish more addresses than the topology names: a DNS name, as many as it
# takes of one answer (MAX_NAME_ADDRESSES; at 8 a name, a headless Service past ~340 pods made
# every later upstream file fail `nginx -t`: "no memory in upstream zone").
ZONE_BASE_KB = 256
ZONE_KB_PER_ADDRESS = 2
ZONE_ADDRESSES_PER_NAME = MAX_NAME_ADDRESSES


def zone_kb(pool: Pool) -> int:
    """The upstream zone size for `pool` in KiB, with room for what the sidecar may publish."""
    names = sum(1 for w in pool.workers if not _is_ip_worker(w.address))
    addresses = len(pool.workers) - names + names * ZONE_ADDRESSES_PER_NAME
    return ZONE_BASE_KB + ZONE_KB_PER_ADDRESS * addresses


def _is_ip_worker(address: str) -> bool:
    parts = split_address(address)
    return parts is not None and is_ip(parts[0])


def fail_timeout(pool: Pool) -> str:
    """nginx's fail_timeout takes whole seconds (`500ms` is refused): rounded up, at least 1s."""
    return f"{max(1, -(-pool.outlier_detection.base_ejection_time.ms // 1000))}s"


def listen(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{port}"


def next_upstream(pool: Pool) -> list[str]:
    """proxy_next_upstream conditions; [] turns retries off."""
    if pool.retries.attempts == 0:
        return []
    conds: list[str] = []
    on = set(pool.retries.retry_on)
    if on & {"connect-failure", "reset", "refused-stream"}:
        conds.append("error")  # connect error, or the connection broke before the answer's header
    if "gateway-error" in on:
        conds += ["timeout", "http_502", "http_503", "http_504"]
    if not conds:  # only retriable-4xx (409), which nginx cannot select
        return []
    # LLM calls are POSTs: nginx never retries them unless told to.
    return [*conds, "non_idempotent"]


def servers(pool: Pool, *, test: bool) -> list[UpstreamServer]:
    out = []
    for worker in pool.workers:
        parts = split_address(worker.address)
        assert parts is not None  # checked on load
        host, port = parts
        dns = not is_ip(host)
        if dns and pool.discovery == "eds":
            continue  # the sidecar resolves names into this file, as for Envoy's EDS
        if dns and test:
            out.append(UpstreamServer("127.0.0.1", port, worker.weight, down=True, worker=worker.address))
            continue
        out.append(UpstreamServer(host, port, worker.weight, down=worker.drain, worker=worker.address))
    return out


def upstream_options(pool: Pool) -> dict[str, Any]:
    """`render_upstream`'s keyword options for a pool: passive checks and balancing kind."""
    od = pool.outlier_detection
    return {
        "max_fails": od.consecutive_gateway_failure if od.enabled else 0,
        "fail_timeout": fail_timeout(pool),
        "hashing": nginx_method(pool.balancing) in ("hash", "random", "random_two"),
    }


def _hash_var(pool: Pool, index: int, client_header: str | None = None) -> str | None:
    """The variable a hashing pool hashes on. On the header that carries the authenticated client id
    (`auth.client_header`): that id, not the client's own copy of the header (nginx sets the header
    toward the workers only), so a caller neither chooses its worker nor piles onto one, as with Envoy."""
    hash_on = pool.balancing.hash_on
    if hash_on is None or not is_hashing(pool.balancing.policy):
        return None
    if hash_on.header is not None and hash_on.header == client_header:
        return "confgen_client"
    if hash_on.header is not None:
        return "http_" + hash_on.header.replace("-", "_")
    return f"confgen_hash_{index}"


def _route_entry(planned: PlannedRoute) -> dict[str, Any]:
    """One entry of the table njs tries in order, as plain data."""
    entry: dict[str, Any] = {}
    if planned.kind == "default":
        entry["no_model"] = True
    if planned.path_prefix is not None:
        entry["path_prefix"] = planned.path_prefix
    if planned.headers:
        entry["headers"] = [
            {k: v for k, v in (("name", h.name), ("exact", h.exact), ("prefix", h.prefix), ("present", h.present))
             if v is not None}
            for h in planned.headers
        ]
    if planned.models is not None:
        entry["models"] = list(planned.models)
    entry["pool"] = planned.pool.name
    if planned.clients is not None:
        entry["clients"] = list(planned.clients)
    return entry


def route_table(routing: Plan) -> list[dict[str, Any]]:
    """The routes njs tries in order, as plain data."""
    return [_route_entry(planned) for planned in routing.routes]


MapFiles = dict[str, list[tuple[str, str]]]  # auth map file -> [(api key, value)]


def _key_limits(topo: Topology, secrets: Mapping[str, str]) -> tuple[list[dict[str, Any]], MapFiles]:
    """One limit_req zone per distinct per-client bucket, and the map file feeding each."""
    if topo.auth is None:
        return [], {}
    groups: dict[RateLimit, list[str]] = {}
    for client, limit in local_client_limits(topo):
        groups.setdefault(limit, []).append(client)
    limits: list[dict[str, Any]] = []
    maps: MapFiles = {}
    for index, (limit, clients) in enumerate(groups.items()):
        limits.append({"rate": rate(limit), "burst": burst(limit)})
        maps[f"auth/limit-{index}.map"] = [(secrets[c], c) for c in clients]
    return limits, maps


def build_context(
    topo: Topology,
    *,
    config_dir: str,
    secrets: Mapping[str, str],
    test_prefix: str | None,
    ports: Mapping[str, int] | None,
) -> Context:
    test = test_prefix is not None
    routing = plan(topo)
    pools: list[dict[str, Any]] = []
    upstreams: list[tuple[str, list[UpstreamServer], dict[str, Any]]] = []
    for index, pool in enumerate(topo.pools):
        chain = routing.pool(pool.name).chain
        method = nginx_method(pool.balancing)
        hash_on = pool.balancing.hash_on
        cookie = hash_on.cookie if hash_on is not None and method == "hash" else None
        next_up = next_upstream(pool)
        pools.append({
            "index": index,
            "name": pool.name,
            "upstream": upstream_name(pool.name),
            "include": upstream_path(pool.name),
            "balance": method,
            "hash_var": _hash_var(pool, index, topo.auth.client_header if topo.auth is not None else None),
            "cookie": cookie,
            "inflight": topo.in_flight_cap(pool, NGINX_CAP_MAX),
            "zone_kb": zone_kb(pool),
            "connect_timeout": timeout(pool.timeouts.connect),
            "idle_timeout": timeout(pool.timeouts.idle),
            "next_upstream": next_up,
            "tries": pool.retries.attempts + 1,
            "on_failure": f"pool_{chain[1].name}" if len(chain) > 1 else UNAVAILABLE,
        })
        upstreams.append((pool.name, servers(pool, test=test), upstream_options(pool)))
    listeners = []
    for lst in topo.listeners:
        address, port = (("127.0.0.1", ports[lst.name]) if test and ports else (lst.address, lst.port))
        listeners.append({
            "name": lst.name,
            "listen": listen(address, port),
            "header_timeout": timeout(lst.request_headers_timeout),
            "idle_timeout": timeout(lst.stream_idle_timeout),
            "max_body": lst.max_request_bytes,
        })
    admin_address, admin_port = admin_tcp(topo)
    if test and ports:
        admin_address, admin_port = "127.0.0.1", ports["_status"]
    elif not ipaddress.ip_address(admin_address).is_loopback:
        admin_address = "127.0.0.1"  # the status page stays on loopback (see unsupported())
    key_limits, maps = _key_limits(topo, secrets)
    if topo.auth is not None:
        maps["auth/clients.map"] = [(secrets[k.client], k.client) for k in topo.auth.api_keys]
    canned = None
    if topo.last_resort is not None:
        canned = {"status": topo.last_resort.status, "body": canned_body(topo)}
    main: dict[str, Any] = {
        "name": topo.name,
        "config_dir": config_dir,
        "test": {"prefix": test_prefix} if test else None,
        "access_log": f"{test_prefix}/access.log" if test else "/dev/stdout",
        "auth": None if topo.auth is None else {
            "client_header": topo.auth.client_header,
        },
        "global_limit": None if (listener_limit := local_listener_limit(topo)) is None else {
            "rate": rate(listener_limit), "burst": burst(listener_limit),
        },
        "key_limits": key_limits,
        "listeners": listeners,
        "admin": {"listen": listen(admin_address, admin_port)},
        "pools": pools,
        "replies": {name: error_body(name) for name in REPLIES if name != "model_not_found"},
        "retry_after": retry_after_seconds(topo),
        "canned": canned,
        # served by njs: nginx refuses a config parameter over 4 KB (~60 model names)
        "models_body": models_body(topo) if topo.models_endpoint else None,
        # asked first (ngx.fetch): the models with healthy capacity now, from confgen-sidecar
        "models_url": _sidecar_models_url(topo) if topo.models_endpoint and topo.sidecar.models else None,
        "table": {
            "name": topo.name,
            "routes": route_table(routing),
            "json_types": list(MODEL_CONTENT_TYPES),
            # the texts the router answers with itself, shared with the Envoy target
            "forbidden": error_body("forbidden"),
            "model_not_found": list(REPLIES["model_not_found"]),
            "pools": {p["name"]: {"balance": p["balance"], "fallback": p["on_failure"]} for p in pools},
        },
    }
    return Context(main=main, upstreams=upstreams, maps=maps)


def _sidecar_models_url(topo: Topology) -> str:
    host = topo.sidecar.address
    return f"http://{f'[{host}]' if ':' in host else host}:{topo.sidecar.port}/v1/models"
