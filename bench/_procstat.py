"""What a process we started costs, read from /proc by its pid (Linux): CPU seconds and memory."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> tuple[float, float]:
    """Resident memory now and its high-water mark, in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    values = {ln.split(":")[0]: ln.split()[1] for ln in status.splitlines() if ln.startswith(("VmRSS", "VmHWM"))}
    return int(values["VmRSS"]) / 1024, int(values["VmHWM"]) / 1024
