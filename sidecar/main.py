"""`confgen-sidecar`: the daemon's lifecycle.

    startup   load the topology (refuse to start on an invalid one, printing every
              diagnostic); start the probe session, the admin client, every output
              (`sidecar.outputs.registry`: the publisher the flags select, then the ones the
              topology wants) and the gRPC server their servicers need; adopt what is
              already published (a restart changes nothing); start the HTTP server and the
              topology watcher
    loop      every interval (+- jitter): one daemon cycle (resolve, probe, decide, publish,
              then the cycle and the fleet view to every output)
    shutdown  on SIGTERM/SIGINT: everything started is undone in reverse by one exit stack
              (the watcher, the gRPC server, each output's `close`, the HTTP server, the
              sessions); exit 0

Exit codes: 0 stopped by a signal; 1 the topology is invalid; 2 refused to start for its flags or what
they name (a bad value, a publisher the topology does not take, an address or socket it cannot bind).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client.registry import CollectorRegistry

from confgen.errors import ConfgenError, Diagnostic, TopologyError
from confgen.model import GRPC_SOCKET, Topology, admin_reach, admin_socket, join_address
from confgen.topology import load as load_topology
from sidecar import config as config_mod
from sidecar.config import (
    ConfigError,
    SidecarConfig,
    grpc_listen_for,
    grpc_listen_mismatch,
    grpc_transport_for,
    listen_for,
    listen_mismatch,
    publisher_mismatch,
    xds_dir_for,
)
from sidecar.daemon import Daemon
from sidecar.logs import configure, log_event
from sidecar.observe.probe import Prober
from sidecar.observe.resolve import Resolver
from sidecar.observe.watch import TopologyWatcher
from sidecar.outputs.contract import Output, Publisher, Wiring
from sidecar.outputs.envoy_admin import UNIX_PREFIX, EnvoyAdmin
from sidecar.outputs.grpc import GrpcServer, Servicers, settings_for
from sidecar.outputs.registry import build, wanted
from sidecar.serve.bounds import HttpBounds, runner_options, start_site
from sidecar.serve.envoy_relay import add_envoy_relay
from sidecar.serve.guard import MutationGuard, is_loopback, load_token
from sidecar.serve.metrics import register
from sidecar.serve.server import build_app

__all__ = ["main", "run"]

_log = logging.getLogger("sidecar.main")
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def _admin_url(config: SidecarConfig, topo: Topology, xds_dir: Path | None) -> str:
    """Where Envoy's admin is: --envoy-admin, else the topology's: `unix:PATH` for its socket (admin.socket,
    else envoy-admin.sock in the xDS directory, which is Envoy's config directory), `http://host:port` when
    the topology puts it on TCP."""
    if config.envoy_admin:
        return config.envoy_admin
    path = admin_socket(topo, str(xds_dir or "."))  # no xDS directory (ADS, nginx): no Envoy admin is called
    if path is not None:
        return UNIX_PREFIX + path
    return f"http://{join_address(*admin_reach(topo))}"


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(seconds, 0.0)):
            await stop.wait()


def _warn_unused_service_flags(config: SidecarConfig, topo: Topology) -> None:
    """Flags for gRPC services the topology does not need, and a bind Envoy will not reach."""
    needed = wanted(topo)
    if config.picker and "picker" not in needed:
        log_event(_log, logging.WARNING, "startup.picker_unused", note="--picker is set but no pool uses "
                  "policy prefix_affinity: the endpoint picker does not run")
    if config.grpc_tls is not None and not needed and config.serve_xds is None:
        log_event(_log, logging.WARNING, "startup.grpc_tls_unused", note="--grpc-tls-cert is set but the "
                  "topology needs no gRPC service (no prefix_affinity pool, no global limit)")
    if needed and (problem := grpc_listen_mismatch(config, topo)) is not None:
        log_event(_log, logging.ERROR, "startup.grpc_listen_mismatch", problem=problem,
                  note="Envoy's calls fail: requests go unpicked (least_request), global limits fail open")


class _Refused(Exception):
    """Startup cannot go on: the reason is logged, `code` is the exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass(slots=True)
class _Running:
    """What startup built and the main loop drives."""

    config: SidecarConfig
    topo: Topology
    guard: MutationGuard
    admin_url: str
    xds_dir: Path | None
    serving: str | None = None  # --serve-xds: where the control plane listens
    late: contextlib.AsyncExitStack | None = None  # closed after the outputs: the HTTP server


def _load(config: SidecarConfig) -> tuple[Topology, list[Diagnostic], Path | None]:
    """Blocking: the topology and the file target's directory; _Refused when invalid."""
    try:
        topo, warnings = load_topology(config.topology)
        if (problem := publisher_mismatch(config, topo)) is not None:  # before the xDS directory it needs not
            log_event(_log, logging.ERROR, "startup.publisher_mismatch", problem=problem)
            raise _Refused(EXIT_USAGE)
        if config.nginx is not None:
            return topo, warnings, config.nginx.directory
        return topo, warnings, xds_dir_for(config, topo) if config.serve_xds is None else None
    except TopologyError as exc:
        log_event(_log, logging.ERROR, "startup.invalid_topology", file=str(config.topology),
                  errors=[str(d) for d in exc.diagnostics])
        raise _Refused(EXIT_INVALID) from exc
    except ConfigError as exc:
        log_event(_log, logging.ERROR, "startup.no_xds_dir", error=str(exc))
        raise _Refused(EXIT_USAGE) from exc


def _check(config: SidecarConfig, topo: Topology) -> tuple[SidecarConfig, MutationGuard]:
    """The flags against the topology: deprecations, the gRPC transport, the listen address, the
    admin token; the effective config and the mutation guard, or _Refused."""
    config = listen_for(config, topo)
    for note in config.deprecations:
        log_event(_log, logging.WARNING, "startup.deprecated", note=note)
    try:  # the gRPC surfaces' transport: the flags and the topology agree, or nothing starts
        if config.serve_xds is not None or wanted(topo):
            grpc_transport_for(config, topo)
    except ConfigError as exc:
        log_event(_log, logging.ERROR, "startup.grpc_transport", error=str(exc))
        raise _Refused(EXIT_USAGE) from exc
    mismatch = listen_mismatch(config, topo)
    if mismatch is not None:
        log_event(_log, logging.ERROR, "startup.listen_mismatch", problem=mismatch,
                  listen=f"{config.listen_host}:{config.listen_port}",
                  topology_sidecar=f"{topo.sidecar.address}:{topo.sidecar.port}")
    try:
        guard = MutationGuard(load_token(config.admin_token_file, config.admin_token_env),
                              remote=not is_loopback(config.listen_host))
    except ConfigError as exc:
        log_event(_log, logging.ERROR, "startup.bad_admin_token", error=str(exc))
        raise _Refused(EXIT_USAGE) from exc
    if guard.token is None:
        log_event(_log, logging.INFO, "startup.drains_off",
                  note="POST /drain and /undrain answer 403: give --admin-token-file or --admin-token-env to use them")
    return config, guard


async def _start_outputs(run: _Running, stack: contextlib.AsyncExitStack, registry: CollectorRegistry) -> Daemon:
    """The prober, every output (the publisher first) and the daemon, each closed by `stack`."""
    config, topo, loop = run.config, run.topo, asyncio.get_running_loop()
    prober = await stack.enter_async_context(Prober(
        max_concurrency=config.max_concurrency, deadline_s=config.probe_deadline_s,
        body_cap=config.body_cap_bytes, clock=loop.time))
    admin = await stack.enter_async_context(
        EnvoyAdmin(run.admin_url, timeout_s=min(1.0, config.confirm_timeout_s or 1.0)))
    run.late = await stack.enter_async_context(contextlib.AsyncExitStack())
    servicers = Servicers()
    wiring = Wiring(config, topo, lambda: daemon.topology, admin, registry, loop.time, servicers)
    _warn_unused_service_flags(config, topo)
    publisher, others = _build(wiring)
    daemon = Daemon(config, topo, prober=prober, resolver=Resolver(config.dns_timeout_s),
                    publisher=publisher, clock=loop.time, outputs=others)  # `wiring.topology` from here on
    await _start_each(run, publisher, others, stack)
    if servicers.names:
        await _serve_grpc(config, topo, servicers, stack)
    xds = publisher.status().xds
    run.serving = xds.listen if xds is not None else None
    await asyncio.to_thread(daemon.restore)  # what is published on disk, the drains of POST /drain
    return daemon


def _build(wiring: Wiring) -> tuple[Publisher, list[Output]]:
    """The outputs that run: the publisher the flags select (`SidecarConfig.publisher`) with its own
    (its limiter), then the ones the topology wants (`wanted`), in start order. _Refused (the reason
    logged) when one of those cannot be built (a bad --picker override)."""
    first = build(wiring.config.publisher, wiring)
    assert first.publisher is not None, f"OUTPUTS[{wiring.config.publisher!r}] builds no publisher"
    try:
        wanted_ = [build(name, wiring) for name in wanted(wiring.topo)]
    except ConfigError as exc:
        log_event(_log, logging.ERROR, "startup.grpc_failed", error=str(exc))
        raise _Refused(EXIT_USAGE) from exc
    return first.publisher, [output for built in (first, *wanted_) for output in built.outputs]


async def _start_each(run: _Running, publisher: Publisher, others: Sequence[Output],
                      stack: contextlib.AsyncExitStack) -> None:
    """Start the publisher then the others, each closed by `stack` (in reverse); _Refused (the
    reason logged) when one cannot start: a port it cannot bind, unusable certificates."""
    for output in (publisher, *others):
        try:
            await output.start()
        except (OSError, ConfgenError) as exc:
            if output is publisher:
                log_event(_log, logging.ERROR, "startup.listen_failed", publisher=run.config.publisher,
                          serve_xds=run.config.serve_xds, error=str(exc))
            else:
                log_event(_log, logging.ERROR, "startup.grpc_failed", output=output.name, error=str(exc))
            raise _Refused(EXIT_USAGE) from exc
        stack.push_async_callback(output.close)


async def _serve_grpc(config: SidecarConfig, topo: Topology, servicers: Servicers,
                      stack: contextlib.AsyncExitStack) -> None:
    """The sidecar's services gRPC server with every output's servicers, stopped by `stack` before
    the outputs close. A reload that adds the first prefix_affinity pool or global limit needs a
    restart to serve them. _Refused (the reason logged) when it cannot start."""
    try:
        settings = settings_for(grpc_transport_for(config, topo), grpc_listen_for(config, topo), GRPC_SOCKET)
        server = servicers.onto(GrpcServer(settings))
        await server.start()
    except (ConfigError, OSError) as exc:
        log_event(_log, logging.ERROR, "startup.grpc_failed", error=str(exc))
        raise _Refused(EXIT_USAGE) from exc
    stack.push_async_callback(server.stop)


async def _start_http(run: _Running, daemon: Daemon, stack: contextlib.AsyncExitStack,
                      registry: CollectorRegistry) -> str:
    """The HTTP server (/state, /readyz, /metrics, admin calls), stopped after the outputs; its address."""
    register(registry, daemon.view)
    app = build_app(daemon, registry, guard=run.guard)
    if run.config.nginx is None and run.config.serve_xds is None:  # an Envoy beside us (file xDS)
        add_envoy_relay(app, run.admin_url)
    bounds = HttpBounds()
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **runner_options(bounds))
    await runner.setup()
    stack.push_async_callback(runner.cleanup)  # `run.late`: the outputs close first
    try:
        await start_site(runner, run.config.listen_host, run.config.listen_port, bounds)
    except OSError as exc:
        log_event(_log, logging.ERROR, "startup.listen_failed", host=run.config.listen_host,
                  port=run.config.listen_port, error=str(exc))
        raise _Refused(EXIT_USAGE) from exc
    bound = runner.addresses[0]
    return f"{bound[0]}:{bound[1]}"


