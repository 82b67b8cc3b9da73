"""The routers under test ("setups") and one measured run: a fresh fleet, the setup in front
of it, a fixed list of arrivals from the load generator.

Headline setups (what a user deploys):
  product  `confgen render` of the topology a user writes for the fleet (bench/_proxies.py
           user_topology), output unmodified, real Envoy, and `confgen-sidecar` as its own
           process with default flags (only --topology, --xds-dir and --listen, plus
           --ingresses N where N Envoys share the fleet: a deployment fact like the others)
  render   the same render without a sidecar (the EDS file as rendered)
  bare     a hand-written Envoy least_request (bench/_bare_envoy.py)
  vllm     the peer vLLM Router with one --policy
A Setup with diagnostic=True is shown below the headline rows, labelled, and never a target.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confgen import runtime
from confgen.balancing import POLICIES, policy_of
from confgen.model import GRPC_SOCKET
from confgen.simulate import FleetHandle, FleetSpec, run_fleet_in_thread
from confgen.topology import parse

from .. import _bare_envoy, _proxies, _stats, loadgen
from .._harness import Context, fleet_stats, stats_delta


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    kind: str  # product | render | bare | vllm
    policy: str = ""  # vllm: its --policy; product/render: the topology's `balancing` ("" = default)
    diagnostic: bool = False
    routes: str = ""  # product/render: a top-level `routes:` list for the topology (traffic classes)
    # product with several ingresses: the sidecars' pickers are each other's --picker-peer (as the
    # README says to run them); True leaves each picker alone (the comparison row)
    alone: bool = False
    sidecar_args: tuple[str, ...] = ()  # product: more confgen-sidecar flags (a diagnostic row's override)
    ads: bool = False  # product: one control plane serving every ingress's Envoy over ADS (not one sidecar each)


PRODUCT = Setup("product", "confgen render + confgen-sidecar (as shipped)", "product")
RENDER = Setup("render", "confgen render alone (no sidecar)", "render")
BARE = Setup("bare", "bare Envoy least_request (hand-written)", "bare")
SESSION_BALANCING = "{policy: ring_hash, hash_on: {header: x-session-id}}"


def vllm(policy: str) -> Setup:
    return Setup(f"vr_{policy}", f"vLLM Router {policy}", "vllm", policy)


PEER_POLICIES = ("round_robin", "power_of_two", "cache_aware")
# Product rows with an explicit balancing policy (the topology's `balancing`, all else as shipped):
# the endpoint picker's policy (issue 17), run wherever confgen knows it and does not ship it as the default.
PRODUCT_POLICIES = ("least_request", "prefix_affinity")


def default_policy() -> str:
    """The balancing policy of the product as shipped: the one confgen gives the bench's user topology."""
    text = _proxies.user_topology([("127.0.0.1", 8000, 8)], 8001, 8002)
    topo, _ = parse(text.encode(), "<bench user topology>")
    return policy_of(topo, topo.pools[0])


def policy_setups() -> tuple[list[Setup], list[str]]:
    """The product rows for PRODUCT_POLICIES that confgen knows and does not already ship as the
    default (then the product row is that policy), and the names it does not know."""
    shipped = default_policy()
    have = [Setup(f"pol_{p}", f"confgen render (balancing: {{policy: {p}}}) + confgen-sidecar", "product",
                  f"{{policy: {p}}}") for p in PRODUCT_POLICIES if p in POLICIES and p != shipped]
    return have, [p for p in PRODUCT_POLICIES if p not in POLICIES]


@dataclass
class Front:
    urls: list[str]
    extras: Callable[[], dict[str, Any]] = field(default=lambda: {})
    eds_files: list[Path] = field(default_factory=list)
    # the picker's observed / predicted histogram so far (cumulative buckets by le), summed over sidecars
    predictions: Callable[[], dict[str, float]] = field(default=lambda: {})


