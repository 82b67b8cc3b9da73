"""Nginx target (open-source nginx with njs): a pure function from the topology to files.

    render(topo, config_dir=..., secrets=...) -> {relative path: bytes}

    nginx.conf                 http block: upstreams, listeners, limits, replies
    upstreams/<pool>.conf      one pool's `server` lines (the sidecar replaces these)
    njs/confgen.js             routing on the body's `model`, the status page
    auth/clients.map           API key -> client id (only with auth; written 0600)
    auth/limit-<n>.map         API key -> bucket key for one per-client rate limit

`config_dir` is where the files live when nginx reads them (include and js paths are
absolute). `render_for_test` renders a copy that listens on given loopback ports and keeps
pid, logs and temp files under a prefix, for `nginx -t` and tests (the caller picks the
ports: `confgen.verify.loopback_ports`; rendering binds nothing). `unsupported` lists
what the topology asks for that open-source nginx cannot do. `upstream_options(pool)` and
`render_upstream` let a sidecar rewrite one pool's file exactly as `render` would.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath

from ..errors import SecretError
from ..model import Topology, admin_tcp
from ..secrets import BEARER_TOKEN
from ._context import build_context, upstream_options
from ._features import refused, unsupported
from ._guard import UnsafeValueError
from ._templates import Templates
from .upstream import UpstreamServer, render_upstream, upstream_name, upstream_path

__all__ = [
    "STATUS",
    "Templates",
    "UnsafeValueError",
    "UpstreamServer",
    "refused",
    "render",
    "render_for_test",
    "render_upstream",
    "unsupported",
    "upstream_name",
    "upstream_options",
    "upstream_path",
]

CONF = "nginx.conf"
STATUS = "_status"  # key of the status server in `ports` (no listener name starts with "_")
NJS = "njs/confgen.js"


def _placeholder_secrets(topo: Topology) -> dict[str, str]:
    keys = topo.auth.api_keys if topo.auth else []
    return {k.client: f"placeholder-key-{k.client}" for k in keys}


def _checked_secrets(topo: Topology, secrets: Mapping[str, str] | None) -> dict[str, str]:
    keys = dict(secrets) if secrets is not None else _placeholder_secrets(topo)
    problems = []
    for index, api_key in enumerate(topo.auth.api_keys if topo.auth else []):
        where = f"auth.api_keys[{index}]"
        if api_key.client not in keys:
            problems.append((where, f"no API key given for {api_key.client!r}"))
        elif not BEARER_TOKEN.fullmatch(keys[api_key.client]):
            problems.append((where, f"the key for {api_key.client!r} must be made of Bearer-token characters "
                             "(letters, digits and - . _ ~ + / then optional =)"))
    if problems:
        raise SecretError(problems)
    return keys


def _render(
    topo: Topology,
    *,
    config_dir: str,
    secrets: Mapping[str, str] | None,
    test_prefix: str | None = None,
    ports: Mapping[str, int] | None = None,
) -> dict[str, bytes]:
    config_dir = str(PurePosixPath(config_dir))
    keys = _checked_secrets(topo, secrets)
    ctx = build_context(topo, config_dir=config_dir, secrets=keys, test_prefix=test_prefix, ports=ports)
    templates = Templates()
    files: dict[str, bytes] = {
        CONF: templates.render("nginx/nginx.conf.j2", ctx.main).encode(),
        NJS: templates.render("nginx/confgen.js.j2", ctx.main).encode(),
    }
    for pool, servers, options in ctx.upstreams:
        files[upstream_path(pool)] = render_upstream(pool, servers, templates=templates, **options)
    ngx = templates.filters["ngx"]
    for rel, entries in ctx.maps.items():
        lines = [f'"{key_pattern(ngx(key))}" {ngx(value)};' for key, value in entries]
        files[rel] = ("\n".join(lines) + "\n").encode()
    return files


def key_pattern(key: str) -> str:
    """The map entry matching `Authorization: Bearer <key>`: a case-sensitive regex (nginx folds a map's
    string keys to lower case: a key matched whatever its letters' case, about a bit of strength lost a
    letter, and two keys differing only in case stopped nginx starting; a hashed key of some lengths also
    overflowed map_hash_bucket_size). The scheme is case-insensitive, as HTTP's are. A key's characters
    (secrets.BEARER_TOKEN) need no escape but `.` and `+`, written as classes (no backslash in the file)."""
    body = "".join(f"[{c}]" if c in ".+" else c for c in key)
    return f"~^[Bb][Ee][Aa][Rr][Ee][Rr] +{body}$"


def render(topo: Topology, *, config_dir: str, secrets: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """Every file of the nginx output, keyed by path relative to the output directory.

    `secrets` maps API-key clients to their keys; without it placeholders are written
    (fine for validation, useless for serving).
    """
    return _render(topo, config_dir=config_dir, secrets=secrets)


def render_for_test(
    topo: Topology,
    *,
    prefix: str,
    ports: Mapping[str, int] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> dict[str, bytes]:
    """The output made harmless to run under `prefix` (which is also the config dir).

    Every listener and the status server listen on 127.0.0.1, on `ports[<listener name>]`
    / `ports[STATUS]`; one not given keeps the topology's own port (the listener's, the
    admin port for the status server), which is fine for `nginx -t` (it binds nothing) but
    not for running nginx: pick free ones with `confgen.verify.loopback_ports`. pid and temp
    paths sit under `prefix`; DNS-named workers become `down` loopback entries, so `nginx -t`
    resolves nothing. Rendering binds no socket.
    """
    chosen = {lst.name: lst.port for lst in topo.listeners} | {STATUS: admin_tcp(topo)[1]}
    chosen.update(ports or {})
    return _render(topo, config_dir=prefix, secrets=secrets, test_prefix=prefix, ports=chosen)
