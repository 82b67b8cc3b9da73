"""One exception hierarchy for everything confgen raises on purpose.

Every problem found in a topology is a `Diagnostic` carrying the file, line, column and the
field's path, so the CLI can print ``file:line:col: path: message`` and an editor can jump
to it. Loading collects every diagnostic it can before raising, like a compiler.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True, order=True)
class Diagnostic:
    """One finding about a topology file, pinned to a place in it."""

    file: str
    line: int  # 1-based; 0 when the finding has no single place
    col: int  # 1-based
    path: str  # e.g. "pools[0].workers[2].address"; "" for the document itself
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}"
        label = "" if self.severity == "error" else "warning: "
        path = self.path or "<document>"
        return f"{where}: {path}: {label}{self.message}"


class ConfgenError(Exception):
    """Base class of every error confgen raises on purpose."""


class TopologyError(ConfgenError):
    """The topology file is not valid; `diagnostics` lists every problem found."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics: tuple[Diagnostic, ...] = tuple(sorted(diagnostics))
        errors = [d for d in self.diagnostics if d.severity == "error"]
        first = str(errors[0]) if errors else "invalid topology"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(first + more)


class SecretError(ConfgenError):
    """API keys referenced by the topology could not be read at render time.

    `problems` holds (field path, reason) pairs, so the CLI can pin each to its line.
    """

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)
        super().__init__("cannot read API keys: " + "; ".join(f"{p}: {m}" for p, m in self.problems))


class DeployError(ConfgenError):
    """The topology cannot be expressed as the deployment target's objects (e.g. two objects
    would get the same name). `problems` holds (field path, reason) pairs, like SecretError."""

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)
        super().__init__("cannot render the deployment: " + "; ".join(f"{p}: {m}" for p, m in self.problems))


class OutputError(ConfgenError):
    """The rendered files could not be written, or differ from the checked directory."""


class VerifyError(ConfgenError):
    """A real proxy binary rejected the rendered configuration, or could not be run."""
