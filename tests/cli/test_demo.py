"""`confgen demo` (what `make demo` runs): the whole path with the real Envoy and the real
sidecar process, and a table a person can follow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CONFGEN = str(Path(sys.executable).parent / "confgen")


@pytest.mark.slow
def test_demo_runs_the_product_and_keeps_what_it_made(tmp_path: Path) -> None:
    """The demo renders, validates with the real Envoy, serves through Envoy with confgen-sidecar
    deciding health and weight; a slowed worker loses its traffic and weight, a crashed one is marked unhealthy,
    no request fails, and --keep leaves the topology, the config and the sidecar's log."""
    keep = tmp_path / "kept"
    done = subprocess.run([CONFGEN, "demo", "--keep", str(keep), "--requests", "400"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "the real Envoy accepts it" in out
    tables = [block for block in out.split("-- phase ")[1:]]
    assert len(tables) == 3

    def row(block: str, worker: str) -> list[str]:
        return next(line.split() for line in block.splitlines() if line.strip().startswith(worker + " "))

    steady, slowed, crashed = tables
    # the slowed worker is routed around: the picker sends it under a third of what the healthy fast
    # worker gets while it is slow, and its weight (what least_request uses when the picker is away)
    # falls below the fast worker's once it generated enough tokens to be measured at its new speed:
    # when the picker sent it next to nothing the weight keeps its last estimate (an idle worker's)
    def served(block: str, worker: str) -> int:
        return int(row(block, worker)[-1])

    fast, slow = (served(slowed, w) - served(steady, w) for w in ("a100-0", "a100-1"))
    assert slow * 3 < fast, (steady, slowed)
    weights = int(row(slowed, "a100-1")[3]), int(row(slowed, "a100-0")[3])
    assert weights[0] < weights[1] or slow * 10 < fast, (steady, slowed)
    assert row(crashed, "a100-0")[2] == "unhealthy", crashed
    assert "none failed" in out, out
    assert (keep / "topology.yaml").is_file() and (keep / "sidecar.log").stat().st_size > 0
    eds = json.loads((keep / "envoy" / "eds" / "chat" / "endpoints.json").read_text())
    assert "UNHEALTHY" in json.dumps(eds)  # what the sidecar last published is what is kept
    assert int(row(steady, "a100-0")[-1]) > 0


@pytest.mark.slow
def test_the_prefix_demo_sends_follow_up_turns_home_beside_least_request(tmp_path: Path) -> None:
    """`confgen demo --prefix`: the same growing conversations from plain clients through the picker and
    through least_request; the table shows each worker's requests and prefix-cache hits for both, at least
    70 % of the picker's follow-up turns go to their conversation's first worker (least_request's share is
    shown beside it and is lower), none fails, and it ends within a minute."""
    import re
    import time

    started = time.monotonic()
    done = subprocess.run([CONFGEN, "demo", "--prefix", "--keep", str(tmp_path / "kept")], capture_output=True,
                          text=True, timeout=120, check=False)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    found = re.search(r"prefix_affinity (\d+)% \((\d+)/(\d+)\), least_request (\d+)% \((\d+)/(\d+)\)", out)
    assert found is not None, out
    picker, home, followups, lr = (int(found[1]), int(found[2]), int(found[3]), int(found[4]))
    assert followups == 16 * 7 and home / followups >= 0.7 and picker >= 70, out
    assert lr < picker, out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("gpu-")]
    assert len(rows) == 3 and all(len(r) == 7 for r in rows), out  # worker, then served + hits for each setup
    assert sum(int(r[1]) for r in rows) == 16 * 8 and sum(int(r[4]) for r in rows) == 16 * 8
    assert "none failed" in out and elapsed < 60, (elapsed, out)
    assert (tmp_path / "kept" / "prefix_affinity" / "sidecar.log").stat().st_size > 0
