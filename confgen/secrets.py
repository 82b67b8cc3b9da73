"""Read API keys named by the topology (environment variables or files) at render time.

The topology holds only where a key is; the key itself reaches the rendered Envoy config
(api_key_auth takes inline credentials), which is why the Envoy output is written 0600
when auth is configured.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from .errors import SecretError
from .model import Topology

# RFC 6750 b64token: what a client can send as `Authorization: Bearer <key>`.
BEARER_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")


def resolve(topo: Topology, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """client -> key; SecretError names every key that could not be read."""
    env = os.environ if environ is None else environ
    keys: dict[str, str] = {}
    problems: list[tuple[str, str]] = []  # (field path, reason)
    for index, key in enumerate(topo.auth.api_keys if topo.auth else []):
        where = f"auth.api_keys[{index}]"
        if key.env is not None:
            value = env.get(key.env, "")
            if not value:
                problems.append((f"{where}.env", f"environment variable {key.env} is not set or empty"))
                continue
        else:
            assert key.file is not None
            try:
                value = Path(key.file).read_text().strip()
            except OSError as exc:
                problems.append((f"{where}.file", f"cannot read {key.file}: {exc.strerror}"))
                continue
        if not BEARER_TOKEN.fullmatch(value) or len(value) > 512:
            problems.append((
                where,
                f"the key for {key.client!r} must be a bearer token: letters, digits and - . _ ~ + / "
                "with optional trailing '=' (at most 512 characters)",
            ))
            continue
        keys[key.client] = value
    if problems:
        raise SecretError(problems)
    return keys
