"""Global limits on a Redis that fails over, live: limits.store.sentinel, a real primary, a real
replica and a real redis-sentinel on loopback (down-after-milliseconds 300), 2 Envoys each with its
sidecar, a simulated fleet.

A bounded, paced load (30 requests a second over both Envoys) on a key of 100 requests an hour; once
30 are admitted the primary is killed (SIGKILL, by its pid). No request fails (200 or 429 only);
while no primary answers each sidecar decides on its local floor (100 / 2 Envoys); the Sentinel
promotes the replica and the sidecars count on it (decisions counted by the store again, the key's
counter on the new primary, the floor's admissions replayed into it); the budget is then enforced
by the new primary. Over the whole run the admitted total stays within the outage bound
docs/limits.md states: the budget + the floors (100 + 2 x 50).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis as redis_sync

from confgen.runtime import RedisProcess, SentinelProcess
from tests.sidecar_live.glimits import global_rig, paced_load, sidecar_metric
from tests.support.envoy import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

BUDGET = 100
CLIENT = "reqh"  # a client glimits.KEYS has a key for


def _client(port: int) -> redis_sync.Redis:
    return redis_sync.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)


def _sentinel_primary(sentinel: SentinelProcess) -> int:
    found = _client(sentinel.port).sentinel_get_master_addr_by_name(sentinel.master)
    return int(found[1]) if found else 0


def _counted_on(port: int) -> int:
    client = _client(port)
    try:
        return sum(int(client.get(key) or 0) for key in client.scan_iter(match=f"confgen:*:client/{CLIENT}/0:*")
                   if not key.endswith((b":r", b":r:z")))
    finally:
        client.close()


def test_limits_resume_on_the_new_primary_after_a_sentinel_failover(tmp_path: Path) -> None:
    with RedisProcess() as primary, RedisProcess(replica_of=primary.port) as replica:
        # the replica in sync with the primary, and the Sentinel knowing it, before anything counts
        assert wait_until(lambda: _client(replica.port).info("replication").get("master_link_status") == "up",
                          timeout=10)
        with SentinelProcess(primary.port, down_after_ms=300, failover_timeout_ms=2000) as sentinel:
            assert wait_until(lambda: len(_client(sentinel.port).sentinel_slaves(sentinel.master)) >= 1,
                              timeout=10), "the Sentinel found no replica"
            clients = {CLIENT: f"{{scope: global, requests: {BUDGET}, window: hour}}"}
            with global_rig(tmp_path, envoys=2, clients=[clients, clients], sentinel=sentinel, primary=primary,
                            envoys_in_store=2) as rig:
                out: list[tuple[float, int]] = []
                stop = threading.Event()
                body = {"model": "sim-model", "prompt": "x", "max_tokens": 1}
                load = threading.Thread(target=paced_load, args=(rig, CLIENT, body, stop, out, 30.0, 400))
                load.start()
                try:
                    assert wait_until(lambda: [s for _, s in out].count(200) >= 30, timeout=20)
                    counted_before = sidecar_metric(rig, "confgen_sidecar_ratelimit_decisions_total",
                                                    'store="counted"')
                    before = [s for _, s in out].count(200)
                    killed = time.monotonic()
                    primary.kill()
                    # the Sentinel promotes the replica ...
                    assert wait_until(lambda: _sentinel_primary(sentinel) == replica.port, timeout=15, interval=0.05)
                    promoted = time.monotonic()
                    # ... and the sidecars count there again, until the budget refuses
                    assert wait_until(lambda: any(at > promoted and s == 429 for at, s in out), timeout=15), out[-5:]
                    refused_at = min(at for at, s in out if at > promoted and s == 429)
                finally:
                    stop.set()
                    load.join(timeout=30)
                statuses = [s for _, s in out]
                admitted = statuses.count(200)
                floor = sidecar_metric(rig, "confgen_sidecar_ratelimit_fail_open_total")
                counted_after = sidecar_metric(rig, "confgen_sidecar_ratelimit_decisions_total", 'store="counted"')
                # the floor's admissions are replayed into the new primary (the journal)
                assert wait_until(lambda: sidecar_metric(rig, "confgen_sidecar_ratelimit_journal_entries") == 0,
                                  timeout=10)
                on_new_primary = _counted_on(replica.port)
                print(f"\nsentinel failover: primary killed after {before} admitted; replica "
                      f"promoted {promoted - killed:.2f} s later; first refusal by the new primary "
                      f"{refused_at - promoted:.2f} s after; {admitted} admitted of {len(out)} in all (bound "
                      f"{BUDGET} + {BUDGET // 2} x 2), {floor:.0f} floor decisions; new primary counts "
                      f"{on_new_primary}")
                assert set(statuses) <= {200, 429}, sorted(set(statuses))  # 0 failed requests
                assert admitted <= BUDGET + 2 * (BUDGET // 2), admitted  # the outage bound
                assert counted_after > counted_before  # decisions counted by the store after the failover
                # every admission is counted on the new primary (replicated, or replayed from the floors'
                # journal), less at most what the primary acknowledged but had not replicated when killed
                assert admitted - 5 <= on_new_primary <= admitted, (on_new_primary, admitted)
                assert on_new_primary >= BUDGET  # the new primary refused: the budget holds there
