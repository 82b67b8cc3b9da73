"""Checks that span fields: references, duplicates, cycles, ambiguity, address syntax.

Each check yields (path, message, severity); the caller pins the path to its place in the
file. They run only on a model that decoded cleanly, so every value here is well typed.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections import Counter
from collections.abc import Iterator

from . import _edge_checks
from ._fields import COMPILED
from ._names import object_base
from ._pod_fit import loopback_store
from .balancing import POLICIES, choose, grpc_wanted, is_hashing, picker_wanted, uses_picker
from .errors import Severity
from .limits import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    budgets,
    ceilings,
    clients_losing_per_key,
    envoys,
    floor_amount,
    local_client_limits,
    local_listener_limit,
    needs_store,
)
from .model import (
    GRPC_SOCKET,
    HEALTH_FLOOR_MARGIN_S,
    MAX_SOCKET_PATH,
    LimitSet,
    LimitStore,
    Pool,
    RateLimit,
    Topology,
    admin_tcp,
    grpc_reachable,
    grpc_service_hosts,
    grpc_socket,
    grpc_socket_dir,
    grpc_tls,
    grpc_transport,
    health_floor_s,
    is_ip,
    is_loopback_host,
    limit_list,
    split_address,
)
from .plan import primary_pool_for

Finding = tuple[str, str, Severity]  # path, message, severity
ERROR, WARNING = Severity.ERROR, Severity.WARNING
_HASHING_NAMES = " or ".join(name for name, policy in POLICIES.items() if policy.hashing)


def check(topo: Topology, sections: frozenset[str] = frozenset()) -> list[Finding]:
    """Every finding about `topo`; `sections` are the top-level keys the file wrote (a default
    section and one written out mean different intents: `kubernetes:` deploys the sidecar)."""
    found: list[Finding] = [*_dns_workers(topo, sections), *_ads_servers(topo, sections),
                            *_pod_gaps(topo, sections), *_port_clashes(topo)]
    for checker in (
        _duplicates,
        _addresses,
        _xds,
        _grpc_services,
        _references,
        _fallback_cycles,
        _model_routing,
        _pool_settings,
        _admission,
        _routes,
        _classes,
        _auth_and_limits,
        _limit_floors,
        _per_key_replaced,
        _token_reservations,
        _canned,
    ):
        found.extend(checker(topo))
    found.extend(_edge_checks.check(topo, reserved_header))
    return found


def envoy_refuses_path(path: str) -> str | None:
    """Why Envoy refuses to read a file at `path`, whatever the machine (None: it may read it). Envoy
    canonicalises every file path it loads and refuses one under /dev (but /dev/fd/), /sys or /proc, by
    string prefix ("Invalid path": source/common/filesystem/posix/filesystem_impl.cc, illegalPath; so
    /system/x and /devices/x too). Here without the symlinks only the machine that runs Envoy knows."""
    if path.startswith("/dev/fd/"):
        return None
    canonical = posixpath.normpath(path)
    canonical = "/" + canonical.lstrip("/")  # normpath keeps a leading "//"; the kernel does not
    for prefix in ("/dev", "/sys", "/proc"):
        if canonical.startswith(prefix):
            return (f"{path!r}: Envoy reads no file whose path starts with {prefix} (it refuses /dev, /sys and "
                    "/proc, by prefix, but /dev/fd/)")
    return None


def _dupes(items: list[str]) -> set[str]:
    return {name for name, count in Counter(items).items() if count > 1}


def _later_duplicates(path: str, items: list[str], what: str, key: str = "name") -> Iterator[Finding]:
    seen: set[str] = set()
    for index, item in enumerate(items):
        if item in seen:
            yield f"{path}[{index}].{key}", f"duplicate {what} {item!r}", ERROR
        seen.add(item)


# Envoy route names confgen gives its own routes (the picker and the limits find a route's class and
# budgets by the name Envoy matched: a user route of the same name would take another's class).
RESERVED_ROUTES = {"default": "the default_pool's route", "models-list": "the GET /v1/models route"}
# Envoy cluster names confgen gives its own clusters: pool names start with a letter or digit, so only the
# "confgen_" prefix can collide (a duplicate cluster: Envoy refuses the whole CDS).
RESERVED_POOL_PREFIX = "confgen_"


def _duplicates(topo: Topology) -> Iterator[Finding]:
    yield from _later_duplicates("pools", [p.name for p in topo.pools], "pool name")
    yield from _later_duplicates("routes", [r.name for r in topo.routes], "route name")
    yield from ((f"routes[{i}].name", f"{r.name!r} is reserved: the name of {RESERVED_ROUTES[r.name]}", ERROR)
                for i, r in enumerate(topo.routes) if r.name in RESERVED_ROUTES)
    yield from ((f"pools[{i}].name", f"names starting with {RESERVED_POOL_PREFIX!r} are reserved for confgen's own "
                 "Envoy clusters (confgen_sidecar_grpc, confgen_xds)", ERROR)
                for i, p in enumerate(topo.pools) if p.name.startswith(RESERVED_POOL_PREFIX))
    yield from _later_duplicates("listeners", [lst.name for lst in topo.listeners], "listener name")
    binds = [f"{lst.address}:{lst.port}" for lst in topo.listeners]
    yield from _later_duplicates("listeners", binds, "listen address", key="port")
    admin_address, admin_port = admin_tcp(topo)  # reserved also where Envoy's admin is on its socket: a pod's
    for index, lst in enumerate(topo.listeners):  # render puts it on TCP, and nginx's status page takes it
        wildcard = {lst.address, admin_address} & {"0.0.0.0", "::"}  # either side binds every address
        if lst.port == admin_port and (wildcard or lst.address == admin_address):
            yield f"listeners[{index}].port", f"port {lst.port} is also the admin port", ERROR
    for pi, pool in enumerate(topo.pools):
        yield from _later_duplicates(f"pools[{pi}].workers", [w.address for w in pool.workers], "worker", key="address")
        for name in sorted(_dupes(pool.served_names)):
            where = "models" if pool.models.count(name) > 1 else "aliases"
            yield f"pools[{pi}].{where}", f"model name {name!r} is listed twice", ERROR
    if topo.auth is not None:
        yield from _later_duplicates("auth.api_keys", [k.client for k in topo.auth.api_keys], "client", key="client")


def _addresses(topo: Topology) -> Iterator[Finding]:
    admin_address = admin_tcp(topo)[0]
    for name, address in [("admin.address", admin_address), ("sidecar.address", topo.sidecar.address)] + [
        (f"listeners[{i}].address", lst.address) for i, lst in enumerate(topo.listeners)
    ]:
        if not is_ip(address):
            yield name, f"{address!r} is not an IP address", ERROR
    if topo.admin.socket is not None and (topo.admin.address is not None or topo.admin.port is not None):
        yield ("admin.socket", "Envoy's admin listens on its Unix socket or on TCP (admin.address, admin.port), "
               "not both: drop one", ERROR)
    if topo.admin.socket is not None and len(topo.admin.socket.encode()) > MAX_SOCKET_PATH:
        yield ("admin.socket", f"longer than {MAX_SOCKET_PATH} bytes, the most a Unix socket's path may hold", ERROR)
    if is_ip(admin_address) and not ipaddress.ip_address(admin_address).is_loopback:
        yield (
            "admin.address",
            ("the admin interface can reconfigure and stop Envoy; it should listen on loopback"),
            WARNING,
        )
    picker = picker_wanted(topo)
    limited = needs_store(topo)
    if (picker or limited) and topo.sidecar.grpc_port == topo.sidecar.port:
        yield "sidecar.grpc_port", f"port {topo.sidecar.port} is also the sidecar's HTTP port", ERROR
    for pi, pool in enumerate(topo.pools):
        for wi, worker in enumerate(pool.workers):
            path = f"pools[{pi}].workers[{wi}].address"
            parts = split_address(worker.address)
            if parts is None:
                yield path, f"{worker.address!r} is not host:port (use [v6]:port for IPv6)", ERROR
                continue
            host, _ = parts
            if is_ip(host):
                if worker.address.startswith("[") and ":" not in host:
                    yield path, "write IPv4 workers without brackets: address:port", ERROR
                elif ":" in host and not worker.address.startswith("["):
                    yield path, "write IPv6 workers as [address]:port", ERROR
                continue
            if not COMPILED["host"].fullmatch(host):
                yield path, f"{host!r} is neither an IP address nor a DNS name", ERROR


def _dns_workers(topo: Topology, sections: frozenset[str]) -> Iterator[Finding]:
    """DNS names in an EDS pool take traffic only once the sidecar resolves them: a warning,
    unless the file has a `kubernetes:` section (its pods run the sidecar beside Envoy)."""
    if "kubernetes" in sections:
        return
    for pi, pool in enumerate(topo.pools):
        names = 0
        for worker in pool.workers:
            parts = split_address(worker.address)
            if parts is not None and not is_ip(parts[0]) and COMPILED["host"].fullmatch(parts[0]):
                names += 1
        if names and pool.discovery == "eds":
            yield (
                f"pools[{pi}].workers",
                (
                    f"{names} worker(s) are DNS names: the sidecar resolves them into the EDS file "
                    "(until it runs they take no traffic); set discovery: strict_dns to let Envoy "
                    "resolve them without a sidecar"
                ),
                WARNING,
            )


def _pod_gaps(topo: Topology, sections: frozenset[str]) -> Iterator[Finding]:
    """A file that writes a `kubernetes:` section is meant for pods: what cannot work in one is a warning here
    (`render --target kubernetes` refuses it)."""
    if "kubernetes" in sections and not topo.kubernetes.redis:
        for path, message in loopback_store(topo):
            yield path, message, WARNING


def _port_clashes(topo: Topology) -> Iterator[Finding]:
    """Every port the product binds on one host, against each other: Envoy's listeners and admin, the sidecar's
    HTTP (sidecar.port) and gRPC (sidecar.grpc_port, when Envoy calls it) servers, and in mode ads the control
    plane's ADS port (each of envoy.xds.servers). The sidecar binds beside Envoy (the same box, the same pod:
    in Kubernetes on every address), so its ports clash with a listener on any address; a control plane shares
    Envoy's host when its server is on loopback. Clashes the other checks report (two listeners, a listener on
    the admin port, gRPC on the HTTP port) are not repeated. The second program to bind dies at start
    ("address already in use")."""
    grpc_used = grpc_wanted(topo)
    ads = topo.envoy.xds.mode == "ads"
    envoy = [(f"listeners[{i}].port", f"listener {lst.name!r}", lst.port) for i, lst in enumerate(topo.listeners)]
    envoy.append(("admin.port", "Envoy's admin (admin.port)", admin_tcp(topo)[1]))
    control = []  # the sidecar (files) or the control plane (ads)
    local_servers = False
    for i, server in enumerate(topo.envoy.xds.servers if ads else []):
        parts = split_address(server)
        if parts is not None:
            local_servers |= is_loopback_host(parts[0])
            if is_loopback_host(parts[0]) or grpc_used:
                control.append((f"envoy.xds.servers[{i}]", f"the control plane's ADS port ({server})", parts[1]))
    if not ads or local_servers:
        control.append(("sidecar.port", "the sidecar's HTTP server (sidecar.port)", topo.sidecar.port))
    if grpc_used:
        control.append(("sidecar.grpc_port", "the sidecar's gRPC services (sidecar.grpc_port)", topo.sidecar.grpc_port))
    same_host = envoy if not ads or local_servers else []
    seen: set[tuple[str, str]] = set()
    for path, what, port in [*same_host, *control]:
        for other_path, other, other_port in control:
            if other_path == path or port != other_port or {path, other_path} == {"sidecar.port", "sidecar.grpc_port"}:
                continue
            if (other_path, path) in seen or (path.startswith("envoy.xds") and other_path.startswith("envoy.xds")):
                continue  # control-plane replicas each bind their own server's port (duplicates: _xds)
            seen.add((path, other_path))
            yield path, f"port {port} is also {other}: both bind it on one host, and the second fails at start " \
                "(address already in use)", ERROR
            if path == "admin.port":  # either may be the default: say it at both, so one is where the file wrote it
                yield other_path, f"port {port} is also {what}: both bind it on one host, and the second fails " \
                    "at start (address already in use)", ERROR


def _ads_servers(topo: Topology, sections: frozenset[str]) -> Iterator[Finding]:
    """In mode ads, `confgen render --target kubernetes` names the control plane itself (the
    StatefulSet <base>-xds in kubernetes.namespace, serving on the first server's port): a
    server meant to be it (its name starts with <base>-xds, or any in-cluster `.svc` name when
    the file has a `kubernetes:` section) must be one of its names, or Envoy never connects."""
    xds = topo.envoy.xds
    if xds.mode != "ads" or not xds.servers:
        return
    control = f"{object_base(topo.name)}-xds"
    namespace = topo.kubernetes.namespace
    first = split_address(xds.servers[0])
    port = first[1] if first is not None else 18000
    service = f"{control}.{namespace}.svc"
    known = {f"{control}-{i}.{service}" for i in (0, 1)} | {service}
    known |= {f"{name}.cluster.local" for name in known}
    expected = f"{control}-0.{service}:{port} and {control}-1.{service}:{port}"
    for i, server in enumerate(xds.servers):
        parts = split_address(server)
        if parts is None:
            continue  # reported by _xds
        host, server_port = parts
        meant = host.startswith(control) or ("kubernetes" in sections and host.endswith((".svc", ".svc.cluster.local")))
        if meant and host not in known:
            yield (f"envoy.xds.servers[{i}]",
                   f"{host!r} is not a name of the control plane `render --target kubernetes` creates "
                   f"(the StatefulSet {control} in namespace {namespace}): list {expected}", WARNING)
        elif meant and server_port != port:
            yield (f"envoy.xds.servers[{i}]",
                   f"port {server_port} differs from the first server's {port}, the port the rendered control "
                   f"plane serves on", WARNING)


def _xds(topo: Topology) -> Iterator[Finding]:
    xds = topo.envoy.xds
    if xds.mode == "ads" and not xds.servers:
        yield "envoy.xds.servers", "mode ads needs at least one control-plane server (host:port)", ERROR
    if xds.mode == "files" and xds.servers:
        yield "envoy.xds.servers", "servers are used only with mode: ads", WARNING
    for i, server in enumerate(xds.servers):
        parts = split_address(server)
        if parts is None:
            yield f"envoy.xds.servers[{i}]", f"{server!r} is not host:port (use [v6]:port for IPv6)", ERROR
        elif not is_ip(parts[0]) and not COMPILED["host"].fullmatch(parts[0]):
            yield f"envoy.xds.servers[{i}]", f"{parts[0]!r} is neither an IP address nor a DNS name", ERROR
    yield from ((f"envoy.xds.servers[{i}]", f"{s!r} is listed twice", ERROR)
                for i, s in enumerate(xds.servers) if s in xds.servers[:i])
    if xds.tls is not None:
        if topo.sidecar.grpc_tls is None:
            yield ("envoy.xds.tls", "deprecated: write it as sidecar.grpc_tls, the one TLS block of ADS, the picker "
                   "and rate limits (read as that for one release)", WARNING)
        elif topo.sidecar.grpc_tls != xds.tls:
            yield ("envoy.xds.tls", "deprecated, and not the same as sidecar.grpc_tls: the sidecar serves every gRPC "
                   "surface with one TLS setup; remove envoy.xds.tls", ERROR)
        else:
            yield "envoy.xds.tls", "deprecated: the same as sidecar.grpc_tls; remove it", WARNING
    if xds.mode == "ads" and grpc_transport(topo) != "mtls":
        remote = [(i, s) for i, s in enumerate(xds.servers)
                  if (parts := split_address(s)) and not is_loopback_host(parts[0])]
        if remote:
            index, server = remote[0]
            yield (f"envoy.xds.servers[{index}]", f"{server} is beyond loopback: ADS serves the API keys, so beyond "
                   "loopback it needs mutual TLS (sidecar.grpc_tls); without it Envoy calls the control plane on "
                   "its Unix socket (sidecar.grpc_socket_dir) or plaintext on loopback", ERROR)
    if xds.mode == "ads" and len(xds.servers) == 1:
        yield ("envoy.xds.servers", "one control-plane server: Envoys keep serving when it is down, but take no "
               "change until it is back; list two for high availability", WARNING)


def _grpc_transport(topo: Topology) -> Iterator[Finding]:
    """The one TLS block, the socket directory, the plaintext opt-in."""
    side = topo.sidecar
    tls = grpc_tls(topo)
    if tls is not None:
        path = "sidecar.grpc_tls" if side.grpc_tls is not None else "envoy.xds.tls"
        yield from ((f"{path}.server_names[{i}]", f"{n!r} is listed twice", ERROR)
                    for i, n in enumerate(tls.server_names) if n in tls.server_names[:i])
        for key in ("cert", "key", "ca"):
            reason = envoy_refuses_path(getattr(tls, key))
            if reason is not None:
                yield f"{path}.{key}", reason, ERROR
        if side.grpc_plaintext_loopback:
            yield "sidecar.grpc_plaintext_loopback", "unused: with grpc_tls the gRPC surfaces are mutual TLS", WARNING
        return
    if side.grpc_plaintext_loopback:
        yield ("sidecar.grpc_plaintext_loopback", "plaintext gRPC on loopback: any local process can connect, read the "
               "API keys over ADS and move the limits; the default (Unix sockets, 0600) lets only the sidecar's "
               "user in", WARNING)
        return
    directory = grpc_socket_dir(topo)
    if not directory.startswith("/"):
        yield "sidecar.grpc_socket_dir", f"{directory!r} is not an absolute path", ERROR
    longest = grpc_socket(topo, GRPC_SOCKET)
    if len(longest.encode()) > MAX_SOCKET_PATH:
        yield ("sidecar.grpc_socket_dir", f"{longest!r} is longer than {MAX_SOCKET_PATH} bytes, the most a Unix "
               "socket's path may hold: choose a shorter directory", ERROR)


def _grpc_services(topo: Topology) -> Iterator[Finding]:
    """Envoy reaches the sidecar's gRPC services (the endpoint picker; the rate limit service) beyond
    loopback only over mutual TLS (sidecar.grpc_tls): the sidecar serves plaintext on loopback alone, and
    plaintext beyond it would let anyone who reaches the port steer routing or spend the limits (and
    without TLS every call would fail: requests unpicked, limits failing open)."""
    yield from _grpc_transport(topo)
    tls = grpc_tls(topo)
    wanted = [f"the endpoint picker (pools[{i}].balancing.policy)" for i, p in enumerate(topo.pools)
              if uses_picker(topo, p)]
    if needs_store(topo):
        wanted.append("the rate limit service (scope: global limits)")
    if not wanted:
        if tls is not None and topo.envoy.xds.mode != "ads":
            yield "sidecar.grpc_tls", "used only when Envoy calls the sidecar's gRPC services (ADS, a pool with " \
                "policy prefix_affinity, or scope: global limits)", WARNING
        return
    if grpc_reachable(topo):
        return  # mutual TLS anywhere, an ADS socket (its own check says where one cannot reach), or loopback
    remote = [h for h in grpc_service_hosts(topo) if not is_loopback_host(h)]
    if topo.envoy.xds.mode == "ads":
        index = next(i for i, server in enumerate(topo.envoy.xds.servers)
                     if (split_address(server) or ("", 0))[0] == remote[0])
        path, where = f"envoy.xds.servers[{index}]", f"the control plane at {remote[0]}"
    else:
        path, where = "sidecar.address", f"the sidecar at {remote[0]}"
    yield (path, f"Envoy calls {where}:{topo.sidecar.grpc_port} for {' and '.join(wanted)} beyond "
           "loopback: set sidecar.grpc_tls (mutual TLS: Envoy's client cert, key and the sidecar's CA; the "
           "sidecar's --grpc-tls-cert/--grpc-tls-key/--grpc-client-ca); without it the sidecar serves them on a "
           "Unix socket or plaintext on loopback, on its own host only",
           ERROR)


def _references(topo: Topology) -> Iterator[Finding]:
    pools = {p.name for p in topo.pools}
    clients = {k.client for k in topo.auth.api_keys} if topo.auth else set()

    def unknown_pool(path: str, name: str) -> Iterator[Finding]:
        if name not in pools:
            yield path, f"unknown pool {name!r} (pools: {', '.join(sorted(pools))})", ERROR

    def unknown_clients(path: str, names: list[str] | None) -> Iterator[Finding]:
        if names is not None and topo.auth is None:  # even [] (nobody): there are no clients to tell apart
            yield f"{path}[0]" if names else path, "allow_clients needs auth.api_keys", ERROR
            return
        for index, name in enumerate(names or []):
            if name not in clients:
                yield f"{path}[{index}]", f"unknown client {name!r}", ERROR

    for ri, route in enumerate(topo.routes):
        yield from unknown_pool(f"routes[{ri}].pool", route.pool)
        yield from unknown_clients(f"routes[{ri}].allow_clients", route.allow_clients)
    for pi, pool in enumerate(topo.pools):
        if pool.fallback is not None:
            yield from unknown_pool(f"pools[{pi}].fallback", pool.fallback)
            if pool.fallback == pool.name:
                yield f"pools[{pi}].fallback", "a pool cannot fall back to itself", ERROR
        yield from unknown_clients(f"pools[{pi}].allow_clients", pool.allow_clients)
    if topo.default_pool is not None:
        yield from unknown_pool("default_pool", topo.default_pool)


def _fallback_cycles(topo: Topology) -> Iterator[Finding]:
    by_name = {p.name: p for p in topo.pools}
    reported: set[str] = set()
    for pi, pool in enumerate(topo.pools):
        seen = [pool.name]
        current = pool
        while current.fallback in by_name and current.fallback != current.name:
            nxt = by_name[current.fallback]
            if nxt.name in seen:
                cycle = [*seen[seen.index(nxt.name) :], nxt.name]
                if pool.name in cycle and not reported & set(cycle):
                    reported.update(cycle)
                    yield f"pools[{pi}].fallback", "fallback cycle: " + " -> ".join(cycle), ERROR
                break
            seen.append(nxt.name)
            current = nxt


def _model_routing(topo: Topology) -> Iterator[Finding]:
    explicit = {m for r in topo.routes for m in (r.match.models or [])}
    seen: set[str] = set()
    for pi, pool in enumerate(topo.pools):
        for name in pool.served_names:
            if name in seen or name in explicit:
                continue
            seen.add(name)
            if primary_pool_for(topo, name) is None:
                owners = [p.name for p in topo.pools if name in p.served_names]
                yield (
                    f"pools[{pi}].models",
                    (
                        f"model {name!r} is served by pools {', '.join(owners)}, none of which falls "
                        "back to the others; add a route saying which pool answers it"
                    ),
                    ERROR,
                )
        if pool.fallback is not None:
            try:
                fb = topo.pool(pool.fallback)
            except KeyError:
                continue
            if not set(pool.served_names) & set(fb.served_names):
                yield (
                    f"pools[{pi}].fallback",
                    (
                        f"fallback pool {fb.name!r} serves none of this pool's model names; its workers "
                        "will reject the requests it takes over (give it a shared alias)"
                    ),
                    WARNING,
                )


# Envoy keeps a resolver target per strict_dns host (30,000 passed `envoy --mode validate`
# here, 102,000 ran out of file descriptors); large pools belong on EDS.
MAX_STRICT_DNS_WORKERS = 10_000


def _pool_settings(topo: Topology) -> Iterator[Finding]:
    eds_pools = sum(1 for p in topo.pools if p.discovery == "eds")
    if topo.envoy.xds.mode == "files" and eds_pools > topo.envoy.max_eds_files:
        yield (
            "pools",
            (
                f"{eds_pools} pools use EDS files but envoy.max_eds_files is {topo.envoy.max_eds_files}: Envoy opens "
                "one inotify instance per file and aborts past fs.inotify.max_user_instances (often 128); raise "
                "that sysctl and envoy.max_eds_files together, or merge pools"
            ),
            ERROR,
        )
    dns_hosts = sum(len(p.workers) for p in topo.pools if p.discovery == "strict_dns")
    if dns_hosts > MAX_STRICT_DNS_WORKERS:
        yield (
            "pools",
            (
                f"{dns_hosts} workers are in strict_dns pools: Envoy resolves each one on its own (the fuzzer's "
                f"102,000 made `envoy --mode validate` run out of file descriptors); at most "
                f"{MAX_STRICT_DNS_WORKERS:,} in all: use discovery: eds (the sidecar resolves names) for large pools"
            ),
            ERROR,
        )
    for pi, pool in enumerate(topo.pools):
        base = f"pools[{pi}]"
        bal = pool.balancing
        hashing = is_hashing(bal.policy)
        if bal.hash_on is not None:
            given = [k for k in ("header", "cookie") if getattr(bal.hash_on, k) is not None]
            if len(given) != 1:
                yield f"{base}.balancing.hash_on", "give exactly one of header or cookie", ERROR
            if not hashing:
                yield (
                    f"{base}.balancing.hash_on",
                    f"hash_on needs policy {_HASHING_NAMES}, not {bal.policy}",
                    ERROR,
                )
        elif hashing:
            yield (
                f"{base}.balancing.hash_on",
                (f"{bal.policy} without hash_on hashes nothing: every request lands at random"),
                ERROR,
            )
        hc = pool.health
        if hc.enabled and hc.timeout >= hc.interval:
            yield f"{base}.health.timeout", "must be shorter than health.interval", ERROR
        floor = health_floor_s(pool.engine, pool.health_path)
        if hc.enabled and floor and hc.timeout.seconds < floor + HEALTH_FLOOR_MARGIN_S:
            yield (f"{base}.health.timeout",
                   f"{pool.engine}'s {pool.health_path} answers after {floor:g} s at the earliest (it polls for its "
                   f"one-token generation once a second): a timeout under {floor + HEALTH_FLOOR_MARGIN_S:g}s fails "
                   "healthy workers", WARNING)
        if pool.retries.attempts > 0 and not pool.retries.retry_on:
            yield f"{base}.retries.retry_on", "list at least one failure to retry, or set attempts: 0", ERROR
        for name in sorted(_dupes(list(pool.retries.retry_on))):
            yield f"{base}.retries.retry_on", f"{name!r} is listed twice", ERROR
        scale = pool.autoscale
        if scale is not None and scale.min_replicas > scale.max_replicas:
            yield f"{base}.autoscale.min_replicas", "must not exceed max_replicas", ERROR
        if pool.discovery == "strict_dns" and any(w.drain for w in pool.workers):
            yield f"{base}.workers", "drain needs discovery: eds (the sidecar publishes it)", ERROR
        if scale is not None:
            yield from _fixed_workers_of_autoscaled(base, pool)


def _admission(topo: Topology) -> Iterator[Finding]:
    """A pool's admission budgets are the endpoint picker's: on a pool the picker does not see they do
    nothing, and a sheddable budget above the standard one would refuse standard traffic first."""
    for pi, pool in enumerate(topo.pools):
        adm = pool.admission
        given = adm.given()
        if not given:
            continue
        if not uses_picker(topo, pool):
            choice = choose(topo, pool)
            why = choice.reason or f"balancing policy {choice.policy}"
            yield f"pools[{pi}].admission", (
                f"{', '.join(given)} set, but the endpoint picker does not see this pool's requests ({why}): "
                "these budgets do nothing; the sidecar's in-flight limiter sheds it (backpressure)"), WARNING
        if adm.standard is not None and adm.sheddable is not None and adm.sheddable > adm.standard:
            yield f"pools[{pi}].admission.sheddable", (
                f"{adm.sheddable:g} is above standard's {adm.standard:g}: under overload standard traffic would be "
                "refused before sheddable traffic"), WARNING


def _classes(topo: Topology) -> Iterator[Finding]:
    """Sheddable traffic is refused first by a share the sidecar's limiter raises, and the
    limiter runs for the pools whose endpoints it publishes (discovery eds) only."""
    routed = {r.pool for r in topo.routes if r.class_ == "sheddable"}
    clients = bool(topo.sheddable_clients())
    for pi, pool in enumerate(topo.pools):
        if pool.discovery == "strict_dns" and (clients or pool.name in routed):
            yield f"pools[{pi}].discovery", (
                "this pool gets sheddable traffic, but the sidecar sets the shed share (and the shedding limit) "
                "only for discovery: eds pools: under overload its sheddable traffic is shed like standard "
                "traffic"), WARNING


def _fixed_workers_of_autoscaled(base: str, pool: Pool) -> Iterator[Finding]:
    """An autoscaled pool that lists its workers one by one (IP literals, or a StatefulSet's
    per-pod names `<set>-<ordinal>.<service>...`) sends traffic only to those: the pods the
    autoscaler adds never enter the EDS. The headless Service's name resolves to every pod."""
    assert pool.autoscale is not None
    kind, _, name = pool.autoscale.target.partition("/")
    per_pod = re.compile(rf"{re.escape(name)}-\d+\.")
    fixed = []
    for worker in pool.workers:
        parts = split_address(worker.address)
        if parts is not None and (is_ip(parts[0]) or per_pod.match(parts[0] + ".")):
            fixed.append(parts[0])
    if not fixed:
        return
    service = next((".".join(h.split(".")[1:]) for h in fixed if per_pod.match(h + ".") and "." in h), None)
    instead = (f"list the headless Service instead ({service}:<port>), which the sidecar resolves to every pod"
               if service else "list the workers' headless Service name instead, which the sidecar resolves "
               "to every pod")
    yield (
        f"{base}.workers",
        (
            f"autoscale scales {kind}/{name} up to {pool.autoscale.max_replicas} replicas but the pool lists "
            f"{len(fixed)} fixed worker(s) ({', '.join(fixed[:3])}{', ...' if len(fixed) > 3 else ''}): the pods "
            f"added beyond them never get traffic; {instead}"
        ),
        WARNING,
    )


def _routes(topo: Topology) -> Iterator[Finding]:
    for ri, route in enumerate(topo.routes):
        base = f"routes[{ri}]"
        match = route.match
        for hi, header in enumerate(match.headers or []):
            given = [k for k in ("exact", "prefix", "present") if getattr(header, k) is not None]
            if len(given) != 1:
                yield f"{base}.match.headers[{hi}]", "give exactly one of exact, prefix or present", ERROR
            if topo.auth is not None and header.name in (topo.auth.client_header, "authorization"):
                yield (
                    f"{base}.match.headers[{hi}].name",
                    "routing on credentials or the client header is refused",
                    ERROR,
                )
            elif header.name in UNROUTABLE_HEADERS:
                yield (
                    f"{base}.match.headers[{hi}].name",
                    f"{header.name!r} is a header the proxy strips or sets itself before routing (Envoy and "
                    "nginx would route the same request differently); route on a header of your own",
                    ERROR,
                )
        try:
            pool = topo.pool(route.pool)
        except KeyError:
            continue
        for mi, model in enumerate(match.models or []):
            if model not in pool.served_names:
                yield (
                    f"{base}.match.models[{mi}]",
                    (f"pool {pool.name!r} does not serve {model!r} (it serves: {', '.join(pool.served_names)})"),
                    ERROR,
                )
        catch_all = match.models is None and match.headers is None and match.path_prefix is None
        if catch_all and ri < len(topo.routes) - 1:
            yield f"{base}.match", "matches every request, so the routes after it are never used", WARNING


# Headers the proxies set, strip or read themselves, or that carry the API key: as the
# client-id header each would break authentication or the proxied request (Envoy removes a
# client copy of the id header before api_key_auth reads `authorization`; nginx's
# `proxy_set_header` of it would replace the worker's Host, Connection, ...).
RESERVED_HEADERS = frozenset({
    "authorization", "proxy-authorization", "proxy-authenticate", "host", "connection", "keep-alive",
    "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect", "content-length",
    "content-type", "content-encoding", "cookie", "forwarded", "via", "x-forwarded-for",
    "x-forwarded-proto", "x-forwarded-host", "x-forwarded-port", "x-real-ip", "x-request-id",
})
RESERVED_HEADER_PREFIXES = ("x-envoy-", "proxy-")


# Headers the two targets do not show a route alike (measured with both real proxies): Envoy
# drops hop-by-hop headers and sets x-forwarded-for/-proto and x-request-id before routing,
# while nginx's router (njs) sees only what the client sent.
UNROUTABLE_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "x-forwarded-for", "x-forwarded-proto", "x-request-id",
})


