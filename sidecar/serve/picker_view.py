"""The endpoint picker's figures for /state and the status page, read from the registry.

The picker (sidecar.outputs.picker) counts into the sidecar's registry under the names its
metrics module documents (`confgen_picker_*`); this reads those families back, so /state,
the status page and a Prometheus scrape show the same numbers and the HTTP surface holds
no reference into the picker. `picker_status(registry)` is None when no picker runs (no
`confgen_picker_*` family registered).

    {"streams": 12, "unpicked": {"no_body": 1}, "fallbacks": 1, "bypass_percent": 0, "hit_ratio": 0.82 | None,
     "prefix_blocks": {"requested": 400, "matched": 328}, "index_blocks": 312,
     "pick_seconds": {"count": 11, "sum": 0.0042},
     "pools": {"chat": {"picks": {"prefix": 8, "load": 3}, "picked": 11,
                        "in_flight": {"127.0.0.1:8001": 0}}}}

`hit_ratio` is matched / requested prompt blocks at the chosen endpoints (the picker's
estimate of the prefix-cache hit ratio), over every pool the picker serves (the counter has
no pool label), None before any block was requested. `fallbacks` are the requests the picker
left to Envoy's own balancer (the sum of `unpicked`); calls Envoy itself gave up on are in
Envoy's stats (ext_proc `failure_mode_allowed`), not here, and so are the requests Envoy sent past
the picker: `bypass_percent` is the share of them the Envoys hold (above 0 while it cannot keep up).
"""

from __future__ import annotations

from typing import Any

from prometheus_client.registry import CollectorRegistry

__all__ = ["picker_status"]

_PREFIX = "confgen_picker_"


def picker_status(registry: CollectorRegistry) -> dict[str, Any] | None:
    """The picker's counters and gauges now, or None when no picker is registered."""
    found = False
    streams = 0.0
    unpicked: dict[str, float] = {}
    blocks: dict[str, float] = {"requested": 0.0, "matched": 0.0}
    index = 0.0
    latency = {"count": 0.0, "sum": 0.0}
    bypass = 0.0
    pools: dict[str, dict[str, Any]] = {}

    def pool(name: str) -> dict[str, Any]:
        return pools.setdefault(name, {"picks": {}, "picked": 0, "in_flight": {}})

    for family in registry.collect():
        if not family.name.startswith(_PREFIX):
            continue
        found = True
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name == _PREFIX + "streams_total":
                streams += value
            elif name == _PREFIX + "unpicked_total":
                unpicked[labels["reason"]] = unpicked.get(labels["reason"], 0.0) + value
            elif name == _PREFIX + "prefix_blocks_total":
                blocks[labels["kind"]] = blocks.get(labels["kind"], 0.0) + value
            elif name == _PREFIX + "index_blocks":
                index += value
            elif name == _PREFIX + "pick_seconds_count":
                latency["count"] += value
            elif name == _PREFIX + "pick_seconds_sum":
                latency["sum"] += value
            elif name == _PREFIX + "picks_total":
                entry = pool(labels["pool"])
                entry["picks"][labels["reason"]] = int(value)
                entry["picked"] += int(value)
            elif name == _PREFIX + "bypass_percent":
                bypass = value
            elif name == _PREFIX + "in_flight":
                pool(labels["pool"])["in_flight"][labels["endpoint"]] = int(value)
    if not found:
        return None
    requested = blocks["requested"]
    return {
        "streams": int(streams),
        "unpicked": {k: int(v) for k, v in sorted(unpicked.items())},
        "fallbacks": int(sum(unpicked.values())),
        "bypass_percent": int(bypass),
        "hit_ratio": blocks["matched"] / requested if requested else None,
        "prefix_blocks": {k: int(v) for k, v in sorted(blocks.items())},
        "index_blocks": int(index),
        "pick_seconds": {"count": int(latency["count"]), "sum": latency["sum"]},
        "pools": {name: pools[name] for name in sorted(pools)},
    }