def _start_watcher(run: _Running, daemon: Daemon, stack: contextlib.AsyncExitStack) -> None:
    """The topology watcher; the shutdown log comes first on exit."""
    watcher = TopologyWatcher(run.config.topology, daemon.reload, debounce_s=run.config.watch_debounce_s)
    watcher.start()
    stack.push_async_callback(watcher.stop)
    stack.callback(log_event, _log, logging.INFO, "shutdown.begin")


async def _startup(run: _Running, stack: contextlib.AsyncExitStack, registry: CollectorRegistry) -> Daemon:
    """Everything the loop needs, started; what must be undone is on `stack`. _Refused on failure."""
    daemon = await _start_outputs(run, stack, registry)
    assert run.late is not None  # entered by _start_outputs
    listen = await _start_http(run, daemon, run.late, registry)
    _start_watcher(run, daemon, stack)
    guard = run.guard
    log_event(_log, logging.INFO, "startup.done", topology=run.topo.name, xds_dir=str(run.xds_dir),
              serve_xds=run.serving, envoy_admin=run.admin_url, listen=listen, interval_s=run.config.interval_s,
              mutations="token" if guard.token else "off (beyond loopback, no token)" if guard.remote
              else "loopback only")
    return daemon


async def _main_loop(run: _Running, daemon: Daemon, stop: asyncio.Event) -> None:
    """Every interval (+- jitter): one daemon cycle (which hands every output the cycle and its fleet view)."""
    loop, config, rng = asyncio.get_running_loop(), run.config, random.Random()
    while not stop.is_set():
        started = loop.time()
        await daemon.cycle()
        pause = config.interval_s * (1 + rng.uniform(-config.jitter, config.jitter))
        await _sleep_or_stop(stop, started + pause - loop.time())


async def run(config: SidecarConfig, stop: asyncio.Event | None = None,
              registry: CollectorRegistry | None = None) -> int:
    """Run until `stop` is set (or SIGTERM/SIGINT when on the main thread); the exit code."""
    stop = stop or asyncio.Event()
    try:
        topo, warnings, xds_dir = await asyncio.to_thread(_load, config)
        config, guard = _check(config, topo)
        for w in warnings:
            log_event(_log, logging.WARNING, "topology.warning", diagnostic=str(w))
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        running = _Running(config, topo, guard, _admin_url(config, topo, xds_dir), xds_dir)
        async with contextlib.AsyncExitStack() as stack:  # shutdown: everything started, in reverse
            daemon = await _startup(running, stack, registry or CollectorRegistry())
            await _main_loop(running, daemon, stop)
    except _Refused as refused:
        return refused.code
    log_event(_log, logging.INFO, "shutdown.done")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = config_mod.from_argv(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"confgen-sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure(config.log_format, config.log_level, sys.stderr)
    return asyncio.run(run(config))


if __name__ == "__main__":
    raise SystemExit(main())
