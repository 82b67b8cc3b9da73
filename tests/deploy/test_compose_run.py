"""Containers run as rendered: each Compose service's argv, resolved from the service and its
image as Docker does, is a command line the program accepts, and run for real (render, then
the sidecar and Envoy) it serves a request from a simulated worker.

Images: the confgen image's ENTRYPOINT/CMD are read from sidecar/Dockerfile; the envoy image's
(envoyproxy/envoy) are ENTRYPOINT ["/docker-entrypoint.sh"], CMD ["envoy", "-c",
"/etc/envoy/envoy.yaml"], and that script puts `envoy` before a first argument starting with
'-', then execs the arguments (as user envoy, uid 101).

Without Docker here, the mounts are applied the way a bind mount resolves paths: every argument
under a container path of a volume is mapped to the host directory standing for that volume.
The sidecar's fixed loopback port (9109, host network) is mapped to a free one, as the suite
shares the host with other runs. Nothing else of an argv is changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from confgen import load_topology, parse_topology
from confgen.binaries import find_envoy, stop_process
from confgen.cli import _parser as confgen_parser
from confgen.deploy import render_compose
from confgen.runtime import free_port
from confgen.simulate import FleetSpec, WorkerSpec, fleet_topology, run_fleet_in_thread
from sidecar.config import parser as sidecar_parser
from tests.support.envoy import wait_until

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
ENVOY_IMAGE = (["/docker-entrypoint.sh"], ["envoy", "-c", "/etc/envoy/envoy.yaml"])


def dockerfile_config(path: Path) -> tuple[list[str], list[str]]:
    """ENTRYPOINT and CMD of a Dockerfile (exec form; the last of each wins, as in a build)."""
    found: dict[str, list[str]] = {"ENTRYPOINT": [], "CMD": []}
    for line in path.read_text().splitlines():
        word, _, rest = line.partition(" ")
        if word in found:
            value = json.loads(rest)
            assert isinstance(value, list), f"{word} must use the exec form: {line}"
            found[word] = value
    return found["ENTRYPOINT"], found["CMD"]


def docker_argv(service: dict[str, Any], image: tuple[list[str], list[str]]) -> list[str]:
    """What Docker runs: a service `entrypoint` replaces the image's ENTRYPOINT and drops its
    CMD; a service `command` replaces CMD; the process is ENTRYPOINT + CMD."""
    entrypoint, cmd = image
    if "entrypoint" in service:
        entrypoint, cmd = list(service["entrypoint"]), []
    if "command" in service:
        cmd = list(service["command"])
    return [*entrypoint, *cmd]


def envoy_entrypoint(argv: list[str]) -> list[str]:
    """envoyproxy/envoy's /docker-entrypoint.sh: `envoy` before a first argument starting with '-'."""
    assert argv[0] == "/docker-entrypoint.sh", argv
    args = argv[1:]
    return ["envoy", *args] if args and args[0].startswith("-") else args


def service_argvs(compose: dict[str, Any]) -> dict[str, list[str]]:
    ours = dockerfile_config(ROOT / "sidecar" / "Dockerfile")
    out = {}
    for name, service in compose["services"].items():
        if service["image"].startswith("envoyproxy/"):
            out[name] = envoy_entrypoint(docker_argv(service, ENVOY_IMAGE))
        else:
            out[name] = docker_argv(service, ours)
    return out


def accepted(argv: list[str]) -> bool:
    """Whether the program named by argv[0] accepts the rest (argparse exits 2 otherwise)."""
    parsers = {"confgen": confgen_parser, "confgen-sidecar": sidecar_parser}
    if argv[0] not in parsers:
        return False
    try:
        parsers[argv[0]]().parse_args(argv[1:])
    except SystemExit:
        return False
    return True


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_confgen_service_resolves_to_a_command_line_its_program_accepts(example: Path) -> None:
    """For each example: the render and sidecar services, resolved against sidecar/Dockerfile,
    run `confgen render ...` and `confgen-sidecar ...` with arguments each accepts; Envoy runs
    `envoy -c <the rendered bootstrap>`. The form this replaced (command [confgen, render, ...]
    under ENTRYPOINT confgen-sidecar) is refused by the same check."""
    topo, _ = load_topology(example)
    compose = yaml.safe_load(render_compose(topo)["compose.yaml"])
    argvs = service_argvs(compose)
    assert argvs["render"][:2] == ["confgen", "render"] and accepted(argvs["render"]), argvs["render"]
    assert argvs["sidecar"][0] == "confgen-sidecar" and accepted(argvs["sidecar"]), argvs["sidecar"]
    assert argvs["envoy"][:3] == ["envoy", "-c", "/var/run/confgen/envoy/bootstrap.json"], argvs["envoy"]
    old = {"image": "x", "command": ["confgen", "render", "/etc/confgen/topology.yaml", "-o", "/x"]}
    assert not accepted(docker_argv(old, dockerfile_config(ROOT / "sidecar" / "Dockerfile")))


