"""Read a YAML document into a node tree that keeps line and column, refusing hazards.

Only the composer runs: no Python objects are constructed, so no tag can execute code,
and aliases stay references (an alias bomb costs nothing here; the decoder counts the
nodes it visits). Sizes are bounded before parsing starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from ._yaml_words import explain
from .errors import Diagnostic

MAX_BYTES = 4 * 1024 * 1024  # a topology of 10,000 workers is ~400 KB
MAX_DEPTH = 64

try:  # libyaml's composer is ~10x faster on large topologies and keeps marks the same
    _Loader: type[yaml.SafeLoader] = yaml.CSafeLoader  # type: ignore[assignment]
except AttributeError:  # pragma: no cover - pyyaml built without libyaml
    _Loader = yaml.SafeLoader


@dataclass(frozen=True)
class Mark:
    line: int  # 1-based
    col: int  # 1-based


def mark_of(node: yaml.Node) -> Mark:
    return Mark(node.start_mark.line + 1, node.start_mark.column + 1)


_HIDDEN = re.compile("[\u0085\u2028\u2029]")


def compose(text: bytes, filename: str) -> tuple[yaml.Node | None, list[Diagnostic]]:
    """Parse one YAML document into nodes; on failure return the diagnostics instead."""
    if len(text) > MAX_BYTES:
        size_mb = len(text) / (1024 * 1024)
        return None, [
            Diagnostic(
                filename, 1, 1, "",
                f"file is {size_mb:.1f} MiB; a topology may be at most "
                f"{MAX_BYTES // (1024 * 1024)} MiB",
            )
        ]
    if b"\x00" in text:
        offset = text.index(b"\x00")
        line = text.count(b"\n", 0, offset) + 1
        col = offset - (text.rfind(b"\n", 0, offset) + 1) + 1
        return None, [Diagnostic(filename, line, col, "", "NUL byte in file")]
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = text.count(b"\n", 0, exc.start) + 1
        return None, [Diagnostic(filename, line, 1, "", f"not UTF-8: {exc.reason}")]
    if hidden := _HIDDEN.search(decoded):
        # YAML 1.1 breaks lines at these; grep, diff viewers and most editors do not: a key after one reads
        # as part of a comment to a reviewer while the loader applies it. Refused, as NUL is.
        offset = hidden.start()
        line = decoded.count("\n", 0, offset) + 1
        col = offset - (decoded.rfind("\n", 0, offset) + 1) + 1
        return None, [Diagnostic(filename, line, col, "", f"character U+{ord(hidden.group()):04X} (a line break to "
                                 "YAML, not to most tools: what follows it could hide in a comment) is not allowed; "
                                 "use a plain newline")]
    try:
        nodes = list(yaml.compose_all(decoded, Loader=_Loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        lines = decoded.splitlines()
        text_line = lines[line - 1] if 0 < line <= len(lines) else ""
        char = text_line[col - 1] if 0 < col <= len(text_line) else ""
        return None, [Diagnostic(filename, line, col, "", explain(exc.problem, exc.context, char))]
    except yaml.YAMLError as exc:
        return None, [Diagnostic(filename, 1, 1, "", f"YAML error: {exc}")]
    except RecursionError:
        return None, [Diagnostic(filename, 1, 1, "", "document is nested too deeply")]
    if not nodes:
        return None, [Diagnostic(filename, 1, 1, "", "the file is empty")]
    if len(nodes) > 1:
        second = mark_of(nodes[1])
        return None, [Diagnostic(filename, second.line, second.col, "", "expected one YAML document, found several")]
    return nodes[0], []
