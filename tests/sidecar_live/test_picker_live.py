"""The endpoint picker live: simulated fleet + rendered Envoy (prefix_affinity) + the sidecar.

Plain chat clients (no session header) resend growing conversations; the picker must send
each turn back to the worker holding its prefix (the simulator reports its prefix-cache
hits), spill when that worker's queue grows, and never cost a request when it dies or
comes back (Envoy's failure_mode_allow: least_request picks meanwhile).
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from confgen import envoy, parse_topology
from confgen.output import write_tree
from confgen.runtime import EnvoyProcess, free_port
from confgen.simulate import FleetSpec, WorkerSpec, fleet_topology, run_fleet_in_thread
from tests.sidecar_live.rig import FAST_ARGS, Rig, SidecarProcess, poll, worker_specs

pytestmark = pytest.mark.timeout(240)


@contextlib.contextmanager
def picker_rig(tmp: Path, workers: Sequence[WorkerSpec], *, capacity: int = 8,
               extra_args: Sequence[str] = ()) -> Iterator[Rig]:
    with run_fleet_in_thread(FleetSpec(workers=tuple(workers), seed=5)) as fleet:
        port, admin, listen, grpc_port = free_port(), free_port(), free_port(), free_port()
        text = fleet_topology(
            name="live", admin=admin, port=port, workers=[f"127.0.0.1:{w.port}" for w in fleet.workers],
            models=["sim-model"], capacity=capacity,
            pool=["balancing: {policy: prefix_affinity}", "health: {enabled: false}",
                  "outlier_detection: {enabled: false}"],
            tail=[f"sidecar: {{grpc_port: {grpc_port}}}"])
        topo_path = tmp / "topology.yaml"
        topo_path.write_text(text)
        xds = tmp / "envoy"
        topo, _ = parse_topology(text.encode())
        write_tree(envoy.render(topo, config_dir=str(xds)), xds, rank=envoy.layout.write_rank)
        args = ["--topology", str(topo_path), "--xds-dir", str(xds), "--listen", f"127.0.0.1:{listen}",
                *FAST_ARGS, *extra_args]
        sidecar = SidecarProcess(args, tmp / "sidecar.log", listen)
        with EnvoyProcess(xds / "bootstrap.json") as proxy:
            sidecar.start()
            try:
                sidecar.wait_ready()
                rig = Rig(fleet, proxy, sidecar, topo_path, xds, port, admin, extra={"grpc_port": grpc_port})
                assert poll(lambda: _picker_ready(rig), timeout=30), sidecar.log_tail()
                yield rig
            finally:
                code = sidecar.stop()
            assert code == 0, f"sidecar exited {code} on SIGTERM:\n{sidecar.log_tail()}"


def _picker_ready(rig: Rig) -> bool:
    """The picker has the fleet view: a request gets picked (counted by reason)."""
    status, _ = chat(rig, [{"role": "user", "content": "warm up"}])
    return status == 200 and picks(rig.sidecar) > 0


def picks(sidecar: SidecarProcess, reason: str | None = None) -> float:
    total = 0.0
    for line in sidecar.metrics().splitlines():
        if line.startswith("confgen_picker_picks_total{") and (reason is None or f'reason="{reason}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def chat(rig: Rig, messages: list[dict[str, str]], *, max_tokens: int = 4, headers: dict[str, str] | None = None,
         timeout: float = 30.0) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "sim-model", "messages": messages, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{rig.port}/v1/chat/completions", data=body, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("x-sim-worker", "-")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("x-sim-worker", "-")
    except OSError:
        return 0, "-"


def conversation_system(i: int) -> str:
    return f"You are assistant number {i}. " + f"Conversation {i} has a long shared context. " * 8


def prefix_hits(rig: Rig) -> tuple[int, int]:
    lookups = hits = 0
    for w in rig.fleet.workers:
        pc = w.stats()["prefix_cache"]
        lookups += pc["lookups"]
        hits += pc["hits"]
    return hits, lookups


def test_growing_conversations_go_back_to_the_worker_holding_their_prefix(tmp_path: Path) -> None:
    with picker_rig(tmp_path, worker_specs(["a", "b", "c", "d"])) as rig:
        before_hits, before_lookups = prefix_hits(rig)
        conversations = 12
        turns = 5
        homes: dict[int, Counter[str]] = {i: Counter() for i in range(conversations)}
        failures = 0

        def talk(i: int) -> None:
            nonlocal failures
            messages = [{"role": "system", "content": conversation_system(i)}]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"turn {turn} of conversation {i}: tell me more"})
                status, worker = chat(rig, messages)
                if status != 200:
                    failures += 1
                homes[i][worker] += 1
                messages.append({"role": "assistant", "content": f"answer {turn}"})

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(talk, range(conversations)))
        hits, lookups = prefix_hits(rig)
        hits, lookups = hits - before_hits, lookups - before_lookups
        assert failures == 0
        # Each conversation's first turn misses; every later turn should hit.
        ratio = hits / lookups
        assert ratio >= 0.7, (ratio, homes)
        spread = Counter(w for c in homes.values() for w in c)
        assert len(spread) == 4, spread  # conversations spread over every worker, not piled on one
        sticky = sum(c.most_common(1)[0][1] for c in homes.values()) / (conversations * turns)
        assert sticky >= 0.8, homes


def test_client_sent_destination_header_is_ignored(tmp_path: Path) -> None:
    with picker_rig(tmp_path, worker_specs(["a", "b"])) as rig:
        messages = [{"role": "system", "content": conversation_system(100)}, {"role": "user", "content": "same"}]
        status, home = chat(rig, messages)
        assert status == 200
        other = "b" if home == "a" else "a"
        forged = f"127.0.0.1:{rig.fleet.worker(other).port}"
        seen: Counter[str] = Counter()
        for _ in range(10):
            status, worker = chat(rig, messages, headers={"x-gateway-destination-endpoint": forged})
            assert status == 200
            seen[worker] += 1
        # The client named the other worker every time; the picker kept the prompt at home.
        assert seen == Counter({home: 10}), seen
        headers = {k.lower(): v for k, v in rig.fleet.worker(home).stats()["last_headers"].items()}
        assert headers["x-gateway-destination-endpoint"].split(",")[0] == f"127.0.0.1:{rig.fleet.worker(home).port}"
