"""Read API keys named by the topology (environment variables or files) at render time.

The topology holds only where a key is; the key itself reaches the rendered Envoy config
(api_key_auth takes inline credentials), which is why the Envoy output is written 0600
when auth is configured.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from .errors import SecretError
from .model import Topology

# RFC 6750 b64token: what a client can send as `Authorization: Bearer <key>`.
BEARER_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
# A key is at most 512 characters; the file may add whitespace around it, not more.
MAX_KEY_FILE_BYTES = 4096

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _not_regular(mode: int) -> str | None:
    """Why a file of this mode cannot hold a key (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"is {kind}, not a regular file"


def read_key_file(path: str) -> str:
    """The key in `path`, stripped; OSError (with a reason in strerror) when it cannot be one.

    Only a regular file of at most MAX_KEY_FILE_BYTES is read: a device or a FIFO that
    never ends is refused before any read (opened non-blocking, so a FIFO without a writer
    does not hang either), and a larger file is refused after reading one byte past the cap.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        problem = _not_regular(os.fstat(fd).st_mode)
        if problem is not None:
            raise OSError(0, problem)
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_KEY_FILE_BYTES:
            chunk = os.read(fd, MAX_KEY_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_KEY_FILE_BYTES:
            raise OSError(0, f"is larger than {MAX_KEY_FILE_BYTES} bytes; a key file holds one key")
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace").strip()


def check_sources(topo: Topology) -> list[tuple[str, str]]:
    """(field path, reason) for each key `file:` that exists but cannot be a key file.

    Reads nothing (validate runs where the keys are not): only a file that is there and is
    a device, a FIFO, a directory or larger than the cap is reported.
    """
    problems: list[tuple[str, str]] = []
    for index, key in enumerate(topo.auth.api_keys if topo.auth else []):
        if key.file is None:
            continue
        try:
            info = Path(key.file).stat()
        except OSError:
            continue  # not here: render, where the key must be, says so
        reason = _not_regular(info.st_mode)
        if reason is None and info.st_size > MAX_KEY_FILE_BYTES:
            reason = f"is larger than {MAX_KEY_FILE_BYTES} bytes; a key file holds one key"
        if reason is not None:
            problems.append((f"auth.api_keys[{index}].file", f"{key.file} {reason}"))
    return problems


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
                value = read_key_file(key.file)
            except OSError as exc:
                problems.append((f"{where}.file", f"cannot read {key.file}: {exc.strerror or exc}"))
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