def reserved_header(name: str) -> bool:
    return name in RESERVED_HEADERS or name.startswith(RESERVED_HEADER_PREFIXES)


def _auth_and_limits(topo: Topology) -> Iterator[Finding]:
    if topo.auth is not None:
        if reserved_header(topo.auth.client_header):
            yield (
                "auth.client_header",
                f"{topo.auth.client_header!r} is a header the proxies own or that carries the key; "
                "name a header of your own (for example x-confgen-client)",
                ERROR,
            )
        for ki, key in enumerate(topo.auth.api_keys):
            if (key.env is None) == (key.file is None):
                yield f"auth.api_keys[{ki}]", "give exactly one of env or file", ERROR
    if topo.limits.per_key is not None and topo.auth is None:
        yield "limits.per_key", "per-key limits need auth.api_keys", ERROR
    sets: list[tuple[str, LimitSet | None]] = [
        ("limits.global", topo.limits.global_), ("limits.per_key", topo.limits.per_key)]
    sets += [(f"auth.api_keys[{ki}].rate_limit", k.rate_limit) for ki, k in enumerate(topo.auth.api_keys)] \
        if topo.auth is not None else []
    any_global = False
    for base, value in sets:
        items = limit_list(value)
        locals_ = 0
        for index, lim in enumerate(items):
            path = f"{base}[{index}]" if isinstance(value, list) else base
            any_global = any_global or lim.scope == "global"
            locals_ += lim.scope == "local"
            if lim.scope == "local" and locals_ == 2:
                yield f"{path}.scope", "one local limit per place (a proxy keeps one bucket here); " \
                    "make the others scope: global", ERROR
            yield from _one_limit(path, lim, topo)
    if any_global and topo.limits.store is None:
        yield "limits", "scope: global limits are counted in a shared store: add limits.store " \
            "({redis: host:port})", ERROR
    store = topo.limits.store
    if store is not None:
        yield from _store_address(topo, store)
    if store is not None and not any_global:
        yield "limits.store", "no limit has scope: global; the store is unused", WARNING
    if store is not None and store.username is not None and store.password_env is None:
        yield "limits.store.username", "an ACL user needs its password: add limits.store.password_env", ERROR
    if store is not None and store.username is not None and topo.kubernetes.redis:
        yield ("limits.store.username", "the rendered Redis (kubernetes.redis) has the default user only: drop "
               "username (password_env alone sets its password)", ERROR)
    if store is not None and store.check_timeout <= store.timeout:
        yield "limits.store.check_timeout", f"{store.check_timeout} is not longer than timeout " \
            f"({store.timeout}): Envoy would give up before the sidecar's own fail-open answer", WARNING


