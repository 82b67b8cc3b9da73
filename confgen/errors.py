"""One exception hierarchy for everything confgen (and its sidecar) raises on purpose.

    ConfgenError
    ├── TopologyError        the topology is invalid; `diagnostics` lists every problem
    ├── SecretError          API keys could not be read at render time
    ├── OutputError          rendered files could not be written, or drifted
    ├── UnsafeValueError     a value would change the structure of a rendered file (also a ValueError)
    ├── ProxyError           a real proxy binary could not be found, started or checked
    │   ├── BinaryNotFoundError
    │   ├── ProxyStartError
    │   └── VerifyError      `validate --envoy/--nginx` could not run its check
    ├── SpecError            a simulated fleet's spec is invalid (confgen.simulate; also a ValueError)
    ├── sidecar.config.ConfigError   the sidecar's flags or settings (also a ValueError)
    └── sidecar.outputs.ratelimit.store.StoreUnavailable   the rate limit store did not answer in time

Errors from outside (OSError, subprocess.TimeoutExpired, ...) are translated into one of
these at the module that meets them, so callers catch `ConfgenError` and nothing broader.

Every problem found in a topology is a `Diagnostic` carrying the file, line, column and the
field's path, so the CLI can print ``file:line:col: path: message`` and an editor can jump
to it. Loading collects every diagnostic it can before raising, like a compiler.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Severity(StrEnum):
    """How bad a finding is. A str, so it prints and serialises as "error" / "warning"."""

    ERROR = "error"
    WARNING = "warning"
    NOTE = "note"  # an explanation (what a default chose and why); never fails validate, even --strict


@dataclass(frozen=True, order=True)
class Diagnostic:
    """One finding about a topology file, pinned to a place in it."""

    file: str
    line: int  # 1-based; 0 when the finding has no single place
    col: int  # 1-based
    path: str  # e.g. "pools[0].workers[2].address"; "" for the document itself
    message: str
    severity: Severity = Severity.ERROR

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}"
        label = "" if self.severity is Severity.ERROR else f"{self.severity}: "
        path = self.path or "<document>"
        return f"{where}: {path}: {label}{self.message}"


class ConfgenError(Exception):
    """Base class of every error confgen raises on purpose."""


class TopologyError(ConfgenError):
    """The topology file is not valid; `diagnostics` lists every problem found."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics: tuple[Diagnostic, ...] = tuple(sorted(diagnostics))
        errors = [d for d in self.diagnostics if d.severity is Severity.ERROR]
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


class UnsafeValueError(ConfgenError, ValueError):
    """A value would change the structure of a rendered file if written into it (a renderer's last guard)."""


class ProxyError(ConfgenError):
    """A real proxy binary (envoy, nginx) could not be found, started or asked."""


class BinaryNotFoundError(ProxyError):
    """The envoy or nginx binary could not be found."""


class ProxyStartError(ProxyError):
    """A proxy process exited or did not become ready; the message holds its log tail."""


class VerifyError(ProxyError):
    """A real proxy's check of the rendered configuration could not run (binary missing, hung, crashed).

    A check that ran and refused the configuration is not an error: `verify` returns its findings.
    """


class SpecError(ConfgenError, ValueError):
    """A simulated fleet's spec (`confgen simulate`, `confgen demo`) is invalid."""
