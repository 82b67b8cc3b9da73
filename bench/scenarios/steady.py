"""A steady fleet under steady load: does the sidecar stop rewriting EDS once it has settled,
and does it notice a worker that slows down 2x (within 3 probe cycles)?"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from confgen.simulate import FleetHandle

from .. import _workload as wl
from .._harness import Context, Result, Target
from ._fleets import FleetPlan
from ._runner import PRODUCT, Front, measure

NAME = "steady"
TITLE = "Steady fleet: EDS writes once settled, and a worker that slows down"

FLEET = FleetPlan("steady", "3 workers (1x, 1x, 0.5x)", (1.0, 1.0, 0.5), (8, 8, 8), decode_ms=20, load=0.6)
SLOWED = 0  # a 1x worker; at 60 % load the fleet stays below capacity after it slows (75 %)
INTERVAL_S = 2.0  # the sidecar's default --interval
REFLECTED = 0.75  # "reflected": the slowed worker's weight relative to the others' mean falls to <= 0.75x


def _weights(path: Path) -> dict[int, int] | None:
    try:
        doc = json.loads(path.read_bytes())
        out = {}
        for group in doc["resources"][0]["endpoints"]:
            for ep in group["lb_endpoints"]:
                out[int(ep["endpoint"]["address"]["socket_address"]["port_value"])] = int(
                    ep.get("load_balancing_weight", 1))
        return out
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _watch(steady_s: float, settle_s: float, after_s: float) -> Any:
    def run(fleet: FleetHandle, front: Front, t0: float) -> dict[str, Any]:
        path = front.eds_files[0]
        writes: list[tuple[float, dict[int, int] | None]] = []
        last: tuple[int, int] | None = None
        metric_at_settle: float | None = None
        slowed_at: float | None = None
        metric_before_slow: float | None = None
        end = t0 + steady_s + after_s
        while time.monotonic() < end:
            now = time.monotonic() - t0
            if metric_at_settle is None and now >= settle_s:
                metric_at_settle = front.extras().get("sidecar_eds_writes")
            if slowed_at is None and now >= steady_s:
                metric_before_slow = front.extras().get("sidecar_eds_writes")
                fleet.workers[SLOWED].set_fault("slow", factor=2.0)
                slowed_at = time.monotonic() - t0
            try:
                st = path.stat()
                key = (st.st_ino, st.st_mtime_ns)
            except OSError:
                key = None
            if key is not None and key != last:
                if last is not None:
                    writes.append((round(now, 2), _weights(path)))
                last = key
            time.sleep(0.1)
        metric_end = front.extras().get("sidecar_eds_writes")
        return {"eds_writes": writes, "metric_at_settle": metric_at_settle, "metric_before_slow": metric_before_slow,
                "metric_end": metric_end, "slowed_at_s": slowed_at, "ports": [w.port for w in fleet.workers]}
    return run


def _relative(weights: dict[int, int], port: int) -> float | None:
    others = [w for p, w in weights.items() if p != port]
    if not others or port not in weights or sum(others) == 0:
        return None
    return weights[port] / (sum(others) / len(others))


def _reflection(writes: list[tuple[float, dict[int, int] | None]], port: int | None, settle_s: float,
                slowed_at: float) -> tuple[float | None, float | None, float | None]:
    """(relative weight before: the mean over the settled phase's writes, else the last one before the
    slowdown; seconds until it fell to REFLECTED x that and stayed there to the end; the last value)."""
    if port is None:
        return None, None, None
    rel = [(t, _relative(w, port)) for t, w in writes if w]
    settled = [v for t, v in rel if settle_s <= t < slowed_at and v is not None]
    earlier = [v for t, v in rel if t < slowed_at and v is not None]
    pre = sum(settled) / len(settled) if settled else (earlier[-1] if earlier else None)
    after = [(t, v) for t, v in rel if t >= slowed_at and v is not None]
    if pre is None or not after:
        return pre, None, None
    reflected: float | None = None
    for t, v in after:
        if v > REFLECTED * pre:
            reflected = None  # (back) above the line: not reflected yet
        elif reflected is None:
            reflected = t - slowed_at
    return pre, reflected, after[-1][1]


def run(ctx: Context) -> Result:
    res = Result(NAME, TITLE)
    steady_s = ctx.option("steady_s", ctx.scale(130, 20))
    settle_s, after_s = ctx.scale(60, 8), ctx.scale(20, 8)
    cap = FLEET.capacity_rps()
    rate = cap * FLEET.load
    count = int(rate * (steady_s + after_s)) + 1
    requests = wl.build(FLEET.workload(rate, count, ctx.seed + 21))
    deadline = requests[-1]["t"] + 1.0
    r = measure(ctx, FLEET.spec(ctx.seed), list(FLEET.max_num_seqs), requests, PRODUCT, "steady",
                warmup_s=0.0, deadline_s=deadline, during=_watch(steady_s, settle_s, after_s))
    writes: list[tuple[float, dict[int, int] | None]] = r.get("eds_writes", [])
    late = [w for w in writes if settle_s <= w[0] < steady_s]
    port = r["ports"][SLOWED] if r.get("ports") else None
    slowed_at = r.get("slowed_at_s") or steady_s
    pre, reflected_after, final = _reflection(writes, port, settle_s, slowed_at)
    cycles = None if reflected_after is None else math.ceil(reflected_after / INTERVAL_S)
    metric_late = None
    if r.get("metric_before_slow") is not None and r.get("metric_at_settle") is not None:
        metric_late = r["metric_before_slow"] - r["metric_at_settle"]
    head = ["phase", "EDS writes (file replaced)", "sidecar's own EDS-publish counter",
            "slowed worker: weight / others' mean"]
    rows = [
        [f"first {settle_s:g} s", str(len([w for w in writes if w[0] < settle_s])), "-", "-"],
        [f"{settle_s:g} s to {steady_s:g} s (settled)", str(len(late)), "-" if metric_late is None else
         f"{metric_late:g}", "-" if pre is None else f"{pre:.2f} (mean of this phase's writes, else the last before)"],
        [f"after the slowdown ({after_s:g} s)", str(len([w for w in writes if w[0] >= slowed_at])), "-",
         "-" if final is None else f"{final:.2f} (last)"],
    ]
    res.tables.append((f"{FLEET.describe()}; {rate:.1f} req/s Poisson = {FLEET.load:.0%} of an estimated {cap:.1f} "
                       f"req/s; product as shipped (sidecar default flags, interval {INTERVAL_S:g} s); worker "
                       f"{FLEET.worker_name(SLOWED)} slowed 2x at {slowed_at:.0f} s", head, rows))
    res.targets.append(Target(f"[steady] EDS writes after the first {settle_s:g} s of a {steady_s:g} s steady run",
                              "0", f"{len(late)} writes", float(len(late)), len(late) == 0, 0.0))
    res.targets.append(Target("[steady] a worker slowing 2x is reflected in the weights (<= 0.75x its relative "
                              "weight before)", "<= 3 probe cycles",
                              "not within the run" if cycles is None else
                              f"after {reflected_after:.1f} s = {cycles} cycles of {INTERVAL_S:g} s",
                              None if cycles is None else float(cycles), cycles is not None and cycles <= 3, 3.0))
    res.raw = {"rate_rps": rate, "steady_s": steady_s, "settle_s": settle_s, "after_s": after_s, "result": r}
    res.notes += [
        "EDS writes are counted by watching the EDS file Envoy reads (every replacement changes its inode), polled "
        "every 100 ms; the sidecar's own counter (its /metrics, a sample named like *eds*publish*) is shown beside.",
        f"'Reflected' = the slowed worker's published weight relative to the mean of the others falls to "
        f"{REFLECTED:g}x or less of its mean over the settled phase (or its last value before the slowdown when "
        "nothing was written then) and stays there to the end of the run; cycles = elapsed time / the default "
        "interval, rounded up.",
    ]
    if ctx.quick:
        res.notes.append(f"Quick mode: {steady_s:g} s steady instead of 300 s, settled after {settle_s:g} s instead "
                         "of 60 s: it shows the harness works, not the 5-minute target.")
    elif steady_s < 300:
        res.notes.append(
            f"Shorter than the 5 minutes of the target, to keep `make bench` within 25 minutes: {steady_s:g} s, of "
            f"which {steady_s - settle_s:g} s ({(steady_s - settle_s) / INTERVAL_S:.0f} probe cycles) after the first "
            "minute. The argument that this is equivalent: the sidecar decides from its last few probes (smoothed), "
            "so a weight that flips between values, the fault this target catches, rewrites the file within a few "
            "cycles; dozens of cycles without a write show it settled. It is an argument, not the literal target: "
            "`python -m bench run --only steady --set steady_s=300 --out DIR` runs the full 5 minutes (about 6 min).")
    return res