@contextlib.contextmanager
def front(ctx: Context, fleet: FleetHandle, max_num_seqs: list[int], setup: Setup, tag: str,
          ingresses: int = 1) -> Iterator[Front]:
    """Start the router(s) of `setup` (one per ingress); yields the URLs clients send to."""
    workers = [("127.0.0.1", w.port, b) for w, b in zip(fleet.workers, max_num_seqs, strict=True)]
    with contextlib.ExitStack() as stack:
        if setup.kind == "vllm":
            urls = [stack.enter_context(_proxies.run_vllm_router(fleet.urls, setup.policy,
                                                                  ctx.work / f"{tag}.vr{i}.log"))
                    for i in range(ingresses)]
            yield Front(urls)
            return
        if setup.kind == "bare":
            urls = []
            for _ in range(ingresses):
                port = runtime.free_port()
                boot = _bare_envoy.bootstrap([(h, p) for h, p, _ in workers], port)
                proc = stack.enter_context(runtime.EnvoyProcess(boot, log_level="warning", concurrency=1))
                _proxies.wait_hosts(proc)
                urls.append(f"http://127.0.0.1:{port}")
            yield Front(urls)
            return
        balancing = setup.policy
        if setup.ads:  # one control plane (--serve-xds) serving every Envoy, as docs/ads.md deploys it
            xds_port = runtime.free_port()
            ads = _proxies.render_cli(workers, ctx.work / f"{tag}.ads", balancing, setup.routes, xds_port)
            plane = stack.enter_context(_proxies.run_control_plane(ads, xds_port, ctx.work / f"{tag}.plane.log",
                                                                   setup.sidecar_args))
            ads_procs = [stack.enter_context(_proxies.run_ads_envoy(ads, f"{tag}-envoy{i}")) for i in range(ingresses)]
            yield Front([ads.url] * ingresses, lambda: _extras([plane], ads_procs),
                        predictions=lambda: _prediction_buckets([plane]))
            return
        rendered = []
        for i in range(ingresses):
            out = ctx.work / f"{tag}.envoy{i}"
            rendered.append(_proxies.render_cli(workers, out, balancing, setup.routes))
        procs = [stack.enter_context(_proxies.run_envoy(r)) for r in rendered]
        sidecars: list[_proxies.SidecarProcess] = []
        if setup.kind == "product":
            extra = ("--ingresses", str(ingresses)) if ingresses > 1 else ()
            for i, (r, p) in enumerate(zip(rendered, procs, strict=True)):
                peers: list[str] = []
                if ingresses > 1 and not setup.alone:
                    for j, other in enumerate(rendered):
                        if j != i and other.sockets is not None:
                            peers += ["--picker-peer", f"unix:{other.sockets / GRPC_SOCKET}"]
                sidecars.append(stack.enter_context(
                    _proxies.run_sidecar(r, p, ctx.work / f"{tag}.sidecar{i}.log", None,
                                         (*extra, *peers, *setup.sidecar_args))))

        yield Front([r.url for r in rendered], lambda: _extras(sidecars, procs), [r.eds_file for r in rendered],
                    lambda: _prediction_buckets(sidecars))


def _extras(sidecars: Sequence[_proxies.SidecarProcess], procs: Sequence[runtime.EnvoyProcess]) -> dict[str, Any]:
    """What a product run's sidecars and Envoys counted over the whole run (beside the clients' records)."""
    out: dict[str, Any] = {}
    if sidecars:
        writes = [s.metric_sum("eds", "publish|write") for s in sidecars]
        out["sidecar_eds_writes"] = None if None in writes else sum(w or 0 for w in writes)
        # who answered the 429s, over the whole run, from the one shed counter: the picker
        # (per request, reason picker), the in-flight limiter (Envoy's breaker: saturated, cap)
        # and the sheddable share
        layers: dict[str, float] = {}
        for s in sidecars:
            for label, n in (s.metric_by("confgen_sidecar_shed_requests", "reason") or {}).items():
                name = "picker" if label == "picker" else f"limiter_{label}"
                layers[name] = layers.get(name, 0.0) + n
        out["shed_by"] = {k: int(v) for k, v in sorted(layers.items())}
        # requests the picker answered without a pick because they (or its loop) were late: a row
        # where many were is not a measure of the picker's routing
        unpicked = [s.metric_by("confgen_picker_unpicked", "reason") or {} for s in sidecars]
        out["picker_late"] = int(sum(u.get("behind", 0.0) for u in unpicked))
        # requests held in the picker (`--picker hold=1`), by what ended their wait
        held = _stats.summed(s.metric_by("confgen_picker_held", "outcome") for s in sidecars)
        if held:
            out["held_by"] = {k: int(v) for k, v in sorted(held.items())}
        out["prediction_buckets"] = _prediction_buckets(sidecars)
        # the same requests' predicted and observed seconds summed (pick to the response's end)
        out["prediction_sums"] = {kind: sum(sum((s.metric_by(f"confgen_picker_{kind}_seconds", "pool") or {}).values())
                                            for s in sidecars) for kind in ("predicted", "observed")}
        # what the (first) picker learned of each endpoint by the end of the run (predict.Learner)
        out["learned"] = {name: sidecars[0].metric_by(f"confgen_picker_learned_{name}", "endpoint")
                          for name in ("token_seconds", "batch", "prefill_seconds_per_token", "output_tokens")}
    out["envoy_4xx"] = sum(_envoy_counter(p, "downstream_rq_4xx") for p in procs)
    out["envoy_requests"] = [_envoy_counter(p, "downstream_rq_total") for p in procs]  # each Envoy's share
    if sidecars:
        # requests Envoy sent past the picker (the bypass share, bypass.py: its ext_proc filter
        # skipped), over the whole run: what neither the picker's routing nor its admission saw
        requests = sum(_envoy_counter(p, "downstream_rq_total") for p in procs)
        out["picker_bypassed"] = max(0, requests - sum(_envoy_counter(p, "ext_proc.streams_started")
                                                       for p in procs))
    return out


