"""Put the sidecar's health decisions into nginx: `upstreams/<pool>.conf` plus a graceful reload.

Open-source nginx has no API for its upstreams: a server list changes only when nginx
re-reads its config (SIGHUP), which starts new workers and lets the old ones finish their
in-flight requests. A reload costs (new workers, cold keep-alive pools, and keep-alive
clients can race the idle connections old workers close), so:

- Only health reaches the file: UNHEALTHY and DRAINING endpoints are `down`, HEALTHY and
  DEGRADED are up, and each server keeps the topology's static weight (what `confgen
  render` writes). Load-aware weights stay out, so weight jitter never reloads nginx.
  The pool-level ejection cap of `state.decide_pool` has already been applied, and
  nginx's own passive checks (`max_fails`) stay in the file as the safety net.
- The file is rendered only by `confgen.nginx.render_upstream` with the pool's
  `upstream_options`, so on a healthy fleet it is byte-identical to what `render` wrote:
  a sidecar (re)start with nothing to change writes and reloads nothing.
- Rate limit: at most one reload per `reload_min_interval_s`. Changes arriving within it
  (any pool) are coalesced into the next reload; a change undone before then (a flap)
  cancels it.
- Check before use: the candidate file is written beside the live one and `nginx -t`
  runs on a copy of the live `nginx.conf` whose include of that pool names the candidate
  (same directory, same prefix, so every other path resolves as for the master). The
  live file is never an untested one, even for a moment. A refused candidate is logged
  at error level, counted (`confgen_sidecar_nginx_reload_failures_total{stage="test"}`),
  listed in /readyz's body (a problem, never a readiness failure), and not tested again
  until the render changes; the old file and nginx's running config stay.
- Reload: the live file is replaced atomically (`confgen.output.atomic_write`), the
  master (pid file or pid) gets SIGHUP, and the reload counts as done only once the
  master has new worker processes (read from /proc). No new workers within
  `confirm_timeout_s` (nginx refused the config itself, or the signal went nowhere) is
  reported the same loud way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import signal
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from confgen.binaries import NGINX_PROBLEM, child_pids, find_nginx, read_pid_file
from confgen.endpoints import Endpoint
from confgen.errors import BinaryNotFoundError
from confgen.model import Topology
from confgen.nginx import Templates, UpstreamServer, render_upstream, upstream_options, upstream_path
from confgen.output import atomic_write
from sidecar.config import ConfigError
from sidecar.config.nginx import NginxSettings
from sidecar.logs import log_event
from sidecar.outputs.contract import Built, OutputStatus, Wiring, published

if TYPE_CHECKING:
    from sidecar.fleet import Cycle, Snapshot

__all__ = ["NginxCollector", "NginxPublisher", "build", "register_nginx"]

_log = logging.getLogger("sidecar.nginx")
_POLL_S = 0.02
_DOWN = frozenset({"UNHEALTHY", "DRAINING"})
_CANDIDATE = ".{name}.sidecar-candidate"  # beside the live file; a dot name nginx never includes


@dataclass(frozen=True, slots=True)
class _Outcome:
    ok: bool
    detail: str
    # nginx -t ran and refused the candidate (a config error); False for a test that could not run or
    # finish (no binary, a timeout, a file that could not be prepared): tried again next time, not kept
    # refused until the render changes
    refused: bool = False




class NginxPublisher:
    """Writes upstream files, checks them with `nginx -t`, reloads nginx (rate-limited): a `Publisher`.

    `offer` only records the newest endpoints of a pool; one flusher task renders them,
    reads the live files, writes candidates and fsyncs, all in threads, so the event loop
    never blocks on a file or a render.
    """

    name = "nginx"

    def __init__(self, settings: NginxSettings, topology: Callable[[], Topology]) -> None:
        self.settings = settings
        self._topology = topology
        self._templates = Templates()  # compiled once, for every upstream write
        self._binary: Path | None = settings.binary
        self._written: dict[str, bytes | None] = {}  # what the live file holds (None: absent)
        self._offers: dict[str, list[Endpoint]] = {}  # newest endpoints per pool, not rendered yet
        self._pending: dict[str, bytes] = {}
        self._refused: dict[str, bytes] = {}  # last candidate nginx -t refused, per pool
        self._last_attempt_at: float | None = None
        self._reload_owed = False  # a file changed on disk but nginx did not take it yet
        self._flusher: asyncio.Task[None] | None = None
        self.publishes: Counter[str] = Counter()  # upstream files replaced, per pool
        self.rejections: Counter[str] = Counter()  # candidates nginx -t refused, per pool
        self.rejected: set[str] = set()  # pools whose newest candidate was refused
        self.reloads = 0  # confirmed reloads
        self.failures: Counter[str] = Counter()  # by stage: include, test, write, signal, confirm
        self._reload_problem: str | None = None
        self.unincluded: set[str] = set()  # pools nginx.conf does not include (added by a topology reload)

    # -- what the daemon calls --------------------------------------------------------------

    def servers(self, pool: str, endpoints: Sequence[Endpoint]) -> list[UpstreamServer] | None:
        """The pool's servers as nginx should see them; None when the pool left the topology."""
        try:
            spec = self._topology().pool(pool)
        except KeyError:
            return None
        static = {w.address: w.weight for w in spec.workers}
        return [
            UpstreamServer(ep.address, ep.port, weight=static.get(ep.worker, 1), down=ep.health in _DOWN,
                           worker=ep.worker)
            for ep in endpoints
        ]

    def render(self, pool: str, endpoints: Sequence[Endpoint]) -> bytes | None:
        servers = self.servers(pool, endpoints)
        if servers is None:
            return None
        return render_upstream(pool, servers, templates=self._templates,
                               **upstream_options(self._topology().pool(pool)))

    async def start(self) -> None:
        """Nothing to open: nginx is signalled on demand."""

    def adopt(self, pool: str) -> list[Endpoint]:
        """Nothing to adopt: the files hold health only, which the first probe cycle re-derives."""
        return []

    async def apply(self, cycle: Cycle) -> None:
        """Nothing more: the cycle's endpoints came through `offer` / `publish_all`."""

    def update(self, fleet: Snapshot) -> None:
        """Nothing: it publishes what the daemon decided, not the fleet view."""

    def status(self) -> OutputStatus:
        return OutputStatus(problems=tuple(self.problems()),
                            pools=published(self.publishes, self.rejections, self.rejected))

    def offer(self, pool: str, endpoints: Sequence[Endpoint]) -> None:
        """Schedule `pool`'s file if its health picture differs from what nginx has (decided
        by the flusher, which renders and compares off the event loop)."""
        if not endpoints:
            log_event(_log, logging.WARNING, "nginx.empty_refused", pool=pool,
                      note="no endpoint to publish; keeping the current file")
            return
        self._offers[pool] = list(endpoints)
        self._schedule()

    def check_reload(self, old: Topology, new: Topology) -> Callable[[], None]:
        """Any topology can follow: only the pools' upstream files are the sidecar's."""
        return lambda: None

    async def publish_all(self, topo: Topology, endpoints: Mapping[str, Sequence[Endpoint]]) -> bool:
        """nginx.conf is the operator's (rendered by `confgen render`): only the pools' files follow."""
        for pool, members in endpoints.items():
            self.offer(pool, members)
        return True

    def forget(self, pool: str) -> None:
        """A pool left the topology: drop its bookkeeping."""
        for table in (self._written, self._offers, self._pending, self._refused):
            table.pop(pool, None)
        self.rejected.discard(pool)
        self.unincluded.discard(pool)
        self.publishes.pop(pool, None)
        self.rejections.pop(pool, None)

    async def check_published(self) -> bool:
        return True  # (Publisher interface) what is served is held in memory or re-derived each cycle

    def problems(self) -> list[str]:
        """Why nginx does not run what the sidecar decided ([] when it does)."""
        out = [f"last {pool} upstream refused by nginx -t" for pool in sorted(self.rejected)]
        out += [f"pool {pool} is not in nginx.conf (added by a topology reload?): re-render nginx.conf "
                "(`confgen render --target nginx`) and reload nginx" for pool in sorted(self.unincluded)]
        if self._reload_problem is not None:
            out.append(self._reload_problem)
        return out

    async def close(self, grace_s: float = 2.0) -> None:
        """Let a reload in progress finish, then stop (a rate-limit wait is just cancelled)."""
        task = self._flusher
        if task is None:
            return
        _done, still = await asyncio.wait([task], timeout=grace_s)
        for pending in still:
            pending.cancel()
        await asyncio.gather(*still, return_exceptions=True)

    # -- the reload loop --------------------------------------------------------------------

    def _path(self, pool: str) -> Path:
        return self.settings.directory / upstream_path(pool)

    def _live(self, pool: str) -> bytes | None:
        """What the live file holds now, read again each time (blocking: from `_render_offers`' thread): an
        operator who re-renders the directory by hand (`confgen render --target nginx`, as the sidecar's own
        problem text advises) replaces it under the sidecar, and a memory of it would then say "unchanged"
        to the very candidate that would mark a dead worker down again."""
        try:
            data: bytes | None = self._path(pool).read_bytes()
        except FileNotFoundError:
            data = None
        self._written[pool] = data
        return data

    def _schedule(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="nginx-reload")
            self._flusher.add_done_callback(self._flushed)

    def _flushed(self, task: asyncio.Task[None]) -> None:
        if self._flusher is task:
            self._flusher = None
        if not task.cancelled() and (exc := task.exception()) is not None:
            log_event(_log, logging.ERROR, "nginx.reload_crashed", error=f"{type(exc).__name__}: {exc}")

    def _render_offers(self, offers: Mapping[str, list[Endpoint]]) -> dict[str, tuple[bytes, bytes | None]]:
        """(candidate, live bytes) per offered pool still in the topology (blocking: run in a thread)."""
        out: dict[str, tuple[bytes, bytes | None]] = {}
        for pool, endpoints in offers.items():
            data = self.render(pool, endpoints)
            if data is not None:
                out[pool] = (data, self._live(pool))
        return out

    async def _take_offers(self) -> None:
        offers, self._offers = self._offers, {}
        rendered = await asyncio.to_thread(self._render_offers, offers)
        for pool, (data, live) in rendered.items():
            if pool in self._offers:
                continue  # a newer offer arrived meanwhile: it decides
            if data == live:
                self._pending.pop(pool, None)  # a change undone before its reload: nothing to do
                self._refused.pop(pool, None)
                self.unincluded.discard(pool)
            elif data != self._refused.get(pool):  # nginx -t refused exactly this: do not test it again
                self._pending[pool] = data

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._offers or self._pending or self._reload_owed:
            if self._offers:
                await self._take_offers()
                continue
            if self._last_attempt_at is not None:
                wait = self._last_attempt_at + self.settings.reload_min_interval_s - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)  # changes arriving meanwhile join this reload
                    continue
            batch = {pool: data for pool, data in self._pending.items() if data != self._written.get(pool)}
            self._pending.clear()
            if not batch and not self._reload_owed:
                continue
            self._last_attempt_at = loop.time()
            if batch:
                batch = await self._drop_unincluded(batch)
            if batch:
                batch = await self._checked(batch)
                if not batch or not await self._install(batch):
                    continue
            await self._reload()

    async def _checked(self, batch: Mapping[str, bytes]) -> dict[str, bytes]:
        """The part of `batch` nginx -t accepts: all of it, or, when it refuses a batch of several pools,
        each pool tested alone (one pool's bad file must not hold back the others' changes, nor be blamed
        on them); empty when the test could not run."""
        checked = await self._check(batch, record=len(batch) == 1)
        if checked.ok:
            return dict(batch)
        if not checked.refused or len(batch) == 1:
            return {}
        return {pool: data for pool, data in batch.items() if (await self._check({pool: data})).ok}

    async def _drop_unincluded(self, batch: Mapping[str, bytes]) -> dict[str, bytes]:
        """`batch` without the pools nginx.conf does not include (a pool a topology reload added:
        nginx.conf is the operator's render and routes nothing to it). Each is reported once per
        render of its file; the other pools' changes go ahead (one pool missing from nginx.conf
        used to make every pool's batch fail its test)."""
        try:
            conf_text = await asyncio.to_thread(self.settings.conf.read_text)
        except OSError:
            return dict(batch)  # the test says why
        kept = {}
        for pool, data in batch.items():
            live = self._path(pool)
            if re.search(rf"\binclude\s+{re.escape(str(live))}\s*;", conf_text):
                kept[pool] = data
                continue
            self.failures["include"] += 1
            self.unincluded.add(pool)
            self._refused[pool] = data  # not tried again until its render changes or nginx.conf includes it
            log_event(_log, logging.ERROR, "nginx.pool_not_in_conf", pool=pool, conf=str(self.settings.conf),
                      file=str(live), note="nginx.conf has no include for this pool (a topology reload added it?): "
                      "re-render nginx.conf with `confgen render --target nginx` and reload nginx; the sidecar "
                      "only rewrites the pools' upstream files")
        return kept

    async def _check(self, batch: Mapping[str, bytes], record: bool = True) -> _Outcome:
        """`nginx -t` on the live nginx.conf with `batch`'s candidates in place of the live files; a refusal
        is recorded against each of its pools (`record`: else the caller tests them one by one)."""
        try:
            shadow, made = await asyncio.to_thread(self._write_candidates, batch)
            try:
                outcome = await self._nginx_test(shadow)
            finally:
                await asyncio.to_thread(_unlink_all, made)
        except _IncludeMissingError as exc:
            self.failures["include"] += 1
            outcome = _Outcome(False, str(exc), refused=True)
        except OSError as exc:
            self.failures["test"] += 1
            outcome = _Outcome(False, f"cannot prepare the test: {exc}")
        if outcome.ok:
            return outcome
        if not outcome.refused:  # the test did not run or finish: the same candidate is tried again
            log_event(_log, logging.ERROR, "nginx.test_unavailable", pools=sorted(batch),
                      conf=str(self.settings.conf), error=outcome.detail.splitlines()[:3],
                      note="nothing written; the candidate is tried again on the next cycle")
            return outcome
        if not record:
            return outcome
        for pool, data in batch.items():
            self.rejections[pool] += 1
            self.rejected.add(pool)
            self._refused[pool] = data
        log_event(_log, logging.ERROR, "nginx.test_failed", pools=sorted(batch), conf=str(self.settings.conf),
                  errors=outcome.detail.splitlines()[:10],
                  note="candidate refused; the live upstream files and nginx's running config are kept")
        return outcome

    def _write_candidates(self, batch: Mapping[str, bytes]) -> tuple[Path, list[Path]]:
        """Candidate files and a copy of nginx.conf including them: (the copy, every file made).
        Blocking (reads, fsyncs): run in a thread; the caller removes the files afterwards."""
        conf_text = self.settings.conf.read_text()
        made: list[Path] = []
        try:
            for pool, data in batch.items():
                live = self._path(pool)
                candidate = live.with_name(_CANDIDATE.format(name=live.name))
                include = re.compile(rf"(\binclude\s+){re.escape(str(live))}\s*;")
                # A function replacement: the path is taken literally, never as a template.
                conf_text, count = include.subn(functools.partial(_include_line, candidate), conf_text)
                if count == 0:
                    raise _IncludeMissingError(
                        f"{self.settings.conf} has no `include {live};`: the sidecar only rewrites files "
                        "the running config includes by that absolute path (mount the directory at the "
                        "same path for nginx and the sidecar)")
                atomic_write(candidate, data)
                made.append(candidate)
            shadow = self.settings.conf.with_name(f".{self.settings.conf.name}.sidecar-test")
            atomic_write(shadow, conf_text.encode())
            made.append(shadow)
        except BaseException:
            _unlink_all(made)
            raise
        return shadow, made

    async def _nginx_test(self, conf: Path) -> _Outcome:
        try:
            binary = self._binary or find_nginx()
        except BinaryNotFoundError as exc:
            self.failures["test"] += 1
            return _Outcome(False, str(exc))
        self._binary = binary
        args = [str(binary), "-t", "-q", "-p", f"{self.settings.prefix}/", "-c", str(conf), "-e", "stderr"]
        proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(self.settings.test_timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            self.failures["test"] += 1
            return _Outcome(False, f"nginx -t did not finish within {self.settings.test_timeout_s:g} s")
        if proc.returncode == 0:
            return _Outcome(True, "")
        self.failures["test"] += 1
        text = (err + out).decode(errors="replace")
        lines = [line for line in text.splitlines() if NGINX_PROBLEM.search(line)]
        return _Outcome(False, "\n".join(lines) or text.strip() or f"nginx -t exited {proc.returncode}",
                        refused=True)

    async def _install(self, batch: Mapping[str, bytes]) -> bool:
        """Replace the live files with the checked bytes, all before the one reload."""
        for pool, data in batch.items():
            path = self._path(pool)
            try:
                await asyncio.to_thread(atomic_write, path, data)
            except OSError as exc:
                self.failures["write"] += 1
                self._reload_problem = f"cannot write {path}: {exc}"
                log_event(_log, logging.ERROR, "nginx.write_failed", pool=pool, file=str(path), error=str(exc))
                return False
            self._written[pool] = data
            self.rejected.discard(pool)
            self.unincluded.discard(pool)
            self._refused.pop(pool, None)
            self.publishes[pool] += 1
            self._reload_owed = True
            log_event(_log, logging.INFO, "nginx.upstream_written", pool=pool, file=str(path),
                      down=data.count(b" down;"))
        return True

    def _master_pid(self) -> int:
        if self.settings.pid is not None:
            return self.settings.pid
        assert self.settings.pid_file is not None  # NginxSettings wants one of the two
        return read_pid_file(self.settings.pid_file)

    async def _reload(self) -> None:
        """SIGHUP the master and wait for its new workers."""
        loop = asyncio.get_running_loop()
        try:
            pid = await asyncio.to_thread(self._master_pid)
            before = await asyncio.to_thread(child_pids, pid)
            os.kill(pid, signal.SIGHUP)
            self._last_attempt_at = loop.time()  # the interval runs from one signal to the next
        except (OSError, ValueError) as exc:
            self.failures["signal"] += 1
            self._reload_problem = f"nginx reload not sent: {exc}"
            log_event(_log, logging.ERROR, "nginx.signal_failed", error=str(exc),
                      pid_file=str(self.settings.pid_file), pid=self.settings.pid,
                      note="the upstream files are updated on disk; retrying at the next change or interval")
            return
        self._reload_owed = False
        sent = loop.time()
        deadline = sent + self.settings.confirm_timeout_s
        while loop.time() < deadline:
            children = await asyncio.to_thread(child_pids, pid)
            if children - before:
                self.reloads += 1
                self._reload_problem = None
                log_event(_log, logging.INFO, "nginx.reloaded", pid=pid, new_workers=len(children - before),
                          old_workers_left=len(children & before), after_s=round(loop.time() - sent, 3))
                return
            await asyncio.sleep(_POLL_S)
        self.failures["confirm"] += 1
        self._reload_problem = f"nginx reload not confirmed: no new worker within {self.settings.confirm_timeout_s:g} s"
        log_event(_log, logging.ERROR, "nginx.reload_unconfirmed", pid=pid, timeout_s=self.settings.confirm_timeout_s,
                  note="nginx may have refused the config (see its error log) and keeps the old one")


def _unlink_all(paths: Sequence[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _include_line(candidate: Path, match: re.Match[str]) -> str:
    return f"{match[1]}{candidate};"


class _IncludeMissingError(Exception):
    """nginx.conf does not include a pool's file at the path the sidecar writes."""


class NginxCollector(Collector):
    """The nginx publisher's counters, read at scrape time."""

    def __init__(self, publisher: NginxPublisher) -> None:
        self._publisher = publisher

    def collect(self) -> Iterator[Metric]:
        pub = self._publisher
        reloads = CounterMetricFamily("confgen_sidecar_nginx_reloads", "nginx reloads confirmed (new workers seen).")
        reloads.add_metric([], pub.reloads)
        failures = CounterMetricFamily("confgen_sidecar_nginx_reload_failures",
                                       "Reloads not done, by stage: include (nginx.conf lacks the file), test "
                                       "(nginx -t refused), write (upstream file), signal (no master), confirm "
                                       "(no new workers).",
                                       labels=["stage"])
        for stage in ("include", "test", "write", "signal", "confirm"):
            failures.add_metric([stage], pub.failures[stage])
        writes = CounterMetricFamily("confgen_sidecar_nginx_upstream_writes", "Upstream files replaced.",
                                     labels=["pool"])
        for pool, count in sorted(pub.publishes.items()):
            writes.add_metric([pool], count)
        yield from (reloads, failures, writes)


def register_nginx(registry: CollectorRegistry, publisher: NginxPublisher) -> NginxCollector:
    collector = NginxCollector(publisher)
    registry.register(collector)
    return collector


def build(wiring: Wiring) -> Built:
    """The nginx publisher (`sidecar.outputs.registry.OUTPUTS["nginx"]`), its metrics registered; nginx
    keeps its own safety caps (limit_conn), so there is no limiter."""
    if wiring.config.nginx is None:
        raise ConfigError("the nginx publisher needs --target nginx settings")
    publisher = NginxPublisher(wiring.config.nginx, wiring.topology)
    register_nginx(wiring.registry, publisher)
    return Built((), publisher=publisher)