def test_api_keys_held_in_files_are_mounted_where_render_and_the_sidecar_read_them() -> None:
    """Found by review: example 04 names a key by `file: /run/secrets/batch-jobs-key`, and compose mounted
    only the topology and the xDS volume: the render service failed reading it, so neither the sidecar nor
    Envoy (both waiting for render to complete) ever started. Each key file is bound read-only at its path
    in render and sidecar, and nowhere else (Envoy gets the rendered config, not the key files)."""
    topo, _ = load_topology(ROOT / "examples" / "04-multi-model-fallback.yaml")
    files = sorted({k.file for k in topo.auth.api_keys if k.file is not None}) if topo.auth else []
    assert files, "the example holds a key in a file"
    services = yaml.safe_load(render_compose(topo)["compose.yaml"])["services"]
    for name in ("render", "sidecar"):
        for path in files:
            assert f"{path}:{path}:ro" in services[name]["volumes"], (name, services[name]["volumes"])
    assert not any(path in v for v in services["envoy"]["volumes"] for path in files)


def test_kubernetes_containers_of_the_confgen_image_name_their_program() -> None:
    """Kubernetes: `command` replaces ENTRYPOINT, `args` CMD. Every container of the confgen
    image names confgen or confgen-sidecar and its arguments are accepted."""
    from confgen.deploy import render_kubernetes

    for example in EXAMPLES:
        topo, _ = load_topology(example)
        for doc in yaml.safe_load_all(render_kubernetes(topo)["kubernetes.yaml"]):
            if not doc or doc["kind"] != "Deployment":
                continue
            pod = doc["spec"]["template"]["spec"]
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                if container["image"] != topo.kubernetes.sidecar_image:
                    continue
                argv = [*container["command"], *container.get("args", [])]
                assert accepted(argv), f"{example.stem}: {container['name']}: {argv}"


def _get(url: str, body: dict[str, Any] | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


@pytest.mark.slow
def test_the_compose_services_run_render_then_sidecar_and_envoy_serve(tmp_path: Path) -> None:
    """The three services' argv, run in order with the volumes mapped: render exits 0 and
    fills the shared volume, the sidecar answers /healthz, Envoy serves a completion from
    the simulated worker through the rendered listener."""
    with run_fleet_in_thread(FleetSpec(workers=(WorkerSpec(name="w0", models=("sim-model",)),), seed=1)) as fleet:
        port, admin = free_port(), free_port()
        workers = [url.removeprefix("http://") for url in fleet.urls]
        text = fleet_topology(name="compose", admin=admin, port=port, workers=workers, models=["sim-model"],
                              capacity=4)
        topo, _ = parse_topology(text.encode(), "topology.yaml")
        project = tmp_path / "project"
        project.mkdir()
        for name, data in render_compose(topo).items():
            (project / name).write_bytes(data)
        compose = yaml.safe_load((project / "compose.yaml").read_text())
        volume = tmp_path / "volumes" / "xds"  # a new named volume: an empty directory
        volume.mkdir(parents=True)
        sidecar_port = free_port()
        mounts: dict[str, str] = {}
        for spec in compose["services"]["sidecar"]["volumes"]:
            source, target = spec.split(":")[:2]
            if source.startswith("./"):
                mounts[target] = str(project / source)
            elif source == "xds":
                mounts[target] = str(volume)
            # other named volumes (the gRPC socket directory's parent, /tmp): the host's own, shared by both

        def on_host(argv: list[str]) -> list[str]:
            out = []
            for arg in argv:
                for target, source in sorted(mounts.items(), key=lambda m: -len(m[0])):  # innermost mount wins
                    if arg == target or arg.startswith(target + "/"):
                        arg = source + arg[len(target):]
                        break
                out.append(arg.replace("127.0.0.1:9109", f"127.0.0.1:{sidecar_port}"))
            program = find_envoy() if out[0] == "envoy" else shutil.which(out[0], path=str(BIN))
            assert program is not None, f"{out[0]} is not installed next to the test interpreter"
            return [str(program), *out[1:]]

        argvs = service_argvs(compose)
        work = tmp_path / "work"
        work.mkdir()
        env = {**os.environ}
        render = subprocess.run(on_host(argvs["render"]), cwd=work, capture_output=True, text=True, timeout=120,
                                env=env, check=False)
        assert render.returncode == 0, render.stdout + render.stderr
        assert (volume / "bootstrap.json").is_file()
        logs = tmp_path / "logs"
        logs.mkdir()
        started: list[subprocess.Popen[bytes]] = []
        try:
            for name in ("sidecar", "envoy"):
                with (logs / f"{name}.log").open("wb") as log:
                    started.append(subprocess.Popen(on_host(argvs[name]), cwd=work, stdout=log,
                                                    stderr=subprocess.STDOUT, env=env))
            assert wait_until(lambda: _get(f"http://127.0.0.1:{sidecar_port}/healthz") == 200, timeout=60), \
                (logs / "sidecar.log").read_text()[-3000:]
            completion = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert wait_until(lambda: _get(f"http://127.0.0.1:{port}/v1/chat/completions", completion) == 200,
                              timeout=60), (logs / "envoy.log").read_text()[-3000:]
            assert all(proc.poll() is None for proc in started)
        finally:
            for proc in reversed(started):
                stop_process(proc)
