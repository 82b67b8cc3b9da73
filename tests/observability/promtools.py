"""Debian's Prometheus tools (package `prometheus`), found on PATH; never skipped when absent."""

from __future__ import annotations

import shutil
import subprocess

HINT = "install Debian's prometheus package (apt-get install -y prometheus; `make test` does it as root)"


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is missing: {HINT}"
    return path


def promtool_parses(body: bytes) -> tuple[bool, str]:
    """Whether `promtool check metrics` parses the exposition `body` to its end (exit 0, or 3: lint
    remarks only, which Envoy's names draw: no _total suffix, no help text); and what it said."""
    done = subprocess.run([tool("promtool"), "check", "metrics"], input=body, capture_output=True, timeout=60)
    err = done.stderr.decode(errors="replace")
    return done.returncode in (0, 3) and "error while linting" not in err, f"exit {done.returncode}: {err[-500:]}"