def _prediction_buckets(sidecars: Sequence[_proxies.SidecarProcess]) -> dict[str, float]:
    """The picker's observed / predicted finish time per request so far (cumulative buckets by le;
    the _count and _sum samples have no le), summed over the sidecars."""
    ratio = _stats.summed(s.metric_by("confgen_picker_prediction_ratio", "le") for s in sidecars)
    return {le: n for le, n in ratio.items() if le}


def _envoy_counter(proc: runtime.EnvoyProcess, suffix: str) -> int:
    try:
        stats = proc.stats()
    except OSError:
        return 0
    return sum(v for k, v in stats.items() if isinstance(v, int) and k.startswith("http.")
               and not k.startswith("http.admin.") and k.endswith(suffix))


def measure(ctx: Context, spec: FleetSpec, max_num_seqs: list[int], requests: list[dict[str, Any]], setup: Setup,
            tag: str, *, warmup_s: float, deadline_s: float, ingresses: int = 1, timeout_s: float = 60.0,
            during: Callable[[FleetHandle, Front, float], dict[str, Any]] | None = None,
            path: str = "/v1/completions",
            classify: Callable[[dict[str, Any]], str] | None = None,
            timeline: tuple[float, float] | None = None) -> dict[str, Any]:
    """One run: fleet, setup, load; the summary of the requests scheduled after `warmup_s`
    (with `timeline` (start s, end s): also second by second over that span, `_stats.timeline`).

    `during(fleet, front, t0)` runs in a thread while the load runs (t0 = time.monotonic() at
    the load's start, give or take the load generator's start-up) and returns extra figures."""
    started = time.monotonic()
    extra: dict[str, Any] = {}
    # The load generator starts first (its imports are slow on a busy machine) and waits for the targets.
    job = {"targets": None, "requests": requests, "deadline_s": deadline_s, "timeout_s": timeout_s,
           "max_in_flight": 4000, "path": path}
    proc, out_path = loadgen.start(job, ctx.work, tag)
    try:
        with run_fleet_in_thread(spec) as fleet, front(ctx, fleet, max_num_seqs, setup, tag, ingresses) as fr:
            snapshots: dict[str, Any] = {}
            t0 = time.monotonic()
            extra["startup_s"] = round(t0 - started, 2)
            loadgen.go(proc, fr.urls)
            def warm() -> None:
                snapshots.setdefault("warm", fleet_stats(fleet))
                snapshots.setdefault("predictions", fr.predictions())
            timer = threading.Timer(warmup_s, warm)
            timer.start()
            worker: threading.Thread | None = None
            if during is not None:
                def run_during() -> None:
                    extra.update(during(fleet, fr, t0))
                worker = threading.Thread(target=run_during, daemon=True)
                worker.start()
            try:
                records = loadgen.collect(proc, out_path, deadline_s + timeout_s + 30)
            finally:
                timer.cancel()
            if worker is not None:
                worker.join(timeout=deadline_s + timeout_s)
            extra["load_s"] = round(time.monotonic() - t0, 2)
            after = fleet_stats(fleet)
            extra.update(fr.extras())
            stopping = time.monotonic()
        extra["teardown_s"] = round(time.monotonic() - stopping, 2)
    finally:
        if proc.poll() is None:
            runtime.stop_process(proc, timeout=5)
    summary = _stats.summarize(records, warmup_s)
    if classify is not None:  # the same figures per request class (classify(request) -> its class)
        by_class: dict[str, list[dict[str, Any]]] = {}
        for rec in records:
            by_class.setdefault(classify(requests[rec["i"]]), []).append(rec)
        summary["by_class"] = {k: _stats.summarize(v, warmup_s) for k, v in sorted(by_class.items())}
    if timeline is not None:
        summary["timeline"] = _stats.timeline(records, *timeline)
    delta = stats_delta(snapshots.get("warm", {}), after)
    # the engines' own view of the measured window: mean seconds from arrival at the engine to the end,
    # to admission, to the first token (requests that ended in it)
    engine: dict[str, float | None] = {}
    for name in ("e2e", "queue", "ttft", "inference"):
        total = count = 0.0
        for worker, a in after.items():
            b = snapshots.get("warm", {}).get(worker, {}).get("latency_s", {}).get(name, {})
            got = a.get("latency_s", {}).get(name, {})
            total += got.get("sum", 0.0) - b.get("sum", 0.0)
            count += got.get("count", 0) - b.get("count", 0)
        engine[f"{name}_mean_ms"] = 1000 * total / count if count > 0 else None
    summary["engine_latency"] = engine
    summary.update(extra)
    if "prediction_buckets" in extra and "predictions" in snapshots:
        # the measured window's requests alone: those that finished after the warm-up
        warm = snapshots["predictions"]
        summary["prediction_buckets_measured"] = {le: n - warm.get(le, 0.0)
                                                  for le, n in extra["prediction_buckets"].items()}
    summary["fleet_by_worker"] = delta["by_worker"]
    summary["prefix_hit_rate"] = delta["prefix_hit_rate"]
    summary["wall_s"] = time.monotonic() - started
    summary["label"] = setup.label
    summary["setup"] = setup.key
    summary["diagnostic"] = setup.diagnostic
    return summary


