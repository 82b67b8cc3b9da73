"""Workers named by DNS: the sidecar resolves them into the EDS file (Envoy takes IP
literals only) and traffic flows; the topology's static weight and labels survive."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from tests.sidecar_live.rig import Rig, live_rig, poll, worker_specs


def _published(rig: Rig) -> list[dict[str, Any]]:
    cla = json.loads((rig.xds_dir / "eds" / "chat" / "endpoints.json").read_bytes())["resources"][0]
    return [lb for group in cla["endpoints"] for lb in group["lb_endpoints"]]


def _by_port(rig: Rig) -> dict[int, dict[str, Any]]:
    return {lb["endpoint"]["address"]["socket_address"]["port_value"]: lb for lb in _published(rig)}


def test_localhost_workers_are_resolved_into_eds_and_serve(tmp_path: Path) -> None:
    """`localhost:<port>` workers are absent from the first render (names wait for the
    sidecar), then published as 127.0.0.1 only (IPv4 preferred: the simulated engines
    listen on 127.0.0.1, and ::1 would be a second, refusing copy of the same worker),
    with the worker's name and labels as metadata; Envoy routes to both, and the idle
    weight is the static share x capacity (3 x 4 for a, 1 x 4 for b)."""
    names = iter(("a", "b"))

    def item(port: int) -> str:
        if next(names) == "a":
            return f'{{address: "localhost:{port}", weight: 3, labels: {{gpu: l4}}}}'
        return f"localhost:{port}"

    with live_rig(tmp_path, worker_specs(["a", "b"], max_num_seqs=4), worker_item=item) as rig:
        pa, pb = rig.worker_port("a"), rig.worker_port("b")
        assert poll(lambda: set(_by_port(rig)) == {pa, pb}, timeout=5), _published(rig)
        published = _by_port(rig)
        assert {lb["endpoint"]["address"]["socket_address"]["address"] for lb in published.values()} == {"127.0.0.1"}
        assert len(_published(rig)) == 2
        assert published[pa]["metadata"]["filter_metadata"]["confgen"] == {"gpu": "l4", "worker": f"localhost:{pa}"}
        assert published[pb]["metadata"]["filter_metadata"]["confgen"] == {"worker": f"localhost:{pb}"}
        state = {ep["port"]: ep for ep in rig.sidecar.state()["pools"]["chat"]["endpoints"]}
        assert {(ep["worker"], ep["address"]) for ep in state.values()} == {
            (f"localhost:{pa}", "127.0.0.1"), (f"localhost:{pb}", "127.0.0.1")}

        def idle_weights() -> bool:
            now = _by_port(rig)
            return (now[pa]["load_balancing_weight"], now[pb]["load_balancing_weight"]) == (12, 4)

        assert poll(idle_weights, timeout=5), _published(rig)
        assert poll(lambda: rig.envoy_host(pa).get("weight") == "12", timeout=3)
        assert poll(lambda: rig.send()[0] == 200, timeout=5)
        results = Counter(rig.send() for _ in range(30))
        assert all(status == 200 for status, _ in results), results
        assert {name for _, name in results} == {"a", "b"}, results
