"""The rendered Envoy liveness probe, run as the kubelet runs it (the exec command as written)
against the real Envoy: it passes on a live Envoy and fails within its timeout on a hung one
(SIGSTOP: the kernel still accepts the connection, so a TCP probe would pass)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from confgen import parse_topology
from confgen.deploy import render_kubernetes
from confgen.runtime import free_port
from confgen.simulate import fleet_topology
from tests.support.envoy import running_envoy, wait_until


def _probe(text: str) -> dict[str, object]:
    topo, _ = parse_topology(text.encode(), "topology.yaml")
    for doc in yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]):
        if doc and doc["kind"] == "Deployment":
            envoy = next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "envoy")
            probe: dict[str, object] = envoy["livenessProbe"]
            return probe
    raise AssertionError("no Deployment")


def _run(probe: dict[str, object]) -> tuple[int, float]:
    command = probe["exec"]["command"]  # type: ignore[index]
    started = time.monotonic()
    # the kubelet's own bound on an exec probe is timeoutSeconds; allow it and a margin
    done = subprocess.run(command, capture_output=True, timeout=float(probe["timeoutSeconds"]) + 10,  # type: ignore[arg-type]
                          check=False)
    return done.returncode, time.monotonic() - started


def test_envoy_liveness_passes_when_live_and_fails_when_hung(tmp_path: Path) -> None:
    """The probe's exec command exits 0 against the running Envoy, non-zero within
    timeoutSeconds while Envoy is stopped (SIGSTOP), and 0 again once it runs (SIGCONT)."""
    text = fleet_topology(name="probe", admin=free_port(), port=free_port(), workers=["127.0.0.1:9"],
                          models=["m"], capacity=4)
    probe = _probe(text)
    assert probe["exec"]["command"][:2] == ["/bin/bash", "-c"]  # type: ignore[index]
    with running_envoy(text, tmp_path / "out") as envoy:
        assert _run(probe)[0] == 0
        os.kill(envoy.pid, signal.SIGSTOP)
        try:
            code, took = _run(probe)
            assert code != 0
            assert took < float(probe["timeoutSeconds"])  # type: ignore[arg-type]
        finally:
            os.kill(envoy.pid, signal.SIGCONT)
        assert wait_until(lambda: _run(probe)[0] == 0, timeout=30)
