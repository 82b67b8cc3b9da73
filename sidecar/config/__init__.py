"""The daemon's settings: one frozen `SidecarConfig`, built from argv by `from_argv`.

Kept apart from the server and the loop so they can be built in tests without argv, and
so every default is in one place. Durations are seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from confgen.errors import ConfgenError
from confgen.model import Topology, grpc_service_hosts, grpc_socket_dir, grpc_transport
from sidecar.config.nginx import NginxSettings
from sidecar.config.nginx import add_arguments as add_nginx_arguments
from sidecar.config.nginx import from_args as nginx_from_args
from sidecar.config.tls import DNS, TlsFiles, Transport, is_loopback, split_dns
from sidecar.decide.hysteresis import HysteresisPolicy
from sidecar.decide.saturation import SaturationPolicy
from sidecar.decide.state import HealthPolicy
from sidecar.decide.weights import WeightPolicy

__all__ = ["UNIX", "ConfigError", "SidecarConfig", "drains_file_for", "from_argv", "grpc_listen_for",
           "grpc_listen_mismatch", "grpc_transport_for", "listen_for",
           "listen_mismatch", "parser", "publisher_mismatch", "xds_dir_for"]

LogFormat = Literal["json", "text"]
_P = TypeVar("_P", HealthPolicy, WeightPolicy, SaturationPolicy, HysteresisPolicy)


class ConfigError(ConfgenError, ValueError):
    """The command line asks for something impossible."""


UNIX = ("unix", 0)  # --serve-xds unix: ADS on its Unix socket (the transport's socket directory)


@dataclass(frozen=True)
class SidecarConfig:
    """Everything the daemon needs besides the topology itself."""

    topology: Path
    xds_dir: Path | None = None  # where Envoy reads the files; default: the topology's envoy.config_dir
    envoy_admin: str | None = None  # unix:PATH or http://host:port; default: from the topology (main._admin_url)
    interval_s: float = 2.0
    jitter: float = 0.1  # each sleep is interval * (1 +- jitter)
    max_concurrency: int = 64
    probe_deadline_s: float = 1.5  # whole probe: connect, health, metrics, body reads
    body_cap_bytes: int = 1024 * 1024
    listen_host: str = "127.0.0.1"
    listen_port: int = 9109
    # No --listen: listen where the topology's `sidecar` says, which is where the rendered
    # proxy asks for /v1/models (one source); listen_host/listen_port are then replaced.
    listen_from_topology: bool = False
    health: HealthPolicy = field(default_factory=HealthPolicy)
    weights: WeightPolicy = field(default_factory=WeightPolicy)
    hysteresis: HysteresisPolicy = field(default_factory=HysteresisPolicy)  # which weight changes are published
    saturation: SaturationPolicy = field(default_factory=SaturationPolicy)  # when to shed, how much
    publish_debounce_s: float = 0.1  # at most one EDS write per pool per this long
    confirm_timeout_s: float = 2.0  # how long to wait for Envoy's stats to show a write
    watch_debounce_s: float = 0.2
    dns_timeout_s: float = 2.0
    ingresses: int = 1  # Envoys sharing the fleet: file target's limit share (1/ingresses); the picker's replicas
    log_format: LogFormat = "json"
    log_level: str = "INFO"
    nginx: NginxSettings | None = None  # --target nginx (upstream files + reloads); None: Envoy
    serve_xds: tuple[str, int] | None = None  # --serve-xds: ADS over gRPC instead of files (host, port; or UNIX)
    xds_max_nodes: int = 1000  # --xds-max-nodes: distinct Envoys served at once (and the limits' count cap)
    xds_nodes_per_identity: int = 1  # --xds-nodes-per-identity: Envoys counted per credential (a shared cert)
    admin_token_file: Path | None = None  # bearer token for POST /drain, /undrain (sidecar.serve.guard)
    admin_token_env: str | None = None  # ... or the environment variable holding it
    drains_file: Path | None = None  # --drains-file; default: next to the files the sidecar writes (none for ADS)
    grpc_listen: tuple[str, int] | None = None  # gRPC services (picker); None: 127.0.0.1:<sidecar.grpc_port>
    # --grpc-tls-cert/-key/--grpc-client-ca: mTLS for every gRPC surface (ADS, picker, rate limits);
    # None: Unix sockets, or plaintext TCP on loopback with grpc_plaintext_loopback
    grpc_tls: TlsFiles | None = None
    grpc_plaintext_loopback: bool = False  # --grpc-plaintext-loopback: the explicit opt-in to plaintext TCP
    picker: tuple[str, ...] = ()  # --picker KEY=VALUE overrides of the endpoint picker's policy (checked at start)
    # --picker-peer: the other picker replicas' gRPC services (unix:PATH or HOST:PORT), which this one
    # streams its placements and in-flight counts to (sidecar.outputs.picker.peers)
    picker_peers: tuple[str, ...] = ()
    deprecations: tuple[str, ...] = ()  # deprecated flags given (logged at startup)

    @property
    def xds_tls(self) -> TlsFiles | None:
        """Deprecated name of `grpc_tls` (one TLS setup for every gRPC surface)."""
        return self.grpc_tls

    @property
    def publisher(self) -> str:
        """The publisher the flags select (a key of sidecar.outputs.registry.OUTPUTS)."""
        if self.nginx is not None:
            return "nginx"
        return "ads" if self.serve_xds is not None else "envoy"

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.probe_deadline_s <= 0:
            raise ConfigError("interval and probe deadline must be > 0")
        if not 0 <= self.jitter < 1:
            raise ConfigError("jitter must be within [0, 1)")
        if self.max_concurrency < 1 or self.body_cap_bytes < 1024:
            raise ConfigError("max concurrency must be >= 1 and the body cap >= 1024 bytes")
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen port {self.listen_port} out of range")
        if min(self.publish_debounce_s, self.confirm_timeout_s, self.watch_debounce_s, self.dns_timeout_s) < 0:
            raise ConfigError("debounces and timeouts must be >= 0")
        if self.ingresses < 1:
            raise ConfigError(f"ingresses must be >= 1, got {self.ingresses}")
        if self.serve_xds is not None and self.nginx is not None:
            raise ConfigError("--serve-xds serves Envoys; it cannot be combined with --target nginx")
        if self.serve_xds is not None and not 0 <= self.serve_xds[1] <= 65535:
            raise ConfigError(f"--serve-xds port {self.serve_xds[1]} out of range")
        if (self.serve_xds not in (None, UNIX) and self.grpc_tls is None
                and not is_loopback(self.serve_xds[0])):
            raise ConfigError(f"--serve-xds {self.serve_xds[0]}: plaintext ADS serves the API keys to anyone who "
                              "connects; beyond loopback give --grpc-tls-cert, --grpc-tls-key and --grpc-client-ca")
        if self.serve_xds == UNIX and (self.grpc_tls is not None or self.grpc_plaintext_loopback):
            raise ConfigError("--serve-xds unix: ADS on the Unix socket; with TLS or --grpc-plaintext-loopback "
                              "give --serve-xds HOST:PORT")
        if self.grpc_tls is not None and self.grpc_plaintext_loopback:
            raise ConfigError("--grpc-plaintext-loopback and --grpc-tls-*: choose one transport")
        if self.xds_max_nodes < 1:
            raise ConfigError(f"--xds-max-nodes must be >= 1, got {self.xds_max_nodes}")
        if self.xds_nodes_per_identity < 1:
            raise ConfigError(f"--xds-nodes-per-identity must be >= 1, got {self.xds_nodes_per_identity}")
        if self.grpc_listen is not None and not 0 <= self.grpc_listen[1] <= 65535:
            raise ConfigError(f"--grpc-listen port {self.grpc_listen[1]} out of range")
        for target in self.picker_peers:
            _check_peer(target, self.grpc_tls is not None, self.grpc_plaintext_loopback)
        if self.grpc_listen is not None and self.grpc_tls is None and not is_loopback(self.grpc_listen[0]):
            raise ConfigError(f"--grpc-listen {self.grpc_listen[0]}: plaintext gRPC lets anyone who connects steer "
                              "routing and spend the rate limits; beyond loopback give --grpc-tls-cert, "
                              "--grpc-tls-key and --grpc-client-ca")


def _check_peer(target: str, tls: bool, plaintext_loopback: bool) -> None:
    """A --picker-peer target this transport dials safely: unix:PATH, or HOST:PORT over mTLS (or over
    plaintext on loopback when --grpc-plaintext-loopback says so), or dns:HOST:PORT (every address of
    HOST) over mTLS; ConfigError otherwise."""
    if target.startswith(DNS):
        if split_dns(target) is None:
            raise ConfigError(f"--picker-peer {target}: expected dns:HOST:PORT")
        if not tls:
            raise ConfigError(f"--picker-peer {target}: peers found by DNS are dialed over TCP beyond this host: "
                              "give --grpc-tls-cert/--grpc-tls-key/--grpc-client-ca")
        return
    if target.startswith("unix:"):
        if len(target) == len("unix:") or tls:
            raise ConfigError(f"--picker-peer {target}: give unix:PATH (a peer's socket) without --grpc-tls-*, "
                              "or HOST:PORT with them")
        return
    host, sep, port = target.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"--picker-peer {target}: expected unix:PATH or HOST:PORT")
    if not tls and not (plaintext_loopback and is_loopback(host.strip("[]"))):
        raise ConfigError(f"--picker-peer {target}: a peer over TCP needs --grpc-tls-cert/--grpc-tls-key/"
                          "--grpc-client-ca (its placements steer routing), or a loopback address with "
                          "--grpc-plaintext-loopback; on one host give unix:<its socket directory>/grpc.sock")


def _version() -> str:
    from confgen import __version__

    return __version__


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="confgen-sidecar",
        description="Probe the inference workers of a confgen topology and publish their health and "
        "load-aware weights to Envoy (EDS files, or ADS with --serve-xds), or their health to nginx "
        "(--target nginx); reload the topology when it changes.",
    )
    p.add_argument("--version", action="version", version=f"confgen-sidecar {_version()}")
    p.add_argument("--topology", required=True, type=Path, help="topology YAML (the same file confgen renders)")
    p.add_argument("--xds-dir", type=Path, help="directory Envoy reads its xDS files from "
                   "(default: the topology's envoy.config_dir)")
    p.add_argument("--envoy-admin", help="Envoy's admin: unix:PATH (its Unix socket) or http://host:port (default: "
                   "from the topology: envoy-admin.sock in the xDS directory unless admin.socket or "
                   "admin.address/port say otherwise)")
    p.add_argument("--interval", type=_number(0.05, 3600), default=2.0,
                   help="seconds between probe cycles (default 2; 0.05-3600)")
    p.add_argument("--jitter", type=float, default=0.1, help="fraction of the interval to jitter by (0.1)")
    p.add_argument("--max-concurrency", type=int, default=64, help="probes in flight at once (64)")
    p.add_argument("--probe-deadline", type=_number(0.01, 3600),
                   help="seconds for one whole probe (default: 0.75 * interval)")
    p.add_argument("--body-cap", type=int, default=1024 * 1024, help="largest metrics body read, bytes (1 MiB)")
    p.add_argument("--listen", help="host:port of the sidecar's own HTTP server (default: the topology's "
                   "sidecar.address:sidecar.port, where the rendered proxy asks it for /v1/models; another port "
                   "is reported as the startup.listen_mismatch error)")
    p.add_argument("--health", action="append", default=[], metavar="KEY=VALUE",
                   help="override a HealthPolicy field (repeatable), e.g. --health fall=3; every key: docs/settings.md")
    p.add_argument("--weights", action="append", default=[], metavar="KEY=VALUE",
                   help="override a WeightPolicy field (repeatable), e.g. --weights smoothing=0.5; every key: "
                   "docs/settings.md")
    p.add_argument("--hysteresis", action="append", default=[], metavar="KEY=VALUE",
                   help="override a HysteresisPolicy field (repeatable): when a weight change is "
                   "published, e.g. --hysteresis threshold=0.1 (sustain=1 threshold=0 min_step=0: every change); "
                   "every key: docs/settings.md")
    p.add_argument("--saturation", action="append", default=[], metavar="KEY=VALUE",
                   help="override a SaturationPolicy field (repeatable), e.g. --saturation queue_enter=2 "
                   "(stale_after_s defaults to 2.5 x --interval); every key: docs/settings.md")
    p.add_argument("--publish-debounce", type=_number(0.0, 3600), default=0.1,
                   help="min seconds between writes of a pool")
    p.add_argument("--confirm-timeout", type=_number(0.0, 3600), default=2.0,
                   help="seconds to wait for Envoy to apply a write")
    p.add_argument("--watch-debounce", type=_number(0.0, 3600), default=0.2,
                   help="seconds to let topology events settle")
    p.add_argument("--ingresses", type=int, default=1, metavar="N",
                   help="Envoys that share the fleet, each with its own sidecar (default 1). Envoy file target: "
                   "while a pool is saturated this Envoy's in-flight limit is its 1/N share, "
                   "(1 + target_queue) x batch / N, and its own in-flight count x N stands for the fleet's (the "
                   "in-flight watch; what the engines hold beyond it counts as load bypassing the Envoys). With "
                   "--serve-xds the limits are divided by the Envoys connected instead. Also the endpoint picker's "
                   "replicas (--picker replicas=... overrides): its predicted rule counts on a conversation's later "
                   "turns coming through the N-1 other pickers")
    p.add_argument("--log-format", choices=["json", "text"], default="json",
                   help="json: one object per line for log shippers; text: for people (default json)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="least severe level logged (default INFO)")
    p.add_argument("--admin-token-file", type=Path, metavar="PATH",
                   help="file holding the bearer token POST /drain and /undrain require (16-512 token "
                   "characters). Without a token they are off (403), on a loopback --listen too")
    p.add_argument("--admin-token-env", metavar="NAME",
                   help="environment variable holding that token (instead of --admin-token-file)")
    p.add_argument("--serve-xds", metavar="HOST:PORT|unix",
                   help="serve every Envoy of the topology over ADS (gRPC: LDS, CDS, EDS, RTDS limits) instead of "
                   "writing xDS files; the Envoys' bootstrap comes from envoy.xds.mode: ads. The in-flight limits are "
                   "then divided by the connected Envoys that applied them (see --xds-nodes-per-identity), not "
                   "by --ingresses. Without --grpc-tls-* ADS is served on the Unix socket "
                   "<sidecar.grpc_socket_dir>/xds.sock (HOST:PORT unused; `unix` says so), or plaintext on a "
                   "loopback HOST:PORT with --grpc-plaintext-loopback; with them, over mTLS on HOST:PORT, and each "
                   "Envoy's node id must be a name of its client certificate")
    for old, new in (("--xds-tls-cert", "--grpc-tls-cert"), ("--xds-tls-key", "--grpc-tls-key"),
                     ("--xds-client-ca", "--grpc-client-ca")):
        p.add_argument(old, type=Path, metavar="PATH", help=f"deprecated: {new} (one TLS setup for every gRPC surface)")
    p.add_argument("--xds-max-nodes", type=int, default=1000, help="--serve-xds: most distinct Envoys served at "
                   "once; also the most the in-flight limits are divided by (default 1000)")
    p.add_argument("--xds-nodes-per-identity", type=int, default=1, metavar="N",
                   help="--serve-xds: most Envoys counted for the in-flight limits per credential: per client "
                   "certificate identity (give the replicas that share one certificate, as a Deployment's pods do), "
                   "and for the local Unix socket or plaintext loopback as a whole. Node ids beyond it are served "
                   "but move no limit (default 1)")
    p.add_argument("--drains-file", type=Path, metavar="PATH", help="where drains set by POST /drain are kept "
                   "across restarts (default: .confgen-drains.json next to the xDS or nginx files; with --serve-xds "
                   "none unless given: give a path on a persistent volume)")
    p.add_argument("--picker", action="append", default=[], metavar="KEY=VALUE",
                   help="override an endpoint picker setting (repeatable): rule=predicted (the default: the "
                   "cheapest predicted cost in seconds) or rule=weighted (the weighted sum of scores, also the "
                   "fallback where no endpoint has a measured time per token); the predicted rule's tie_s, "
                   "tie_share, replicas (default --ingresses), externality, queue_externality, growth, "
                   "prefill_ratio, default_output, output_cap and its admission's budget_standard, budget_sheddable, "
                   "budget_floor_s, admission_gate, pressure_s, hold_ratio, spike_ratio, spike_s, spike_min; "
                   "the weighted rule's scorer weights (prefix, load, kv, cost; 0 turns one off), spill_min, "
                   "spill_fraction, long_tokens, default_max_tokens, "
                   "prompt_share; either rule's fallbacks, e.g. --picker rule=weighted; every key: docs/settings.md")
    p.add_argument("--picker-peer", action="append", default=[], metavar="TARGET",
                   help="another endpoint picker replica's gRPC services (repeatable): unix:PATH (its Unix socket, "
                   "<its sidecar.grpc_socket_dir>/grpc.sock, on this host), HOST:PORT (over the mTLS of "
                   "--grpc-tls-*: this sidecar presents its own certificate, which --grpc-client-ca must sign) or "
                   "dns:HOST:PORT (every address HOST resolves to, looked up again every 5 s, each checked against "
                   "the name HOST over the same mTLS: a Kubernetes headless Service of the proxy pods). "
                   "Each placement (the prompt's block hashes) and the requests in flight are streamed to every "
                   "peer, so a conversation whose turns come through different Envoys still goes where its "
                   "history is, and every replica counts the others' load. With peers the picker's replicas "
                   "setting defaults to 1 (nothing is presumed: the placements are known)")
    p.add_argument("--grpc-listen", metavar="HOST:PORT",
                   help="where the sidecar's gRPC services listen (the endpoint picker Envoy's ext_proc calls when a "
                   "pool uses policy prefix_affinity, the rate limit service for global limits) over TCP, with "
                   "mTLS or --grpc-plaintext-loopback; default 127.0.0.1:<the topology's sidecar.grpc_port>. "
                   "Without either they are served on the Unix socket <sidecar.grpc_socket_dir>/grpc.sock")
    p.add_argument("--grpc-tls-cert", type=Path, metavar="PATH", help="the certificate chain of every gRPC surface "
                   "(ADS, picker, rate limits; PEM; cert-manager's tls.crt); with --grpc-tls-key and --grpc-client-ca "
                   "they are served over mTLS: a client without a certificate signed by that CA is refused at the "
                   "handshake. Re-read when it changes")
    p.add_argument("--grpc-tls-key", type=Path, metavar="PATH", help="its private key (PEM; tls.key)")
    p.add_argument("--grpc-client-ca", type=Path, metavar="PATH",
                   help="the CA that signs the Envoys' client certificates (PEM; ca.crt)")
    p.add_argument("--grpc-plaintext-loopback", action="store_true",
                   help="serve the gRPC surfaces as plaintext TCP on loopback instead of Unix sockets (the topology's "
                   "sidecar.grpc_plaintext_loopback must say so too): any local process can then connect, read the "
                   "API keys over ADS and move the limits. Logged as a warning")
    add_nginx_arguments(p)
    return p


def _split_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        raise ConfigError(f"{flag} must be host:port, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _number(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number within [low, high] (nan, inf and 1e400 are refused with the flag's
    name, not a traceback; an interval of a microsecond would spin a core)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text!r} is not within {low:g}..{high:g}")
        return value

    return parse


def _override(policy: _P, pairs: Sequence[str], flag: str) -> _P:
    """`policy` with KEY=VALUE pairs applied, each value converted to the field's type."""
    if not pairs:
        return policy
    current = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    changes: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in current:
            raise ConfigError(f"{flag} {pair!r}: expected KEY=VALUE with KEY one of {sorted(current)}")
        kind = type(current[key])
        try:
            changes[key] = kind(raw)
        except ValueError as exc:
            raise ConfigError(f"{flag} {key}: {raw!r} is not a {kind.__name__}") from exc
        if isinstance(changes[key], float) and not math.isfinite(changes[key]):
            raise ConfigError(f"{flag} {key}: {raw!r} is not a finite number")
    try:
        return dataclasses.replace(policy, **changes)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from exc


