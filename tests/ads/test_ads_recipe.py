"""docs/ads.md's "Two Envoys on one host" recipe, run as written: the fenced block after the
comment naming this file, one process per line, in order. What is mapped, and only that:
the ports the recipe and its topology name (9901, 9902, 8080, 18000, 9109) and the base ids
(10, 11), to free ones (the suite shares the host); the topology is the one the recipe
describes (admin 127.0.0.1:9901, servers ["127.0.0.1:18000"]) with the simulated fleet."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from confgen.binaries import find_envoy, stop_process
from confgen.runtime import free_port
from confgen.simulate import FleetSpec, run_fleet_in_thread
from tests.sidecar_live.rig import http, poll, worker_specs

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOPOLOGY = """\
version: 1
name: fleet
admin: {{address: 127.0.0.1, port: 9901}}
listeners:
  - {{name: public, address: 127.0.0.1, port: 8080}}
envoy:
  xds: {{mode: ads, servers: ["127.0.0.1:18000"]}}
pools:
  - name: chat
    engine: vllm
    models: [sim-model]
    capacity: 4
    workers:
{workers}
"""


def recipe() -> list[str]:
    text = (ROOT / "docs" / "ads.md").read_text()
    block = re.search(r"<!-- tests/ads/test_ads_recipe\.py[^\n]*-->\n```sh\n(.*?)```", text, re.S)
    assert block, "docs/ads.md lost its tested two-Envoys recipe"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _admin_live(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2) as resp:
            return json.loads(resp.read())["state"] == "LIVE"
    except OSError:
        return False


def test_two_envoys_on_one_host_come_up_per_docs_ads_md(tmp_path: Path) -> None:
    """Each line of the recipe runs; both Envoys come up LIVE on their own admin ports, with
    their own node ids at the control plane, and serve the shared listener; nothing exits."""
    lines = recipe()
    assert len(lines) == 4 and lines[0].startswith("confgen render")
    mapping = {str(p): str(free_port()) for p in (9901, 9902, 8080, 18000, 9109)}
    mapping.update({"--base-id 10": f"--base-id {free_port()}", "--base-id 11": f"--base-id {free_port()}"})

    def mapped(text: str) -> str:
        for old, new in mapping.items():
            text = re.sub(rf"(?<![0-9]){re.escape(old)}(?![0-9])", new, text)
        return text

    started: list[subprocess.Popen[bytes]] = []
    with run_fleet_in_thread(FleetSpec(workers=worker_specs(["a"]), seed=5)) as fleet:
        workers = "\n".join(f"      - 127.0.0.1:{w.port}" for w in fleet.workers)
        (tmp_path / "topology.yaml").write_text(mapped(TOPOLOGY.format(workers=workers)))
        try:
            for i, line in enumerate(lines):
                argv = shlex.split(mapped(line).removesuffix("&").strip())
                program = find_envoy() if argv[0] == "envoy" else shutil.which(argv[0], path=str(BIN))
                assert program is not None, argv[0]
                argv[0] = str(program)
                if line.rstrip().endswith("&"):
                    with (tmp_path / f"{i}.log").open("wb") as log:
                        started.append(subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT))
                else:
                    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                                          check=False)
                    assert done.returncode == 0, done.stderr
            admins = [int(mapping["9901"]), int(mapping["9902"])]
            for port in admins:
                assert poll(lambda p=port: _admin_live(p), timeout=60), [
                    (tmp_path / f"{i}.log").read_text()[-2000:] for i in (2, 3)]
            sidecar = f"http://127.0.0.1:{mapping['9109']}"
            assert poll(lambda: set(json.loads(http("GET", f"{sidecar}/state")[2])["xds"]["nodes"]) ==
                        {"envoy-0", "envoy-1"}, timeout=30)
            url = f"http://127.0.0.1:{mapping['8080']}/v1/completions"
            assert poll(lambda: http("POST", url, {"model": "sim-model", "prompt": "hi", "max_tokens": 2},
                                     timeout=10)[0] == 200, timeout=30)
            assert all(proc.poll() is None for proc in started), [
                (tmp_path / f"{i}.log").read_text()[-2000:] for i in (1, 2, 3)]
        finally:
            for proc in reversed(started):
                stop_process(proc)