def measure_or_fail(ctx: Context, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`measure`, tried twice when a process fails to start or dies (a port taken between our
    free_port() and its bind, a busy machine); a second failure becomes a row that says so."""
    setup: Setup = args[3]
    error = ""
    for attempt in range(2):
        try:
            row = measure(ctx, *args, **kwargs)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:300]
            print(f"  {setup.label}: attempt {attempt + 1} failed: {error}", flush=True)
            continue
        if row["requests"] and not row["ok"] and row["shed"] < row["requests"]:
            # Not one request served: the setup never worked (a port another process held, a router
            # that never saw its workers), not a latency to report. Said in the row if it happens twice.
            # Every request answered 429 is a figure (an overload's measured second refused whole), not
            # a failure: it stays, as 100 % shed with no latency.
            error = f"no request served ({row['error_kinds']})"[:300]
            print(f"  {setup.label}: attempt {attempt + 1}: {error}", flush=True)
            continue
        if error:
            row["retried_after"] = error
            row["label"] += " (second attempt)"
        return row
    return failed_row(setup, error)


def failed_row(setup: Setup, error: str) -> dict[str, Any]:
    return {"label": f"{setup.label} (FAILED: {error})", "setup": setup.key, "diagnostic": setup.diagnostic,
            "failed": error, "requests": 0, "ok": 0, "shed": 0, "errors": 0, "other_errors": 0, "shed_share": None,
            "p50_ms": None, "p90_ms": None, "p99_ms": None, "mean_ms": None, "ttft_p50_ms": None,
            "ttft_p90_ms": None, "ttft_p99_ms": None, "ntpot_p50_ms": None, "ntpot_p99_ms": None,
            "send_lag_p99_ms": None, "throughput_rps": 0.0, "by_worker": {}, "samples": None,
            "fleet_by_worker": {}, "prefix_hit_rate": None, "wall_s": 0.0}


def workdir(ctx: Context, name: str) -> Path:
    path = ctx.work / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def best(rows: dict[str, dict[str, Any]], keys: list[str]) -> str | None:
    """The key among `keys` with the lowest P99 (a row without a P99 never wins)."""
    have = [k for k in keys if k in rows and rows[k].get("p99_ms") is not None]
    return min(have, key=lambda k: rows[k]["p99_ms"]) if have else None