def _store_address(topo: Topology, store: LimitStore) -> Iterator[Finding]:
    """One Redis (redis) or the Sentinels of one that fails over (sentinel): exactly one of them."""
    if store.redis is None and store.sentinel is None:
        yield "limits.store", "give redis (host:port) or sentinel ({addresses: [host:port, ...], master: name})", \
            ERROR
    if store.redis is not None and store.sentinel is not None:
        yield "limits.store.sentinel", "give redis or sentinel, not both: with sentinel the Sentinels name the " \
            "primary", ERROR
    if store.sentinel is None:
        return
    addresses = store.sentinel.addresses
    yield from ((f"limits.store.sentinel.addresses[{i}]", f"{a!r} is listed twice", ERROR)
                for i, a in enumerate(addresses) if a in addresses[:i])
    if len(addresses) == 2:
        yield ("limits.store.sentinel.addresses", "two Sentinels: a quorum of 2 cannot fail over when one of them is "
               "on the lost host, a quorum of 1 lets one Sentinel alone promote a replica; run three", WARNING)
    if topo.kubernetes.redis:
        yield ("kubernetes.redis", "the rendered Redis is one server without Sentinels: with limits.store.sentinel "
               "run your own Sentinel set-up and drop kubernetes.redis", ERROR)


def _limit_floors(topo: Topology) -> Iterator[Finding]:
    """A global limit with no local limit beside it: what a client gets while the store is away."""
    if topo.limits.store is None:
        return
    count = envoys(topo)
    ceiling_of = {c.budget.id: c for c in ceilings(topo)}
    locals_by_place: dict[str, bool] = {}
    for budget in budgets(topo):
        if budget.limit.fail_closed:
            continue
        place = budget.path.rsplit("[", 1)[0] if budget.path.endswith("]") else budget.path
        if place not in locals_by_place:
            if place == "limits.global":
                locals_by_place[place] = local_listener_limit(topo) is not None
            elif place == "limits.per_key":
                locals_by_place[place] = any(lim.scope == "local" for lim in limit_list(topo.limits.per_key))
            else:
                client = budget.clients[0] if budget.clients else ""
                locals_by_place[place] = any(c == client for c, _ in local_client_limits(topo))
        if locals_by_place[place]:
            continue
        share = floor_amount(budget, count)
        counters = "control planes" if topo.envoy.xds.mode == "ads" else "Envoys"
        what = "requests" if not budget.tokens else budget.limit.unit.replace("_", " ")
        window = budget.limit.window or "second"
        yield budget.path, (
            f"no local limit beside this global one: while limits.store cannot be reached each of the "
            f"{count} {counters} (limits.store.envoys) admits {share} {what} a {window} on its own, so a client "
            f"can get {share * count} a {window} during an outage, up to {budget.amount + share * count} in the "
            f"{window} it starts (the store's count before it plus the floors)"
            + ("" if (ceiling := ceiling_of.get(budget.id)) is None else
               f", and while the rate limit service itself does not answer each Envoy admits up to its ceiling "
               f"of {ceiling.max_tokens} in that {window} and {ceiling.tokens_per_fill} a {window} after, per route")
            + "; add a local limit to bound each proxy, or fail_closed: true to refuse instead"), WARNING


