"""A pool's own admission budgets (`pools[].admission` in the topology) reach the picker that admits its
requests, each unset value taken from the sidecar's `--picker budget_*`, and follow a topology reload.
What the budgets do to a pick: tests/sidecar/test_picker_predict.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry

from confgen import parse_topology
from confgen.errors import Severity
from confgen.model import Topology
from sidecar.config import SidecarConfig
from sidecar.fleet import Snapshot
from sidecar.outputs.contract import Wiring
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.grpc import Servicers
from sidecar.outputs.picker import PickerPolicy, PickerService, admission_budgets
from sidecar.outputs.picker.admission import WaitBudgets

TOPOLOGY = """
version: 1
name: budgets
listeners: [{{name: main, port: 18080}}]
default_pool: chat
pools:
  - name: chat
    engine: vllm
    models: [chat-m]
    workers: ['127.0.0.1:8001']
{chat}
  - name: batch
    engine: vllm
    models: [batch-m]
    workers: ['127.0.0.1:8002']
    admission: {{standard: 2, min_wait: 1500ms}}
  - name: plain
    engine: vllm
    models: [plain-m]
    workers: ['127.0.0.1:8003']
    balancing: {{policy: least_request}}
    admission: {{standard: 3}}
"""


def _topology(chat: str = "") -> Topology:
    topo, diags = parse_topology(TOPOLOGY.format(chat=chat).encode())
    assert not [d for d in diags if d.severity is Severity.ERROR], diags
    return topo


def test_only_the_pickers_pools_that_set_budgets_get_their_own_the_rest_from_the_policy() -> None:
    policy = PickerPolicy().with_overrides(["budget_sheddable=0.07", "budget_floor_s=0.2"])
    got = admission_budgets(_topology(), policy)
    # chat sets nothing (the policy's for it); plain is not the picker's (validate warns)
    assert got == {"batch": WaitBudgets(standard=2.0, sheddable=0.07, floor_s=1.5)}
    assert policy.budgets == WaitBudgets(policy.budget_standard, 0.07, 0.2)


def test_the_service_hands_them_to_its_picker_and_follows_a_reload(tmp_path: Path) -> None:
    async def run() -> None:
        topo = [_topology()]
        config = SidecarConfig(topology=tmp_path / "t.yaml", xds_dir=tmp_path)
        admin = EnvoyAdmin("http://127.0.0.1:9", timeout_s=0.1)  # never called here
        loop = asyncio.get_running_loop()
        service = PickerService(Wiring(config, topo[0], lambda: topo[0], admin, CollectorRegistry(), loop.time,
                                       Servicers()))
        assert set(service.picker.admission.pool_budgets) == {"batch"}
        topo[0] = _topology("    admission: {sheddable: 0}")
        service.update(Snapshot(topology="budgets", pools=(), reloads={}, cycles=1, not_ready=(), problems=(),
                                last_reload_error=None))
        policy = service.picker.policy
        budgets = service.picker.admission.pool_budgets
        assert budgets["chat"] == WaitBudgets(policy.budget_standard, 0.0, policy.budget_floor_s)
        await service.close()

    asyncio.run(run())
