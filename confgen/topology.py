"""Load a topology file: bytes -> nodes -> typed model -> cross-field checks.

`load` raises TopologyError with every error found (warnings ride along); `parse` returns
the model and the warnings.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from . import _checks, _yaml
from ._decode import MAX_ERRORS, Decoder, _Invalid
from .errors import Diagnostic, Severity, TopologyError
from .model import Topology


def parse(text: bytes, filename: str = "<topology>") -> tuple[Topology, list[Diagnostic]]:
    """The model for `text` and its warnings; TopologyError lists every error."""
    node, diagnostics = _yaml.compose(text, filename)
    if node is None:
        raise TopologyError(diagnostics)
    decoder = Decoder(filename)
    topo = decoder.decode_root(node, Topology)
    if isinstance(topo, _Invalid) or decoder.dropped:
        raise TopologyError(decoder.diagnostics)
    assert isinstance(topo, Topology)
    # Only leaves failed (unknown keys, bad scalars now holding defaults): the checks still
    # judge everything else, and say nothing about the fields already reported.
    found = list(decoder.diagnostics)
    sections = frozenset(path for path in decoder.marks if path and "." not in path and "[" not in path)
    for path, message, severity in _checks.check(topo, sections):
        if decoder.defaulted and any(_near(path, leaf) for leaf in decoder.defaulted):
            continue  # it may be judging a default that stands in for a reported value
        if len(found) >= MAX_ERRORS:  # 150,000 duplicate workers printed as many lines (23 s)
            mark = _nearest_mark(decoder.marks, path)
            found.append(Diagnostic(filename, mark.line, mark.col, "",
                                    f"stopped after {MAX_ERRORS} findings; fix these first", Severity(severity)))
            break
        mark = _nearest_mark(decoder.marks, path)
        found.append(Diagnostic(filename, mark.line, mark.col, path, message, Severity(severity)))
    if any(d.severity is Severity.ERROR for d in found):
        raise TopologyError(found)
    return topo, sorted(found)


def _near(path: str, leaf: str) -> bool:
    """Whether `path` lies in the object that holds `leaf` (or is it, or contains it)."""
    cut = max(leaf.rfind("."), leaf.rfind("["))
    parent = leaf[:cut] if cut > 0 else ""
    return not parent or path == parent or path.startswith((parent + ".", parent + "[")) or leaf.startswith(path)


def load(path: str | Path) -> tuple[Topology, list[Diagnostic]]:
    """Read and parse a topology file, never more than `_yaml.MAX_BYTES` of it: a larger one is refused
    unread (its size), and a pipe or a device, whose size says nothing (/dev/zero), is read only that far."""
    return parse(read(path), str(path))


def read(path: str | Path) -> bytes:
    """A topology file's bytes, read once (a pipe gives them once), at most `_yaml.MAX_BYTES`; TopologyError
    when it cannot be read or is larger."""
    file = Path(path)
    name = str(path)

    def too_large(what: str) -> TopologyError:
        return TopologyError([Diagnostic(name, 1, 1, "", f"{what}; a topology may be at most "
                                         f"{_yaml.MAX_BYTES // (1024 * 1024)} MiB")])

    try:
        size = file.stat().st_size
        if size > _yaml.MAX_BYTES:
            raise too_large(f"file is {size / (1024 * 1024):.1f} MiB")
        with file.open("rb") as fh:
            text = fh.read(_yaml.MAX_BYTES + 1)
    except OSError as exc:
        raise TopologyError([Diagnostic(name, 0, 0, "", f"cannot read: {exc.strerror}")]) from exc
    if len(text) > _yaml.MAX_BYTES:
        raise too_large(f"more than {_yaml.MAX_BYTES // (1024 * 1024)} MiB read")
    return text


def _nearest_mark(marks: dict[str, _yaml.Mark], path: str) -> _yaml.Mark:
    probe = path
    while probe:
        if probe in marks:
            return marks[probe]
        cut = max(probe.rfind("."), probe.rfind("["))
        probe = probe[:cut] if cut > 0 else ""
    return marks.get("", _yaml.Mark(1, 1))


def pin(
    path: str | Path, findings: Iterable[tuple[str, str]], severity: Severity = Severity.WARNING,
    text: bytes | None = None,
) -> list[Diagnostic]:
    """Diagnostics for (field path, message) pairs about the topology in `path` (its bytes `text` when
    already read: a pipe gives them once), each placed at the field's line and column (findings a renderer
    makes after loading)."""
    name = str(path)
    node, _ = _yaml.compose(read(path) if text is None else text, name)
    decoder = Decoder(name)
    if node is not None:
        decoder.decode_root(node, Topology)
    out = []
    for field_path, message in findings:
        mark = _nearest_mark(decoder.marks, field_path)
        out.append(Diagnostic(name, mark.line, mark.col, field_path, message, severity))
    return out
