"""Who may call the sidecar's mutating endpoints (POST /drain, /undrain).

Safe by default, with no setting at all:
- No cross-site request reaches them. A request carrying an `Origin` header (every browser
  sends one on a cross-origin POST, and on same-origin ones too; curl and scripts do not)
  is refused with 403. The content type must be `application/json` (415 otherwise) and the
  body, if any, a JSON object: a browser cannot send that cross-site without a CORS
  preflight, which this server never answers. So no "simple request" (form, text/plain)
  can drain a worker.
- They require `Authorization: Bearer <token>` (401 without it, compared in constant time),
  on loopback too: every local user reaches a loopback port, and draining every worker would
  starve the fleet. The token comes from a file (`--admin-token-file`, read with the same
  bound as an API key file) or an environment variable (`--admin-token-env`). Without a
  token the mutating endpoints are off (403, saying how to turn them on); scraping stays open.

GET endpoints (/metrics, /healthz, /readyz, /state, the Envoy relay) are not guarded:
Prometheus and the kubelet reach them without credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from confgen.secrets import BEARER_TOKEN, read_key_file
from sidecar.config import ConfigError
from sidecar.config.tls import is_loopback
from sidecar.logs import log_event

__all__ = ["GUARD", "MutationGuard", "guarded", "is_loopback", "json_depth", "json_object", "load_token"]

_log = logging.getLogger("sidecar.serve.guard")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY = 4096  # a drain call is a pool and a worker name
MAX_JSON_DEPTH = 8  # a drain call is one flat object
BODY_TIMEOUT_S = 5.0


def load_token(file: Path | None, env: str | None) -> str | None:
    """The admin token from a file or an environment variable; ConfigError when unusable."""
    if file is not None and env is not None:
        raise ConfigError("give --admin-token-file or --admin-token-env, not both")
    if file is not None:
        try:
            token = read_key_file(str(file))
        except OSError as exc:
            raise ConfigError(f"--admin-token-file {file}: {exc.strerror or exc}") from exc
        where = f"--admin-token-file {file}"
        with contextlib.suppress(OSError):
            mode = file.stat().st_mode & 0o777
            if mode & 0o077:  # read at startup only: rotating it takes a restart
                log_event(_log, logging.WARNING, "startup.token_file_open", file=str(file), mode=oct(mode),
                          note="the admin token file is readable beyond its owner: chmod 600 it")
    elif env is not None:
        token = os.environ.get(env, "").strip()
        where = f"--admin-token-env {env}"
        if not token:
            raise ConfigError(f"{where}: the variable is not set or empty")
    else:
        return None
    if not BEARER_TOKEN.fullmatch(token) or not 16 <= len(token) <= 512:
        raise ConfigError(f"{where}: the token must be 16-512 characters of letters, digits and - . _ ~ + / "
                          "(a bearer token)")
    return token


@dataclass(frozen=True)
class MutationGuard:
    """The rule for mutating calls: `token`, required (None: they are off); `remote`: bound beyond loopback
    (said in the refusal)."""

    token: str | None
    remote: bool

    def refusal(self, request: web.Request) -> web.Response | None:
        """None when `request` may mutate, else the answer refusing it."""
        if "Origin" in request.headers:
            return _error(403, "cross-origin requests are refused (the request carries an Origin header)")
        if request.content_type != "application/json":
            return _error(415, "send Content-Type: application/json")
        if self.token is None:
            where = "beyond loopback" if self.remote else "on loopback, which every local user reaches,"
            return _error(403, f"mutating endpoints are off: the sidecar listens {where} and no "
                          "--admin-token-file/--admin-token-env is set")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            return _error(401, "a bearer token is required (Authorization: Bearer <token>)",
                          {"WWW-Authenticate": 'Bearer realm="confgen-sidecar"'})
        return None


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


GUARD = web.AppKey("mutation_guard", MutationGuard)


async def json_object(request: web.Request) -> dict[str, object] | web.Response:
    """The request's JSON object body ({} when empty), or the 400/413 answer refusing it."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        return _error(413, f"body over {MAX_BODY} bytes")  # refused before reading a byte of it
    raw = b""
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            while len(raw) <= MAX_BODY:  # chunked: read just past the limit, never the whole body
                chunk = await request.content.read(MAX_BODY + 1 - len(raw))
                if not chunk:
                    break
                raw += chunk
    except TimeoutError:
        return _error(408, f"the body was not sent within {BODY_TIMEOUT_S:g} s")
    if len(raw) > MAX_BODY:
        return _error(413, f"body over {MAX_BODY} bytes")
    if not raw.strip():
        return {}
    if json_depth(raw) > MAX_JSON_DEPTH:
        return _error(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return _error(400, "the body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in `raw` (brackets inside strings do not count); no parsing."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def guarded(handler: _Handler) -> _Handler:
    """`handler` behind the app's MutationGuard."""

    async def wrapper(request: web.Request) -> web.StreamResponse:
        refusal = request.app[GUARD].refusal(request)
        if refusal is not None:
            return refusal
        return await handler(request)

    return wrapper
