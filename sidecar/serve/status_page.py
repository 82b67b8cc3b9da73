"""`GET /`: the sidecar's status page for humans, read-only HTML (HAProxy's stats page is the model).

One dense table per pool: a header row with the pool's figures (engine, model, saturation,
queue, shedding, the in-flight limit in force and the render's safety cap, the sheddable
share, 429s, EDS publishes and rejections, the picker's picks by reason) and one row per
endpoint (state coloured, reason, weight, running and waiting requests, KV use, the picker's
in-flight count, probe latency, last outcome and error, probe errors). Above them: readiness,
problems (what the proxy does not run of the sidecar's decisions), the last reload's error,
the control plane (ADS mode), the picker's totals (hit ratio, fallbacks, pick latency) and
the rate limits the topology declares.

Contract:
- No script at all, none from elsewhere: the answer's Content-Security-Policy is
  `default-src 'none'` with only the page's own inline stylesheet allowed by its hash;
  no frame may embed it, no form, no base URL. The page reloads itself every
  REFRESH_S seconds (<meta http-equiv=refresh>), which needs no script.
- Every value shown is escaped (html.escape, quotes included): pool and worker names come
  from the topology, errors and reasons from the fleet and from Envoy.
- Plain data in, text out: `render(snapshot, picker, topology)` does no I/O.
- Served by the same app as /state, so the same bounds (sidecar.serve.bounds) apply; it
  mutates nothing, so it is open like the other GETs (sidecar.serve.guard).
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

from confgen import __version__
from confgen.balancing import policy_of
from confgen.model import ENVOY_CAP_MAX, RateLimit, Topology, join_address, limit_list
from sidecar.fleet import EndpointView, PoolView, Snapshot

__all__ = ["HEADERS", "REFRESH_S", "render"]

REFRESH_S = 5

_CSS = """
body{font:12px/1.35 Verdana,Arial,sans-serif;margin:8px;color:#000;background:#fff}
h1{font-size:16px;margin:0 0 4px}h2{font-size:13px;margin:10px 0 2px}
table{border-collapse:collapse;margin:2px 0 8px;width:100%}
th,td{border:1px solid #999;padding:1px 4px;text-align:right;white-space:nowrap}
th{background:#20458e;color:#fff;font-weight:normal}
td.l,th.l{text-align:left}
tr.pool th{background:#4b72b5;text-align:left;white-space:normal}
td.w{text-align:left;white-space:normal}td.s{text-align:center}
td.HEALTHY{background:#00d200}td.DEGRADED{background:#f5d800}
td.UNHEALTHY{background:#ff2020;color:#fff}td.DRAINING{background:#20a0ff}
td.yes{background:#ffa020}td.err{color:#b00000;white-space:normal;text-align:left}
ul{margin:2px 0 6px 18px;padding:0}.ok{color:#007000}.bad{color:#b00000;font-weight:bold}
.muted{color:#666}
""".strip()

_CSS_HASH = base64.b64encode(hashlib.sha256(_CSS.encode()).digest()).decode()

HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": f"default-src 'none'; style-src 'sha256-{_CSS_HASH}'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

_ENDPOINT_COLUMNS = ("Worker", "Address", "State", "Reason", "Weight", "Running", "Waiting", "KV", "Picker in-flight",
                     "Probe", "Last probe", "Last error", "Probe errors")


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _num(value: float | int | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{100 * value:.0f}%"


def _cell(value: object, cls: str = "") -> str:
    attr = f' class="{_e(cls)}"' if cls else ""
    return f"<td{attr}>{_e(value)}</td>"


def _row(cells: Iterable[str], cls: str = "") -> str:
    attr = f' class="{_e(cls)}"' if cls else ""
    return f"<tr{attr}>{''.join(cells)}</tr>"


def _list(items: Sequence[str], empty: str) -> str:
    if not items:
        return f'<p class="ok">{_e(empty)}</p>'
    return "<ul>" + "".join(f'<li class="bad">{_e(i)}</li>' for i in items) + "</ul>"


def _limit(limit: RateLimit) -> str:
    amount = f"{limit.requests} requests" if limit.requests is not None else f"{limit.tokens} {limit.unit}"
    if limit.scope == "global":
        every = f"per {limit.window}" if limit.window else ""
        extra = [x for x in ("per model" if limit.per_model else "", "fail closed" if limit.fail_closed else
                             "fail open") if x]
    else:
        every = f"per {limit.per}" if limit.per is not None else ""
        extra = [f"burst {limit.burst}"] if limit.burst is not None else []
    return " ".join(x for x in (amount, every, f"({', '.join([limit.scope, *extra])})") if x)


def _limits(topo: Topology | None) -> list[tuple[str, str]]:
    if topo is None:
        return []
    out = [("all requests", _limit(x)) for x in limit_list(topo.limits.global_)]
    out += [("each API-key client", _limit(x)) for x in limit_list(topo.limits.per_key)]
    if topo.auth is not None:
        out += [(f"client {key.client}", _limit(x)) for key in topo.auth.api_keys for x in limit_list(key.rate_limit)]
    return out


def _picks(figures: Mapping[str, Any] | None) -> str:
    if not figures:
        return "-"
    picks = figures.get("picks", {})
    return ", ".join(f"{reason} {n}" for reason, n in sorted(picks.items())) or "none yet"


def _pool_header(pool: PoolView, topo: Topology | None, picker: Mapping[str, Any] | None) -> str:
    declared = next((p for p in topo.pools if p.name == pool.name), None) if topo is not None else None
    cap = topo.in_flight_cap(declared, ENVOY_CAP_MAX) if topo is not None and declared is not None else None
    policy = policy_of(topo, declared) if topo is not None and declared is not None else "-"
    shed = ", ".join(f"{reason} {n}" for reason, n in sorted(pool.shed.items())) or "0"
    facts = [
        ("engine", pool.engine), ("model", pool.model or "-"), ("policy", policy),
        ("saturation", _num(pool.saturation)), ("queue", _num(pool.queue_depth)),
        ("saturated", f"yes ({pool.saturated_reason})" if pool.saturated else "no"),
        ("shedding", "yes" if pool.shedding else "no"),
        ("in-flight limit", _num(pool.inflight_limit)), ("safety cap", _num(cap)),
        ("sheddable refused", "-" if pool.sheddable_share is None else f"{pool.sheddable_share}%"),
        ("429s", shed), ("EDS publishes", pool.publishes), ("rejected", pool.rejections),
        ("picks", _picks(picker)),
    ]
    text = " · ".join(f"{_e(k)} <b>{_e(v)}</b>" for k, v in facts)
    flag = ' <span class="bad">last update refused</span>' if pool.rejected else ""
    return (f'<tr class="pool"><th colspan="{len(_ENDPOINT_COLUMNS)}" id="pool-{_e(pool.name)}">'
            f"pool <b>{_e(pool.name)}</b>{flag} — {text}</th></tr>")


def _endpoint(ep: EndpointView, in_flight: Mapping[str, int]) -> str:
    s = ep.sample
    address = join_address(ep.key.address, ep.key.port)
    errors = ", ".join(f"{kind} {n}" for kind, n in sorted(ep.errors.items())) or "0"
    latency = "-" if ep.probe_latency_s is None else f"{1000 * ep.probe_latency_s:.0f} ms"
    reason = ep.reason or "-"
    if not ep.serving and ep.status in ("HEALTHY", "DEGRADED"):
        reason += " (failing: kept published by the ejection cap)"
    return _row([
        _cell(ep.key.worker, "l"), _cell(address, "l"), _cell(ep.status, f"s {ep.status}"),
        _cell(reason, "w"),
        _cell(_num(ep.weight)), _cell(_num(s.running) if s else "-"), _cell(_num(s.waiting) if s else "-"),
        _cell(_pct(s.kv_usage) if s else "-"), _cell(_num(in_flight.get(address))), _cell(latency),
        _cell(ep.last_outcome or "-", "l"), _cell(ep.last_error or "", "err"), _cell(errors),
    ], "endpoint")


def _picker_summary(picker: Mapping[str, Any] | None) -> str:
    if picker is None:
        return '<p class="muted">No endpoint picker runs (no pool uses policy prefix_affinity).</p>'
    latency = picker["pick_seconds"]
    mean = f"{1e6 * latency['sum'] / latency['count']:.0f} µs" if latency["count"] else "-"
    unpicked = ", ".join(f"{k} {v}" for k, v in picker["unpicked"].items()) or "0"
    cells = [("streams", picker["streams"]), ("prefix hit ratio", _pct(picker["hit_ratio"])),
             ("blocks matched / requested", f"{picker['prefix_blocks'].get('matched', 0)} / "
                                            f"{picker['prefix_blocks'].get('requested', 0)}"),
             ("left to Envoy's balancer", f"{picker['fallbacks']} ({unpicked})"),
             ("sent past it (cannot keep up)", f"{picker['bypass_percent']} %"),
             ("index blocks", picker["index_blocks"]), ("mean pick time", mean)]
    head = "".join(f'<th class="l">{_e(k)}</th>' for k, _ in cells)
    return f'<table id="picker"><tr>{head}</tr>{_row(_cell(v, "l") for _, v in cells)}</table>'


def _xds(snap: Snapshot) -> str:
    if snap.xds is None:
        return ""
    x = snap.xds
    rows = [_row([_cell(n.node, "l"), _cell(n.cluster, "l"), _cell(n.streams),
                  _cell(", ".join(f"{t} {v}" for t, v in sorted(n.acked.items())) or "-", "l"),
                  _cell("; ".join(f"{t}: {k.message}" for t, k in sorted(n.nacked.items())), "err")])
            for n in x.nodes]
    head = "".join(f'<th class="l">{h}</th>' for h in ("Envoy node", "Cluster", "Streams", "ACKed", "NACKed"))
    versions = ", ".join(f"{t} {v}" for t, v in sorted(x.versions.items())) or "-"
    return (f"<h2>Control plane (ADS on {_e(x.listen)}, {_e(x.transport)})</h2>"
            f"<p>versions served: {_e(versions)} · NACKs {_e(x.nacks_total)} · Envoys counted {_e(x.counted)}</p>"
            f'<table id="xds"><tr>{head}</tr>{"".join(rows)}</table>')


def render(snap: Snapshot, picker: Mapping[str, Any] | None, topo: Topology | None) -> str:
    """The page for `snap` (picker: sidecar.serve.picker_view's status, None when no picker runs)."""
    picker_pools: Mapping[str, Any] = picker["pools"] if picker is not None else {}
    ready = ('<b class="ok">ready</b>' if not snap.not_ready else
             '<b class="bad">not ready</b>: ' + _e("; ".join(snap.not_ready)))
    reloads = ", ".join(f"{k} {v}" for k, v in sorted(snap.reloads.items())) or "0"
    head = "".join(f'<th class="l">{_e(c)}</th>' if i < 4 else f"<th>{_e(c)}</th>"
                   for i, c in enumerate(_ENDPOINT_COLUMNS))
    tables = []
    for pool in snap.pools:
        figures = picker_pools.get(pool.name)
        in_flight = figures["in_flight"] if figures else {}
        rows = "".join(_endpoint(ep, in_flight) for ep in pool.endpoints)
        tables.append(f'<table class="pool-table" data-pool="{_e(pool.name)}">'
                      f"{_pool_header(pool, topo, figures)}<tr>{head}</tr>{rows}</table>")
    limits = _limits(topo)
    limit_rows = "".join(_row([_cell(who, "l"), _cell(what, "l")]) for who, what in limits)
    limit_table = (f'<table id="limits"><tr><th class="l">Applies to</th><th class="l">Rate limit</th></tr>'
                   f"{limit_rows}</table>" if limits else '<p class="muted">No rate limits declared.</p>')
    stale = ("" if snap.last_reload_error is None else
             f'<p class="bad">Running an older topology: its last reload failed: {_e(snap.last_reload_error)}</p>')
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        f"<title>confgen-sidecar · {_e(snap.topology)}</title><style>{_CSS}</style></head><body>"
        f"<h1>confgen-sidecar · topology {_e(snap.topology)}</h1>"
        f"<p>{ready} · version {_e(__version__)} · probe cycles {_e(snap.cycles)} · topology reloads {_e(reloads)}"
        f" · refreshes every {REFRESH_S} s · <span class=\"muted\">JSON: /state, metrics: /metrics</span></p>"
        f"{stale}<h2>Problems (what the proxy does not run of the sidecar's decisions)</h2>"
        f'<div id="problems">{_list(list(snap.problems), "none: the proxy runs the last publish")}</div>'
        f"<h2>Pools</h2>{''.join(tables)}"
        f"<h2>Endpoint picker</h2>{_picker_summary(picker)}"
        f"<h2>Rate limits</h2>{limit_table}{_xds(snap)}"
        "</body></html>"
    )
