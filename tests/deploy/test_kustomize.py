"""Every kustomization `confgen render --target kubernetes` writes is built by the real `kubectl kustomize`,
and docs/kubernetes.md's commands run as written (with `kubectl apply -k` as its build step: no cluster here).

kubectl (with its built-in kustomize v5) is part of the test machine's image; without it these tests fail
with the reason, they are never skipped.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from confgen import load_topology, parse_topology
from confgen.deploy import render_kubernetes
from confgen.model import Topology

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted([*(ROOT / "examples").glob("*.yaml"), *(ROOT / "tests/golden/inputs").glob("*.yaml")])
CORE_KINDS = {"ConfigMap", "Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
              "NetworkPolicy"}
ADS = """\
version: 1
name: fleet
listeners: [{name: public, port: 8080}]
kubernetes: {namespace: inference, replicas: 3, envoy_max_replicas: 12, monitoring: true}
envoy:
  xds:
    mode: ads
    servers: [confgen-fleet-xds-0.confgen-fleet-xds.inference.svc:18000]
    tls: {cert: /etc/envoy/xds-tls/tls.crt, key: /etc/envoy/xds-tls/tls.key, ca: /etc/envoy/xds-ca/ca.crt}
pools:
  - name: chat
    engine: vllm
    models: [m]
    autoscale: {target: statefulset/vllm, min_replicas: 2, max_replicas: 8}
    workers: ["vllm.inference.svc.cluster.local:8000"]
"""


def kubectl() -> str:
    """The real kubectl, or a failure that says what is missing."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is not on PATH: the suite builds every rendered kustomization with the real "
                    "`kubectl kustomize` (kubectl >= 1.27, kustomize v5); install kubectl on this machine")
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize <directory>`'s objects; the test fails with kustomize's own message when it refuses."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d is not None]


def write(files: dict[str, bytes], out: Path) -> None:
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)


def monitored(topo: Topology) -> Topology:
    return dataclasses.replace(topo, kubernetes=dataclasses.replace(topo.kubernetes, monitoring=True))


def ids(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def topologies() -> list[tuple[str, Topology]]:
    out = []
    for path in EXAMPLES:
        topo, _ = load_topology(path)
        out += [(path.stem, topo), (f"{path.stem}-monitoring", monitored(topo))]
    ads, _ = parse_topology(ADS.encode(), "ads.yaml")
    return [*out, ("ads-autoscaled", ads)]


CASES = topologies()


@pytest.mark.parametrize(("name", "topo"), CASES, ids=[name for name, _ in CASES])
def test_every_rendered_kustomization_builds_with_kubectl(name: str, topo: Topology, tmp_path: Path) -> None:
    """`kubectl kustomize` builds the base and, where pools autoscale, the KEDA overlay (it refused the old
    overlay: "cycle detected: candidate root ... contains visited root .../keda"); the base builds to exactly
    kubernetes.yaml's objects, the overlay to the same without the pools' HPAs plus one ScaledObject per pool,
    and each core object of the overlay is strict-valid for Kubernetes 1.30."""
    files = render_kubernetes(topo)
    write(files, tmp_path)
    kustomizations = sorted(rel for rel in files if rel.endswith("kustomization.yaml"))
    assert "kustomization.yaml" in kustomizations
    rendered = [d for d in yaml.safe_load_all(files["kubernetes.yaml"]) if d is not None]
    assert ids(kustomize(tmp_path)) == ids(rendered)
    pool_hpas = {(d["kind"], d["metadata"]["name"]) for d in rendered
                 if d["kind"] == "HorizontalPodAutoscaler" and "confgen.dev/pool" in d["metadata"]["labels"]}
    if not pool_hpas:
        assert kustomizations == ["kustomization.yaml"]
        return
    assert kustomizations == ["keda/kustomization.yaml", "kustomization.yaml"]
    keda = kustomize(tmp_path / "keda")
    scaled = {("ScaledObject", d["metadata"]["name"]) for d in keda if d["kind"] == "ScaledObject"}
    assert len(scaled) == len(pool_hpas)
    assert ids(keda) == (ids(rendered) - pool_hpas) | scaled
    for doc in keda:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)


def doc_commands() -> list[str]:
    """The shell lines of docs/kubernetes.md's ```sh blocks, comments and continuation comments dropped."""
    text = (ROOT / "docs/kubernetes.md").read_text()
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


def test_the_kubernetes_docs_commands_run_as_written(tmp_path: Path) -> None:
    """docs/kubernetes.md's commands, in order, in a directory holding a topology as `topo.yaml` (example 05:
    autoscaling, so the KEDA overlay exists): `confgen render` exactly as written; `kubectl apply -k DIR` as
    `kubectl kustomize DIR`, the build `apply -k` runs before it talks to a cluster (none here); `docker`
    lines are the only ones not run (no Docker daemon on the test machine), and they are named here so a new
    command in the docs cannot pass unrun."""
    shutil.copy(ROOT / "examples/05-dns-rate-limits.yaml", tmp_path / "topo.yaml")
    # the gateway-api section's topology (a prefix_affinity pool with pod labels, a named Gateway)
    shutil.copy(ROOT / "tests/golden/inputs/gateway-api.yaml", tmp_path / "gie.yaml")
    commands = doc_commands()
    not_run = [c for c in commands if c.startswith("docker ")]
    assert not_run == ["docker build -f sidecar/Dockerfile -t registry.example.com/confgen:0.1.0 .",
                       "docker push registry.example.com/confgen:0.1.0"]
    assert (ROOT / "sidecar/Dockerfile").is_file()  # what the docker line builds from
    ran = []
    for command in commands:
        if command in not_run:
            continue
        argv = shlex.split(command)
        if argv[:3] == ["kubectl", "apply", "-k"] and len(argv) == 4:
            assert kustomize(tmp_path / argv[3]), command
        elif argv[0] == "confgen":
            done = subprocess.run([sys.executable, "-m", "confgen", *argv[1:]], cwd=tmp_path, capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, f"{command}: {done.stderr}"
        else:
            pytest.fail(f"docs/kubernetes.md runs {command!r}, which this test does not know how to run")
        ran.append(argv[:3])
    assert ran.count(["kubectl", "apply", "-k"]) == 3 and ["confgen", "render", "topo.yaml"] in ran
