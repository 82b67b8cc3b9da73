"""`confgen-sidecar`: the daemon's lifecycle.

    startup   load the topology (refuse to start on an invalid one, printing every
              diagnostic); adopt the EDS files already published (a restart changes
              nothing); start the probe session, the admin client, the HTTP server and
              the topology watcher
    loop      every interval (+- jitter): resolve, probe, decide, weigh, publish
    shutdown  on SIGTERM/SIGINT: stop the watcher, let a write in progress finish, close
              the sessions, stop the server; exit 0
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from aiohttp import web
from prometheus_client.registry import CollectorRegistry

from confgen.errors import ConfgenError, TopologyError
from confgen.model import GRPC_SOCKET, Topology
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
    xds_dir_for,
)
from sidecar.daemon import Daemon
from sidecar.logs import configure, log_event
from sidecar.observe.probe import Prober
from sidecar.observe.resolve import Resolver
from sidecar.observe.watch import TopologyWatcher
from sidecar.outputs.envoy_admin import EnvoyAdmin
from sidecar.outputs.grpc import GrpcServer, settings_for
from sidecar.outputs.publisher import Limiter, Wiring
from sidecar.outputs.publisher import build as build_publisher
from sidecar.outputs.service import Service, ServiceWiring, wanted
from sidecar.outputs.service import build as build_service
from sidecar.serve.bounds import HttpBounds, runner_options, start_site
from sidecar.serve.envoy_relay import add_envoy_relay
from sidecar.serve.guard import MutationGuard, is_loopback, load_token
from sidecar.serve.metrics import register
from sidecar.serve.server import build_app

__all__ = ["main", "run"]

_log = logging.getLogger("sidecar.main")
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def _admin_url(config: SidecarConfig, host: str, port: int) -> str:
    if config.envoy_admin:
        return config.envoy_admin
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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


async def _start_services(config: SidecarConfig, topo: Topology,
                          wiring: ServiceWiring) -> tuple[list[Service], GrpcServer]:
    """The gRPC services the topology needs (SERVICES), on the sidecar's one gRPC server, started.
    A reload that adds the first prefix_affinity pool or global limit needs a restart to start
    them. ConfigError or OSError when a service or the server cannot start (nothing left running)."""
    services = [build_service(name, wiring) for name in wanted(topo)]
    server = GrpcServer(settings_for(grpc_transport_for(config, topo), grpc_listen_for(config, topo), GRPC_SOCKET))
    started: list[Service] = []
    try:
        for service in services:
            server.add(service.add_to, service.name)
            await service.start()
            started.append(service)
        await server.start()
    except (ConfigError, OSError):
        for service in started:
            await service.close()
        raise
    return services, server


async def _watch_limits(limiter: Limiter | None, stop: asyncio.Event, clock: Callable[[], float]) -> None:
    """Between cycles, the limiter's look at the proxy's own in-flight counts (a surge is
    refused within `SaturationPolicy.inflight_interval_s` + the hold, not at the next probe)."""
    interval = limiter.watch_interval_s if limiter is not None else None
    if limiter is None or interval is None:
        return
    while not stop.is_set():
        started = clock()
        await limiter.watch(started)
        await _sleep_or_stop(stop, started + interval - clock())


def _report_end(task: asyncio.Task[None]) -> None:
    """A background task that ended other than by cancellation is logged (once, when it ends)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log_event(_log, logging.ERROR, "task.failed", task=task.get_name(), error=repr(error),
                  note="the in-flight watch stopped; limits follow the probe cycle only")


