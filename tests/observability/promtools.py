"""Debian's Prometheus tools (package `prometheus`), found on PATH; never skipped when absent."""

from __future__ import annotations

import shutil

HINT = "install Debian's prometheus package (apt-get install -y prometheus; `make test` does it as root)"


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is missing: {HINT}"
    return path