def _per_key_replaced(topo: Topology) -> Iterator[Finding]:
    """A client's own rate_limit replaces limits.per_key whole: say which per-key limits it drops."""
    for ki, client, lost in clients_losing_per_key(topo):
        yield f"auth.api_keys[{ki}].rate_limit", (
            f"client {client}'s own rate_limit replaces limits.per_key: it is not limited by "
            f"{', '.join(lost)} from limits.per_key (repeat them here to keep them)"), WARNING


def _token_reservations(topo: Topology) -> Iterator[Finding]:
    """A token budget reserves a request's worst case: a pool without max_output_tokens
    reserves the default for requests without max_tokens."""
    if not any(b.tokens for b in budgets(topo)):
        return
    for pi, pool in enumerate(topo.pools):
        if pool.max_output_tokens is None:
            yield f"pools[{pi}].max_output_tokens", (
                f"token budgets reserve what a request can generate; a request to {pool.name} without "
                f"max_tokens reserves {DEFAULT_MAX_OUTPUT_TOKENS} tokens (the default): set the engine's own "
                "limit here"), WARNING


def _one_limit(path: str, lim: RateLimit, topo: Topology) -> Iterator[Finding]:
    tokens = lim.unit != "requests"
    if lim.scope == "local":
        if tokens:
            yield f"{path}.unit", f"{lim.unit} limits need scope: global (a proxy's own bucket counts requests; " \
                "tokens are known only when the answer ends, and counted by the rate limit service)", ERROR
        if lim.per is None:
            yield f"{path}.per", "a local limit needs per (its bucket's refill period)", ERROR
        for name in ("window", "per_model", "fail_closed"):
            if getattr(lim, name) not in (None, False):
                yield f"{path}.{name}", f"{name} is for scope: global limits", ERROR
    else:
        if lim.window is None:
            yield f"{path}.window", "a global limit needs window (second, minute, hour or day)", ERROR
        if lim.per is not None:
            yield f"{path}.per", "a global limit counts fixed windows: use window instead of per", ERROR
        if lim.burst is not None:
            yield f"{path}.burst", "burst is for local token buckets; a global window admits its whole amount", ERROR
    if tokens:
        if lim.tokens is None:
            yield f"{path}.tokens", f"unit {lim.unit} needs tokens (the budget per window)", ERROR
        if lim.requests is not None:
            yield f"{path}.requests", f"unit {lim.unit} counts tokens: give tokens, not requests", ERROR
    else:
        if lim.requests is None:
            yield f"{path}.requests", "unit requests needs requests (the amount per period)", ERROR
        if lim.tokens is not None:
            yield f"{path}.tokens", "tokens needs a token unit (input_tokens, output_tokens or total_tokens)", ERROR


def _canned(topo: Topology) -> Iterator[Finding]:
    canned = topo.last_resort
    if canned is None:
        return
    if canned.kind == "error" and canned.status < 400:
        yield "last_resort.status", "an error answer needs a 4xx or 5xx status", ERROR
    if canned.kind == "completion" and canned.status != 200:
        yield "last_resort.status", "a canned completion is answered with status 200", ERROR
