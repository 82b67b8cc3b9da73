"""The shape of a Prometheus text exposition: its families' names and types, in order."""

from __future__ import annotations

from pathlib import Path

RECORDED_LLAMACPP = Path(__file__).resolve().parents[1] / "sidecar" / "fixtures" / "llamacpp.prom"


def families(text: str) -> list[tuple[str, str]]:
    """(name, type) of every `# TYPE` line, in the order the server printed them."""
    out = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line[len("# TYPE "):].split()
            out.append((name, kind))
    return out