async def run(config: SidecarConfig, stop: asyncio.Event | None = None,
              registry: CollectorRegistry | None = None) -> int:
    """Run until `stop` is set (or SIGTERM/SIGINT when on the main thread); the exit code."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        topo, warnings = await asyncio.to_thread(load_topology, config.topology)
        xds_dir: Path | None = None
        if config.nginx is not None:
            xds_dir = config.nginx.directory
        elif config.serve_xds is None:
            xds_dir = xds_dir_for(config, topo)
    except TopologyError as exc:
        log_event(_log, logging.ERROR, "startup.invalid_topology", file=str(config.topology),
                  errors=[str(d) for d in exc.diagnostics])
        return EXIT_INVALID
    except ConfigError as exc:
        log_event(_log, logging.ERROR, "startup.no_xds_dir", error=str(exc))
        return EXIT_USAGE
    config = listen_for(config, topo)
    for note in config.deprecations:
        log_event(_log, logging.WARNING, "startup.deprecated", note=note)
    try:  # the gRPC surfaces' transport: the flags and the topology agree, or nothing starts
        if config.serve_xds is not None or wanted(topo):
            grpc_transport_for(config, topo)
    except ConfigError as exc:
        log_event(_log, logging.ERROR, "startup.grpc_transport", error=str(exc))
        return EXIT_USAGE
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
        return EXIT_USAGE
    for w in warnings:
        log_event(_log, logging.WARNING, "topology.warning", diagnostic=str(w))
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    registry = registry or CollectorRegistry()
    admin_url = _admin_url(config, topo.admin.address, topo.admin.port)
    rng = random.Random()
    async with (
        Prober(max_concurrency=config.max_concurrency, deadline_s=config.probe_deadline_s,
               body_cap=config.body_cap_bytes, clock=loop.time) as prober,
        EnvoyAdmin(admin_url, timeout_s=min(1.0, config.confirm_timeout_s or 1.0)) as admin,
    ):
        wiring = Wiring(config, topo, lambda: daemon.topology, admin, registry, loop.time)
        built = build_publisher(config.publisher, wiring)
        publisher = built.publisher
        try:
            await publisher.start()
        except (OSError, ConfgenError) as exc:  # a port it cannot bind, unusable certificates
            log_event(_log, logging.ERROR, "startup.listen_failed", publisher=config.publisher,
                      serve_xds=config.serve_xds, error=str(exc))
            return EXIT_USAGE
        daemon = Daemon(config, topo, prober=prober, resolver=Resolver(config.dns_timeout_s),
                        publisher=publisher, clock=loop.time, limiter=built.limiter)
        await asyncio.to_thread(daemon.adopt_published)  # reads what is on disk
        await asyncio.to_thread(daemon.load_drains)  # drains set through POST /drain before a restart
        services: list[Service] = []
        grpc_server: GrpcServer | None = None
        _warn_unused_service_flags(config, topo)
        if wanted(topo):
            try:
                services, grpc_server = await _start_services(
                    config, topo, ServiceWiring(config, lambda: daemon.topology, registry, loop.time))
            except (ConfigError, OSError) as exc:
                await publisher.close()
                log_event(_log, logging.ERROR, "startup.grpc_failed", error=str(exc))
                return EXIT_USAGE
        register(registry, daemon.view)
        app = build_app(daemon, registry, guard=guard)
        if config.nginx is None and config.serve_xds is None:  # an Envoy beside us (file xDS)
            add_envoy_relay(app, admin_url)
        bounds = HttpBounds()
        runner = web.AppRunner(app, access_log=None, handle_signals=False, **runner_options(bounds))
        await runner.setup()
        try:
            await start_site(runner, config.listen_host, config.listen_port, bounds)
        except OSError as exc:
            await runner.cleanup()
            if grpc_server is not None:
                await grpc_server.stop(0)
            await publisher.close()
            log_event(_log, logging.ERROR, "startup.listen_failed", host=config.listen_host,
                      port=config.listen_port, error=str(exc))
            return EXIT_USAGE
        bound = runner.addresses[0]
        watcher = TopologyWatcher(config.topology, daemon.reload, debounce_s=config.watch_debounce_s)
        watcher.start()
        limits = asyncio.create_task(_watch_limits(built.limiter, stop, loop.time), name="limits-watch")
        limits.add_done_callback(_report_end)
        xds = publisher.xds_view()
        serving = xds.listen if xds is not None else None
        log_event(_log, logging.INFO, "startup.done", topology=topo.name, xds_dir=str(xds_dir), serve_xds=serving,
                  envoy_admin=admin_url, listen=f"{bound[0]}:{bound[1]}", interval_s=config.interval_s,
                  mutations="token" if guard.token else "off (beyond loopback, no token)" if guard.remote
                  else "loopback only")
        try:
            while not stop.is_set():
                started = loop.time()
                await daemon.cycle()
                if services:
                    fleet = daemon.view()
                    for service in services:
                        service.update(fleet)
                pause = config.interval_s * (1 + rng.uniform(-config.jitter, config.jitter))
                await _sleep_or_stop(stop, started + pause - loop.time())
        finally:
            log_event(_log, logging.INFO, "shutdown.begin")
            limits.cancel()
            await asyncio.gather(limits, return_exceptions=True)  # a failure was logged when it ended
            await watcher.stop()
            if grpc_server is not None:
                await grpc_server.stop()
            for service in services:
                await service.close()
            await publisher.close()
            await runner.cleanup()
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