def from_argv(argv: Sequence[str]) -> SidecarConfig:
    """Parse argv (without the program name); argparse exits 2 on usage errors."""
    args = parser().parse_args(list(argv))
    try:
        nginx = nginx_from_args(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    host, port = _split_listen(args.listen) if args.listen else ("127.0.0.1", 9109)
    health = _override(HealthPolicy(probe_interval_s=args.interval), args.health, "--health")
    weights = _override(WeightPolicy(), args.weights, "--weights")
    hysteresis = _override(HysteresisPolicy(), args.hysteresis, "--hysteresis")
    stale = SaturationPolicy(stale_after_s=2.5 * args.interval) if args.interval > 0 else SaturationPolicy()
    saturation = _override(stale, args.saturation, "--saturation")
    deadline = args.probe_deadline if args.probe_deadline is not None else 0.75 * args.interval
    tls, deprecations = _one_tls(args)
    return SidecarConfig(
        topology=args.topology,
        xds_dir=args.xds_dir,
        envoy_admin=args.envoy_admin.rstrip("/") if args.envoy_admin else None,
        interval_s=args.interval,
        jitter=args.jitter,
        max_concurrency=args.max_concurrency,
        probe_deadline_s=deadline,
        body_cap_bytes=args.body_cap,
        listen_host=host,
        listen_port=port,
        listen_from_topology=not args.listen,
        health=health,
        weights=weights,
        hysteresis=hysteresis,
        saturation=saturation,
        publish_debounce_s=args.publish_debounce,
        confirm_timeout_s=args.confirm_timeout,
        watch_debounce_s=args.watch_debounce,
        ingresses=args.ingresses,
        log_format=args.log_format,
        log_level=args.log_level,
        nginx=nginx,
        serve_xds=_serve_xds(args.serve_xds),
        admin_token_file=args.admin_token_file,
        admin_token_env=args.admin_token_env,
        drains_file=args.drains_file.absolute() if args.drains_file else None,
        xds_max_nodes=args.xds_max_nodes,
        xds_nodes_per_identity=args.xds_nodes_per_identity,
        grpc_listen=_split_listen(args.grpc_listen, "--grpc-listen") if args.grpc_listen else None,
        grpc_tls=tls,
        grpc_plaintext_loopback=args.grpc_plaintext_loopback,
        picker=tuple(args.picker),
        picker_peers=tuple(args.picker_peer),
        deprecations=deprecations,
    )


def _serve_xds(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    return UNIX if text == "unix" else _split_listen(text, "--serve-xds")


def _one_tls(args: argparse.Namespace) -> tuple[TlsFiles | None, tuple[str, ...]]:
    """The one TLS setup: --grpc-tls-*, or the deprecated --xds-tls-* (the same files if both)."""
    tls = _tls_files(args, "grpc-tls-cert", "grpc-tls-key", "grpc-client-ca")
    old = _tls_files(args, "xds-tls-cert", "xds-tls-key", "xds-client-ca")
    if old is None:
        return tls, ()
    if tls is not None and tls != old:
        raise ConfigError("--xds-tls-* (deprecated) and --grpc-tls-* name different files: every gRPC surface is "
                          "served with one TLS setup; give --grpc-tls-cert/--grpc-tls-key/--grpc-client-ca only")
    return old, ("--xds-tls-cert/--xds-tls-key/--xds-client-ca are deprecated (removed in the next release): "
                 "give --grpc-tls-cert/--grpc-tls-key/--grpc-client-ca, the one TLS setup of ADS, the picker and "
                 "rate limits",)


def _tls_files(args: argparse.Namespace, cert: str, key: str, ca: str) -> TlsFiles | None:
    """The three paths of one mTLS listener (flag names without dashes), or None when none is given."""
    given: list[Path | None] = [getattr(args, flag.replace("-", "_")) for flag in (cert, key, ca)]
    if not any(given):
        return None
    paths = [path for path in given if path is not None]
    if len(paths) < 3:
        raise ConfigError(f"mTLS needs all three of --{cert}, --{key} and --{ca}")
    return TlsFiles(paths[0].absolute(), paths[1].absolute(), paths[2].absolute())


DRAINS_FILE = ".confgen-drains.json"  # a dot file: `confgen render --diff` and the manifest ignore it


def drains_file_for(config: SidecarConfig, topo: Topology) -> Path | None:
    """Where admin drains persist: --drains-file, else beside the files written (None for ADS without it)."""
    if config.drains_file is not None:
        return config.drains_file
    if config.nginx is not None:
        return config.nginx.directory / DRAINS_FILE
    if config.serve_xds is not None:
        return None
    return xds_dir_for(config, topo) / DRAINS_FILE


def grpc_listen_for(config: SidecarConfig, topo: Topology) -> tuple[str, int]:
    """Where the gRPC services listen: --grpc-listen, else loopback at the topology's grpc_port."""
    return config.grpc_listen or ("127.0.0.1", topo.sidecar.grpc_port)


def grpc_transport_for(config: SidecarConfig, topo: Topology) -> Transport:
    """How the gRPC surfaces are served, agreed between the flags and the topology (which says where
    Envoy calls: `confgen.model.grpc_transport`). ConfigError when they disagree: Envoy would call a
    socket or port nobody serves."""
    rendered = grpc_transport(topo)
    if config.grpc_tls is not None:
        if rendered != "mtls":
            raise ConfigError("--grpc-tls-* is given but the topology has no sidecar.grpc_tls: Envoy calls the "
                              f"sidecar over {'plaintext TCP' if rendered == 'plaintext' else 'its Unix sockets'}; "
                              "set sidecar.grpc_tls (Envoy's client certificate) or drop the flags")
        return Transport(tls=config.grpc_tls)
    if rendered == "mtls":
        raise ConfigError("the topology's sidecar.grpc_tls has Envoy call the sidecar over mutual TLS: give "
                          "--grpc-tls-cert, --grpc-tls-key and --grpc-client-ca")
    if config.grpc_plaintext_loopback != (rendered == "plaintext"):
        if config.grpc_plaintext_loopback:
            raise ConfigError("--grpc-plaintext-loopback, but the topology has Envoy call the sidecar's Unix "
                              "sockets: set sidecar.grpc_plaintext_loopback: true as well, or drop the flag")
        raise ConfigError("the topology's sidecar.grpc_plaintext_loopback has Envoy call plaintext TCP on loopback: "
                          "start the sidecar with --grpc-plaintext-loopback to agree (any local process can "
                          "then connect), or remove it from the topology to use the Unix sockets")
    if config.grpc_plaintext_loopback:
        return Transport()
    return Transport(socket_dir=Path(grpc_socket_dir(topo)))


def grpc_listen_mismatch(config: SidecarConfig, topo: Topology) -> str | None:
    """Why Envoy cannot reach the gRPC services where the rendered cluster sends it; None when it can.

    confgen_sidecar_grpc goes to sidecar.address (with ADS: the servers' hosts) at sidecar.grpc_port;
    a loopback bind serves only an Envoy on this machine at a loopback address. Over the Unix socket
    there is no address to miss."""
    if grpc_transport(topo) == "unix":
        return None
    host, port = grpc_listen_for(config, topo)
    remote = [h for h in grpc_service_hosts(topo) if not is_loopback(h)]
    if remote and is_loopback(host):
        return (f"the gRPC services listen on {host}:{port} (loopback) but Envoy calls {remote[0]}:"
                f"{topo.sidecar.grpc_port}: give --grpc-listen <that address or 0.0.0.0>:{topo.sidecar.grpc_port} "
                "with --grpc-tls-cert/--grpc-tls-key/--grpc-client-ca")
    if port not in (0, topo.sidecar.grpc_port):
        return f"--grpc-listen port {port} is not the topology's sidecar.grpc_port {topo.sidecar.grpc_port}"
    return None


def xds_dir_for(config: SidecarConfig, topo: Topology) -> Path:
    """Where the sidecar writes: --xds-dir, else the topology's envoy.config_dir."""
    if config.xds_dir is not None:
        return config.xds_dir.absolute()
    if topo.envoy.config_dir:
        return Path(topo.envoy.config_dir).absolute()
    raise ConfigError("no xDS directory: pass --xds-dir or set envoy.config_dir in the topology")


_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def publisher_mismatch(config: SidecarConfig, topo: Topology) -> str | None:
    """Why the publisher the flags select cannot reach the proxies the topology renders; None when it can.

    With envoy.xds.mode ads the rendered Envoys ask the control plane (envoy.xds.servers) for
    everything and read no file: a sidecar started without --serve-xds would write EDS files no Envoy
    reads while every Envoy waits for a control plane. (--serve-xds on a files topology is allowed:
    the Gateway API endpoint picker serves ADS on its loopback as the publisher that needs no Envoy.)"""
    if config.nginx is None and config.serve_xds is None and topo.envoy.xds.mode == "ads":
        servers = ", ".join(topo.envoy.xds.servers) or "none"
        return ("the topology's envoy.xds.mode is ads (the Envoys ask the control plane at envoy.xds.servers: "
                f"{servers}), but --serve-xds is not given: this sidecar would write xDS files no Envoy reads. "
                "Start it with --serve-xds HOST:PORT (or --serve-xds unix) to be that control plane")
    return None


def listen_for(config: SidecarConfig, topo: Topology) -> SidecarConfig:
    """`config` with the address the sidecar listens on: --listen, else the topology's sidecar link."""
    if not config.listen_from_topology:
        return config
    return dataclasses.replace(config, listen_host=topo.sidecar.address, listen_port=topo.sidecar.port,
                               listen_from_topology=False)


def listen_mismatch(config: SidecarConfig, topo: Topology) -> str | None:
    """Why the proxy cannot reach this sidecar where the topology says it is; None when it can.

    The rendered proxy asks `sidecar.address:sidecar.port` for /v1/models (when the topology
    enables that); a sidecar listening elsewhere is never asked, and the proxy silently answers
    the full model list instead of the healthy ones.
    """
    if not (topo.models_endpoint and topo.sidecar.models):
        return None
    wanted = f"{topo.sidecar.address}:{topo.sidecar.port}"
    if config.listen_port != topo.sidecar.port:
        return (f"--listen port {config.listen_port} is not the topology's sidecar.port {topo.sidecar.port}: "
                f"the proxy asks {wanted} for /v1/models and never reaches this sidecar")
    if config.listen_host not in _WILDCARDS and config.listen_host != topo.sidecar.address:
        return (f"--listen host {config.listen_host} is not the topology's sidecar.address "
                f"{topo.sidecar.address}: the proxy asks {wanted} for /v1/models")
    return None
