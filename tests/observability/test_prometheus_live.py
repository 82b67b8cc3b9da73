"""A real Prometheus (Debian's `prometheus`, never skipped) on loopback scrapes live sidecars
in front of the simulated fleet and the real Envoy, evaluates the shipped alert rules and
answers the dashboard's and the autoscaler's queries.

Bounded: one Prometheus process in its own tmp dir, 1 s scrape and evaluation intervals,
the rules' `for:` shortened to 2 s in a test copy; stopped by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from confgen.deploy._observability import alert_rules, dashboard
from confgen.deploy.kubernetes import queue_query
from confgen.runtime import free_port, stop_process
from tests.observability.promtools import promtool_parses, tool
from tests.observability.test_rules import dashboard_exprs, grafana_free
from tests.sidecar_live.glimits import call, global_rig
from tests.sidecar_live.rig import FAST_ARGS, SidecarProcess, http, live_rig, poll, worker_specs
from tests.sidecar_live.test_picker_live import chat, conversation_system, picker_rig


@contextlib.contextmanager
def prometheus(tmp: Path, jobs: dict[str, tuple[str, list[str]]]) -> Iterator[str]:
    """Prometheus scraping `jobs` (name -> (metrics path, targets)) every second with the
    shipped rules (for: 2s); yields its base URL."""
    rules = alert_rules()
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule["for"] = "2s"
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [{"job_name": name, "metrics_path": path, "static_configs": [{"targets": targets}]}
                           for name, (path, targets) in jobs.items()],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen([tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                            stdout=log, stderr=log, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            try:
                return http("GET", f"{url}/-/ready", timeout=1.0)[0] == 200
            except OSError:
                return False

        assert poll(ready, timeout=30, interval=0.2), (tmp / "prometheus.log").read_text()[-2000:]
        yield url
    finally:
        stop_process(proc)
        log.close()


def query(url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    status, _, body = http("GET", f"{url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=5.0)
    assert status == 200, body
    result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
    return result


def scalar(url: str, expr: str, at: float) -> float | None:
    result = query(url, expr, at)
    return float(result[0]["value"][1]) if result else None


def firing(url: str, name: str) -> list[dict[str, str]]:
    status, _, body = http("GET", f"{url}/api/v1/alerts", timeout=5.0)
    assert status == 200
    return [a["labels"] for a in json.loads(body)["data"]["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_prometheus_sees_one_queue_figure_for_two_replicas_dashboard_data_and_worker_down(tmp_path: Path) -> None:
    """Two sidecars (two proxy replicas) probe the same workers, each scraped for its metrics and its
    relay of Envoy's stats, every target up on every scrape; the autoscaler's query gives
    the same pool queue as one sidecar's series alone, where a plain sum doubles it; every
    dashboard query has data (Envoy's stats come through the sidecar's /envoy/stats), the
    TTFT, time-per-output-token and tokens/s panels per pool and model with values above 0
    (engine histograms re-exported by the sidecars) and the error ratios; killing a worker
    fires ConfgenWorkerDown for exactly that worker."""
    specs = worker_specs(["a", "b"], max_num_seqs=1, decode_ms=10.0)
    with live_rig(tmp_path, specs, sidecar_args=FAST_ARGS, capacity=1) as rig:
        listen2 = free_port()
        (tmp_path / "envoy2").mkdir()
        # its xDS directory is its own, its Envoy the rig's one (whose admin socket is in the rig's directory)
        second = SidecarProcess(["--topology", str(rig.topology_path), "--xds-dir", str(tmp_path / "envoy2"),
                                 "--envoy-admin", rig.envoy.admin_url, "--listen", f"127.0.0.1:{listen2}",
                                 *FAST_ARGS], tmp_path / "sidecar2.log", listen2)
        one, two = rig.sidecar.url.removeprefix("http://"), second.url.removeprefix("http://")
        second.start()
        try:
            # both sidecars relay Envoy's stats (one Envoy here: the rendered ServiceMonitor scrapes every pod's)
            jobs = {"sidecar": ("/metrics", [one, two]), "envoy": ("/envoy/stats", [one, two])}
            with prometheus(tmp_path, jobs) as prom, ThreadPoolExecutor(max_workers=4) as pool:
                for _ in range(6):  # Envoy's upstream histograms get data
                    assert rig.send()[0] == 200
                # three long requests to worker a (one slot): one runs, two wait for ~10 s
                direct = f"{rig.fleet.worker('a').url}/v1/completions"
                body = {"model": "sim-model", "prompt": "queue", "max_tokens": 400}
                jobs_a = [pool.submit(http, "POST", direct, body, 60.0) for _ in range(3)]
                plain = 'sum by (pool) (llm_queue_depth{pool="chat"})'
                alone = f'sum by (pool) (max by (pool, worker) (llm_queue_depth{{pool="chat",instance="{one}"}}))'

                def same_figure() -> bool:
                    at = time.time() - 1.0
                    figures = (scalar(prom, queue_query("chat"), at), scalar(prom, alone, at),
                               scalar(prom, plain, at))
                    same_figure.seen = figures  # type: ignore[attr-defined]
                    deduped, single, summed = figures
                    return deduped is not None and deduped >= 1 and deduped == single and summed == 2 * deduped

                assert poll(same_figure, timeout=20, interval=0.5), same_figure.seen  # type: ignore[attr-defined]
                for job in jobs_a:
                    job.result(timeout=60)
                pb = rig.worker_port("b")
                rig.fleet.worker("b").crash()
                assert poll(lambda: firing(prom, "ConfgenWorkerDown"), timeout=30, interval=0.5)
                down = firing(prom, "ConfgenWorkerDown")
                assert [(a["pool"], a["worker"], a["severity"]) for a in down] == [("chat", f"127.0.0.1:{pb}",
                                                                                    "warning")]
                assert firing(prom, "ConfgenPoolWithoutHealthyCapacity") == []
                # probe errors exist now too: every dashboard query has data, but for what the rig's
                # topology has none of: token buckets, outlier detection (off), a fallback chain
                # confgen_sidecar_ratelimit, ratelimit_confgen_global: no global limit in this rig (the global
                # limits test below reads them)
                # sheddable_refused_ratio: no sheddable traffic in this rig (test_priorities_live reads it)
                # confgen_picker / ext_proc: no prefix_affinity pool here (the picker fleet test below reads them)
                absent = ("local_rate_limit", "outlier_detection", "failover_upstream_rq_completed",
                          "confgen_sidecar_ratelimit", "ratelimit_confgen_global", "sheddable_refused_ratio",
                          "confgen_picker_", "ext_proc")
                empty = [e for e in dashboard_exprs() if not query(prom, grafana_free(e))
                         and not any(word in e for word in absent)]
                assert empty == [], empty
                assert len(dashboard()["panels"]) > 10
                # every target up on every scrape (the old relay's truncated text made the envoy job 0)
                scrapes = query(prom, "count_over_time(up[1m])")
                assert {(r["metric"]["job"], r["metric"]["instance"]) for r in scrapes} == {
                    (job, target) for job, (_, targets) in jobs.items() for target in targets}, scrapes
                assert query(prom, "min_over_time(up[1m]) < 1") == []
                # the LLM panels: TTFT and TPOT quantiles, tokens/s and error ratios per pool and
                # model, from the simulated engines' histograms re-exported by the sidecars
                llm = {title: [grafana_free(t["expr"]) for t in panel["targets"]]
                       for panel in dashboard()["panels"] for title in [panel["title"]]
                       if title.startswith(("Time to first token", "Time per output token", "Output tokens",
                                            "Error ratio"))}
                assert len(llm) == 4, sorted(llm)
                for title, exprs in llm.items():
                    for expr in exprs:
                        result = query(prom, expr)
                        assert result, (title, expr)
                        if not title.startswith("Error ratio"):
                            assert {(r["metric"]["pool"], r["metric"]["model"]) for r in result} == {
                                ("chat", "sim-model")}, (title, result)
                            assert all(float(r["value"][1]) > 0 for r in result), (title, result)
        finally:
            assert second.stop() == 0, second.log_tail()


# Dashboard queries a picker fleet cannot answer cheaply, each with its reason (matched as words of the expression).
PICKER_FLEET_ABSENT = {
    "local_rate_limit": "no token bucket in this topology",
    "outlier_detection": "outlier detection is off in the live rigs (the sidecar alone decides health)",
    "failover_upstream_rq_completed": "no fallback chain in this topology",
    "confgen_sidecar_ratelimit": "no global limit (test_prometheus_answers_the_global_limit_panels_per_key reads them)",
    "ratelimit_confgen_global": "no global limit: Envoy has no rate limit check to fail open",
    "sheddable_refused_ratio": "no sheddable traffic (tests/sidecar_live/test_priorities_live.py reads it)",
    "confgen_picker_refused": "no overload here (tests/sidecar/test_picker_predict.py pins the picker's refusals)",
    "confgen_picker_budget_checks": "no global limit (test_prometheus_answers_the_global_limit_panels_per_key)",
    "confgen_picker_held": "no pool has every slot taken here (tests/sidecar_live/test_picker_live.py holds requests)",
    "confgen_picker_lobby": "nobody waits in the picker here (the same live test)",
}


def test_prometheus_answers_every_dashboard_panel_for_a_picker_fleet(tmp_path: Path) -> None:
    """A prefix_affinity fleet (real Envoy, the sidecar's picker, the simulated engines): the sidecar's
    /metrics and its relay of Envoy's stats pass promtool whole; a real Prometheus scraping both every
    second has each job up on every scrape, and every query of every dashboard panel (the picker row
    included: hit ratio, picks by reason, fallbacks, pick latency, in-flight) returns data, but for the
    listed series this topology cannot have."""
    with picker_rig(tmp_path, worker_specs(["a", "b"])) as rig:
        for path in ("/metrics", "/envoy/stats"):
            status, body = rig.sidecar.get(path)
            assert status == 200, (path, body[:300])
            ok, why = promtool_parses(body)
            assert ok, (path, why)
        side = rig.sidecar.url.removeprefix("http://")
        jobs = {"sidecar": ("/metrics", [side]), "envoy": ("/envoy/stats", [side])}
        with prometheus(tmp_path, jobs) as prom:
            # one scrape of each job before the traffic, so that rates see it rise
            assert poll(lambda: len(query(prom, "up == 1")) == 2, timeout=20, interval=0.2)
            for i in range(3):  # conversations that come back: picks by prefix, matched blocks
                messages = [{"role": "system", "content": conversation_system(i)}]
                for turn in range(3):
                    messages.append({"role": "user", "content": f"turn {turn}"})
                    assert chat(rig, messages)[0] == 200
            # until the engines' latencies are learned, picks use the weighted rule; then a prediction
            # is compared with each finished request (the predictor panel)

            def predicted() -> bool:
                assert chat(rig, [{"role": "user", "content": "one more"}])[0] == 200
                return "confgen_picker_predicted_seconds_total{" in str(rig.sidecar.get("/metrics")[1])

            assert poll(predicted, timeout=30, interval=0.5), rig.sidecar.log_tail()
            # a GET on the pool's route reaches the picker without a body: left to Envoy (unpicked no_body)
            http("GET", f"http://127.0.0.1:{rig.port}/v1/chat/completions", timeout=10.0)
            rig.fleet.worker("b").crash()  # probe errors and an unhealthy worker for their panels
            exprs = [(panel["title"], grafana_free(t["expr"])) for panel in dashboard()["panels"]
                     for t in panel.get("targets", [])]
            wanted = [(title, e) for title, e in exprs if not any(word in e for word in PICKER_FLEET_ABSENT)]
            assert any("confgen_picker_" in e for _, e in wanted)

            def empty() -> list[tuple[str, str]]:
                missing = [(title, e) for title, e in wanted if not query(prom, e)]
                empty.seen = missing  # type: ignore[attr-defined]
                return missing

            assert poll(lambda: not empty(), timeout=30, interval=1.0), empty.seen  # type: ignore[attr-defined]
            hit_ratio = grafana_free(next(e for t, e in exprs if t.startswith("Prefix-cache hit ratio")))

            def ratio() -> list[float]:
                ratio.seen = [float(r["value"][1]) for r in query(prom, hit_ratio)]  # type: ignore[attr-defined]
                return ratio.seen  # type: ignore[attr-defined]

            # turns 2 and 3 of each conversation go home: their earlier blocks match
            assert poll(lambda: any(0 < v <= 1 for v in ratio()), timeout=10, interval=0.5), ratio.seen  # type: ignore[attr-defined]
            scrapes = query(prom, "count_over_time(up[1m])")
            down = query(prom, "min_over_time(up[1m]) < 1")
            assert {r["metric"]["job"] for r in scrapes} == {"sidecar", "envoy"} and down == [], (scrapes, down)


def global_limit_panels() -> list[dict[str, Any]]:
    """The dashboard's global limit panels: "Global limits: ..." and every panel of the row "Global limits per key"."""
    out, in_row = [], False
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            in_row = panel["title"] == "Global limits per key"
        elif in_row or panel["title"].startswith("Global limits"):
            out.append(panel)
    return out


def test_prometheus_answers_the_global_limit_panels_per_key(tmp_path: Path) -> None:
    """One Envoy and its sidecar counting in a real Redis, a real Prometheus scraping the sidecar's
    /metrics and its relay of Envoy's stats: keys admitted and refused, tokens charged; Redis killed
    (the sidecar decides on its floor); then the sidecar paused (SIGSTOP, by its pid) for 2 s: Envoy's
    checks fail open and its ceiling refuses past twice the budget. Every query of every global limit
    panel (the row "Global limits per key" and the store panel) returns data, so a query naming a
    metric neither the sidecar nor Envoy exports fails here; the per-key series carry the topology's
    clients and the figures the traffic made."""
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 3}
    with global_rig(tmp_path, envoys=1) as rig:
        pair, sidecar = rig.pairs[0], rig.pairs[0].sidecar
        assert sidecar is not None and sidecar.proc is not None
        side = sidecar.url.removeprefix("http://")
        jobs = {"sidecar": ("/metrics", [side]), "envoy": ("/envoy/stats", [side])}
        with prometheus(tmp_path, jobs) as prom, ThreadPoolExecutor(max_workers=16) as pool:
            assert poll(lambda: len(query(prom, "up == 1")) == 2, timeout=20, interval=0.2)
            # 8 at once on a key of 5 a second, from the start of a wall-clock second (the budget's fixed
            # window): 5 admitted, 3 refused however slow the machine (one by one, a loaded CI machine
            # answered fewer than 6 a second and the window never filled)
            time.sleep(1.0 - time.time() % 1.0 + 0.01)
            statuses = list(pool.map(lambda _: call(pair.url, "sec", body)[0], range(8)))
            assert 200 in statuses and 429 in statuses, statuses
            assert call(pair.url, "tok", body)[0] == 200  # a token budget: its usage charged at the answer's end
            assert poll(lambda: "tokens_charged_total{" in sidecar.metrics(), timeout=10, interval=0.2)
            rig.redis.kill()
            try:  # the local floor: 60 an hour / 2 (limits.store.envoys' default) on this sidecar
                assert [call(pair.url, "reqh", body)[0] for _ in range(3)] == [200] * 3
            finally:
                rig.redis.restart()
            os.kill(sidecar.proc.pid, signal.SIGSTOP)
            try:  # 16 at once on a key of 5 a second, its checks failing open: its ceiling (10) refuses the rest
                paused = list(pool.map(lambda _: call(pair.url, "sec", body)[0], range(16)))
            finally:
                os.kill(sidecar.proc.pid, signal.SIGCONT)
            assert set(paused) <= {200, 429} and 429 in paused, paused
            panels = global_limit_panels()
            assert {p["title"].split(":")[0].split(" (")[0] for p in panels} >= {
                "Global limits", "Admitted and refused per second per key",
                "Tokens charged per second per key and unit", "Floor decisions per key", "Envoy"}, panels
            exprs = [(panel["title"], grafana_free(t["expr"])) for panel in panels for t in panel["targets"]]
            assert len(exprs) >= 7

            def empty() -> list[tuple[str, str]]:
                missing = [(title, e) for title, e in exprs if not query(prom, e)]
                empty.seen = missing  # type: ignore[attr-defined]
                return missing

            assert poll(lambda: not empty(), timeout=30, interval=1.0), empty.seen  # type: ignore[attr-defined]

            def series(expr: str) -> dict[tuple[str, ...], float]:
                return {tuple(r["metric"].values()): float(r["value"][1]) for r in query(prom, expr)}

            decided = series("sum by (client, code) "
                             '(confgen_sidecar_ratelimit_key_decisions_total{budget="client/sec/0"})')
            assert decided[("sec", "ok")] >= 5 and decided[("sec", "over_limit")] >= 1, decided
            charged = series("sum by (client, unit) (confgen_sidecar_ratelimit_tokens_charged_total)")
            assert charged.get(("tok", "total_tokens"), 0) > 0, charged
            floor = series("sum by (client, code) (confgen_sidecar_ratelimit_fail_open_total)")
            assert floor == {("reqh", "ok"): 3}, floor
            clients = {r["metric"]["client"] for r in query(prom, "confgen_sidecar_ratelimit_key_decisions_total")}
            assert clients == {"sec", "tok", "reqh"}, clients
            failed_open = series("sum by (envoy_cluster_name) "
                                 "(envoy_cluster_ratelimit_confgen_global_failure_mode_allowed)")
            assert failed_open.get(("chat",), 0) >= 16, failed_open
            ceiling = series("sum(envoy_http_local_rate_limit_rate_limited"
                             '{envoy_local_http_ratelimit_prefix="confgen_ceiling"})')
            assert ceiling.get((), 0) == paused.count(429), ceiling
