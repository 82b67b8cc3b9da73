"""The `confgen` command: render, validate, schema, simulate, demo.

Exit codes scripts can trust:
  0  success (valid; rendered; no drift)
  1  the input is invalid, the output drifted, or a real proxy rejected the output
  2  usage error (bad flags, unreadable arguments)
  3  a check could not run (e.g. the envoy or nginx binary is missing)
  4  the output could not be written (a path in the way, no space, no permission): nothing replaced
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from . import __version__, targets
from ._rejection import Refusal
from .errors import (
    ConfgenError,
    DeployError,
    Diagnostic,
    OutputError,
    SecretError,
    Severity,
    TopologyError,
    VerifyError,
)
from .model import Topology, admin_on_loopback, admin_on_tcp, admin_tcp, join_address
from .topology import parse

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_OUTPUT = 0, 1, 2, 3, 4
TARGETS = targets.names()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="confgen",
        description="One topology file for a fleet of LLM inference servers -> proxy configuration.",
    )
    parser.add_argument("--version", action="version", version=f"confgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    render = sub.add_parser("render", help="render a topology into proxy configuration files")
    render.add_argument("topology", type=Path, help="the topology YAML file")
    where = render.add_mutually_exclusive_group(required=True)
    where.add_argument("-o", "--out", type=Path, help="output directory (written atomically)")
    where.add_argument("--check", type=Path, metavar="DIR",
                       help="compare with DIR instead of writing; exit 1 when it differs")
    render.add_argument("--target", choices=TARGETS, default="envoy",
                        help="what to render: Envoy file xDS, nginx, Kubernetes manifests, Compose or Gateway API "
                        "InferencePools (default envoy)")
    render.add_argument("--config-dir", help="where the files will live when the proxy reads them "
                        "(default: envoy.config_dir from the topology, else the output directory)")
    render.add_argument("--diff", action="store_true",
                        help="with --check, also print what would change: per worker for endpoint files, "
                        "field paths for other JSON, a unified diff for text")
    render.add_argument("--admin-loopback", action="store_true",
                        help="Envoy's admin on TCP at admin.address:port (default 127.0.0.1:9901) instead of its "
                        "Unix socket: only where the loopback is Envoy's own (a pod; the Kubernetes manifests' "
                        "render uses it), since any local process can reach a loopback port")
    render.add_argument("--placeholder-secrets", action="store_true",
                        help="write placeholder API keys instead of reading them (for CI drift checks)")

    validate = sub.add_parser("validate", help="check topology files; print every problem")
    validate.add_argument("topology", type=Path, nargs="+", help="topology YAML files (each judged on its own)")
    for target in targets.verifiable():
        validate.add_argument(f"--{target.name}", action="store_true", help=target.verify_help)
    validate.add_argument("--envoy-all-endpoints", action="store_true",
                          help="with --envoy, have Envoy parse every endpoint too (about 1 s per 10,000)")
    validate.add_argument("--strict", action="store_true", help="treat warnings as errors")
    validate.add_argument("--format", choices=("text", "json"), default="text",
                          help="text: file:line:col: path: message lines; json: a list of objects for tools")

    sub.add_parser("schema", help="print the topology's JSON Schema (draft-07)")

    simulate = sub.add_parser("simulate", help="run simulated inference engines on loopback",
                              add_help=False)
    simulate.add_argument("args", nargs=argparse.REMAINDER, help="see `confgen simulate --help`")

    demo = sub.add_parser("demo", help="render the built-in example, check it with the real Envoy, "
                          "and serve a few requests through it from a simulated fleet")
    demo.add_argument("--requests", type=int, default=600,
                      help="at most this many requests in the whole demo (default 600)")
    demo.add_argument("--keep", type=Path, metavar="DIR",
                      help="write the topology, the rendered config and the sidecar's log into DIR and keep them")
    demo.add_argument("--prefix", action="store_true",
                      help="the prefix-affinity scene instead: growing conversations from plain clients through "
                      "confgen's endpoint picker and, beside it, least_request (each with its own fleet)")
    return parser


def _files(count: int) -> str:
    return f"{count} file" if count == 1 else f"{count} files"


def _print_diagnostics(diagnostics: Sequence[Diagnostic], stream: TextIO) -> None:
    for diag in diagnostics:
        print(diag, file=stream)


@dataclasses.dataclass(frozen=True)
class _Source:
    """A topology argument and its bytes, read once: a named pipe gives them once (opened to check it, then
    again to read it, it lost what its writer sent and blocked), and every pinned finding reads these."""

    path: Path
    text: bytes

    def pin(self, findings: Sequence[tuple[str, str]], severity: Severity = Severity.WARNING) -> list[Diagnostic]:
        from .topology import pin

        return pin(self.path, findings, severity, text=self.text)


def _read_sources(paths: Sequence[Path]) -> tuple[list[_Source], list[str], list[Diagnostic]]:
    """Each argument's bytes; a usage error per one that cannot be opened (exit 2, not 1: no input was judged);
    the size refusals as diagnostics of their file."""
    from .topology import read

    sources: list[_Source] = []
    problems: list[str] = []
    refused: list[Diagnostic] = []
    for path in paths:
        try:
            sources.append(_Source(path, read(path)))
        except TopologyError as exc:
            if any(d.line == 0 for d in exc.diagnostics):  # could not be read at all
                reason = exc.diagnostics[0].message.removeprefix("cannot read: ")
                problems.append(f"confgen: cannot read {path}: {reason}")
            else:
                refused += exc.diagnostics
    return sources, problems, refused


def _config_dir(topo: Topology, target: targets.Target, args: argparse.Namespace, out: Path) -> str:
    if args.config_dir:
        return str(args.config_dir)
    return target.config_dir(topo) or str(out.resolve())


def render_files(topo: Topology, target: str, config_dir: str, secrets: dict[str, str] | None) -> dict[str, bytes]:
    """`topo` rendered for the target called `target` (kept for callers that name targets)."""
    return targets.get(target).render(topo, config_dir, secrets)


def _target_warnings(source: _Source, target: targets.Target, topo: Topology) -> list[Diagnostic]:
    found = target.warnings(topo)
    if not found:
        return []
    return source.pin(found)


def _target_refusals(source: _Source, target: targets.Target, topo: Topology) -> list[Diagnostic]:
    """What `target` cannot render at all, as errors pinned to the topology."""
    found = target.refusals(topo)
    if not found:
        return []
    return sorted(source.pin(found, Severity.ERROR))


def cmd_render(args: argparse.Namespace) -> int:
    from . import secrets as secret_mod
    from .output import diff_tree, write_tree

    read, unreadable, refused = _read_sources([args.topology])
    for problem in unreadable:
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    if refused:
        _print_diagnostics(refused, sys.stderr)
        return EXIT_INVALID
    source = read[0]
    try:
        topo, warnings = parse(source.text, str(source.path))
    except TopologyError as exc:
        _print_diagnostics(exc.diagnostics, sys.stderr)
        return EXIT_INVALID
    target = targets.get(args.target)
    if args.admin_loopback:
        topo = admin_on_loopback(topo)
    refusals = _target_refusals(source, target, topo)
    if refusals:
        _print_diagnostics(refusals, sys.stderr)
        return EXIT_INVALID
    warnings = sorted([*warnings, *_target_warnings(source, target, topo)])
    _print_diagnostics(warnings, sys.stderr)
    if args.diff and args.check is None:
        print("confgen: --diff goes with --check DIR", file=sys.stderr)
        return EXIT_USAGE
    out: Path = args.out or args.check
    try:
        keys = secret_mod.resolve(topo) if target.needs_keys(topo) and not args.placeholder_secrets else None
        files = target.render(topo, _config_dir(topo, target, args, out), keys)
        if args.check is not None:
            drift = diff_tree(files, args.check, detail=args.diff)
            for line in drift:  # detail lines (--diff) are indented under their file
                print(line if line.startswith(" ") else f"{args.check}: {line}", file=sys.stderr)
            if drift:
                print(f"{args.check} differs from what {args.topology} renders to", file=sys.stderr)
                return EXIT_INVALID
            print(f"{args.check}: up to date with {args.topology} ({_files(len(files))})")
            return EXIT_OK
        has_keys = topo.auth is not None and keys is not None
        write_tree(files, args.out, mode=0o600 if has_keys else 0o644, rank=target.write_rank)
    except (SecretError, DeployError) as exc:
        _print_diagnostics(source.pin(exc.problems, Severity.ERROR), sys.stderr)
        if isinstance(exc, SecretError):
            print("confgen: the rendered files hold the API keys, read now from where the topology names "
                  "them: set them, or add --placeholder-secrets to write placeholders instead (CI drift "
                  "checks; never deploy those)", file=sys.stderr)
        return EXIT_INVALID
    except OutputError as exc:  # the topology is fine: the machine's side (scripts may retry elsewhere)
        print(f"confgen: {exc} (nothing replaced)", file=sys.stderr)
        return EXIT_OUTPUT
    print(f"wrote {_files(len(files))} to {args.out}", file=sys.stderr)
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from .secrets import check_sources

    read, unreadable, refused = _read_sources(args.topology)
    if unreadable:
        print("\n".join(unreadable), file=sys.stderr)
        return EXIT_USAGE
    status = EXIT_OK
    unavailable = False  # a real-proxy check could not run: exit 3, once every file's findings are said
    report: list[dict[str, object]] = []
    texts = {s.path: s for s in read}
    for path in args.topology:
        source = texts.get(path)
        try:
            if source is None:  # refused unparsed (its size)
                raise TopologyError([d for d in refused if d.file == str(path)])
            topo, diags = parse(source.text, str(path))
        except TopologyError as exc:
            diags, topo = list(exc.diagnostics), None
        findings = list(diags)
        checked: list[str] = []  # what a real proxy accepted, said before "ok"
        if source is not None and topo is not None and (sources := check_sources(topo)):
            findings += source.pin(sources, Severity.ERROR)
        if source is not None and topo is not None:
            findings += source.pin(_policy_notes(topo), Severity.NOTE)
        chosen = ([t for t in targets.verifiable() if getattr(args, t.name)]
                  if topo is not None and not unavailable else [])
        for target in chosen:
            assert topo is not None and target.verify is not None
            assert source is not None  # a topology was parsed from it
            refusals = _target_refusals(source, target, topo)
            if refusals:
                findings += refusals
                continue
            try:
                problems = target.verify(topo, args.envoy_all_endpoints)
            except VerifyError as exc:
                print(f"confgen: cannot run {target.name}: {exc}", file=sys.stderr)
                unavailable = True
                checked = []  # not "ok": a check asked for did not run
                break
            findings += _refusals(source, target.name, problems)
            findings += _target_warnings(source, target, topo)
            if not problems:
                checked.append(f"{path}: {target.name}: accepted by {target.verify_help.removeprefix('also run ')}")
        errors = [d for d in findings
                  if d.severity is Severity.ERROR or (args.strict and d.severity is Severity.WARNING)]
        if errors:
            status = EXIT_INVALID
        if args.format == "json":  # under --strict a warning is an error, and says so
            report.extend({"file": d.file, "line": d.line, "column": d.col, "path": d.path,
                           "severity": "error" if args.strict and d.severity is Severity.WARNING
                           else str(d.severity), "message": d.message} for d in findings)
        else:
            _print_diagnostics(findings, sys.stderr if errors else sys.stdout)
            if not errors and not unavailable:
                for line in checked:
                    print(line, file=sys.stdout)
                print(f"{path}: ok", file=sys.stdout)
    if args.format == "json":
        print(json.dumps(report, indent=2))
    return EXIT_UNAVAILABLE if unavailable else status


def _policy_notes(topo: Topology) -> list[tuple[str, str]]:
    """Where `balancing.policy: auto` could not give a pool the endpoint picker, and why; where the
    Kubernetes proxy pods (a `kubernetes:` section set, file mode) would each pick alone; and an Envoy
    admin on TCP."""
    from ._names import object_base
    from .balancing import AUTO, POLICIES, choose, uses_picker
    from .deploy.kubernetes import pickers_peered, pickers_service
    from .model import Kubernetes

    notes = []
    for index, pool in enumerate(topo.pools):
        choice = choose(topo, pool)
        if pool.balancing.policy == AUTO and not POLICIES[choice.policy].picker:
            notes.append((f"pools[{index}].balancing.policy", choice.reason))
    replicas = topo.kubernetes.replicas
    picked = [p.name for p in topo.pools if uses_picker(topo, p)]
    if topo.kubernetes != Kubernetes() and topo.envoy.xds.mode == "files" and replicas > 1 and picked:
        base = object_base(topo.name)
        if pickers_peered(topo):
            notes.append(("kubernetes.replicas",
                          f"the {replicas} proxy pods' endpoint pickers ({', '.join(picked)}) are each other's peers "
                          f"through the headless Service {pickers_service(base)}: the sidecar certificate (Secret "
                          f"{base}-sidecar-tls) must name {pickers_service(base)} (each peer checks it) besides what "
                          "Envoy checks, and allow client use (clientAuth); docs/kubernetes.md"))
        else:
            notes.append(("kubernetes.replicas",
                          f"{replicas} proxy pods each run their own endpoint picker for {', '.join(picked)}: each "
                          "knows only the requests through its own Envoy, so a conversation whose turns reach two pods "
                          "loses its prefix-cache hits (two pickers alone hit 68-71 % of prompt tokens where peers hit "
                          "85-87 %, bench/results/two-pickers-replicas-fix). With sidecar.grpc_tls the render makes "
                          "the pods' pickers peers (mutual TLS between the sidecars); or one control plane picks for "
                          "every Envoy with envoy.xds.mode: ads"))
    if admin_on_tcp(topo):
        address, port = admin_tcp(topo)
        notes.append(("admin", f"Envoy's admin listens on TCP {join_address(address, port)}, where any local user "
                      "can stop Envoy or change its runtime (the in-flight limits): fine where the loopback is "
                      "Envoy's own (a pod); on a shared host leave admin.address and admin.port out for its 0600 "
                      "Unix socket (admin.socket)"))
    return notes


def _refusals(source: _Source, target: str, refused: Sequence[Refusal]) -> list[Diagnostic]:
    """A real proxy's refusals pinned to the topology field that led there (the file's top,
    named <target>, when no field can be named)."""
    pinned = source.pin([(r.field, r.message) for r in refused], Severity.ERROR)
    return [d if d.path else dataclasses.replace(d, path=f"<{target}>") for d in pinned]


def cmd_schema(_: argparse.Namespace) -> int:
    from .schema import schema_text

    sys.stdout.write(schema_text())
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        from .simulate import main as simulate_main

        return simulate_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command == "render":
            return cmd_render(args)
        if args.command == "validate":
            return cmd_validate(args)
        if args.command == "schema":
            return cmd_schema(args)
        if args.command == "demo":
            from .demo import run_demo, run_prefix_demo

            return run_prefix_demo(args.keep) if args.prefix else run_demo(args.requests, args.keep)
    except ConfgenError as exc:
        print(f"confgen: {exc}", file=sys.stderr)
        return EXIT_INVALID
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
