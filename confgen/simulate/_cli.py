"""`confgen simulate`: serve a simulated fleet until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from .. import __version__
from ._fleet import Fleet
from ._spec import ENGINE_KINDS, FleetSpec, SpecError

__all__ = ["build_parser", "main", "spec_from_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="confgen simulate",
        description="Serve simulated LLM inference servers (OpenAI API, /health, /metrics) "
        "from one process, with a latency model and switchable faults.",
    )
    parser.add_argument("--version", action="version", version=f"confgen simulate {__version__}")
    parser.add_argument("--config", type=Path, help="fleet YAML (workers, defaults, seed)")
    parser.add_argument("--workers", type=int, default=None, help="number of workers (default 3)")
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="vllm",
                        help="whose wire format and /metrics text to speak (default vllm)")
    parser.add_argument("--model", action="append", default=None,
                        help="served model name (repeat for several; default sim-model)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--base-port", type=int, default=0,
                        help="first port; worker i gets base+i (0: free ports)")  # fmt: skip
    parser.add_argument("--speed", default="1", help="comma list, cycled over the workers")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="sequences decoded at once per worker, like vLLM's --max-num-seqs (default 16)")
    parser.add_argument("--data-parallel", type=int, default=1,
                        help="data-parallel ranks per worker, each reported in /metrics (default 1)")
    parser.add_argument("--prefill-ms-per-1k", type=float, default=60.0,
                        help="prefill time per 1,000 uncached prompt tokens at speed 1 (default 60)")
    parser.add_argument("--decode-ms", type=float, default=20.0,
                        help="one decode step at speed 1, in ms (default 20)")
    parser.add_argument("--seed", type=int, default=None, help="seed for every random choice (default: random)")
    parser.add_argument("--control-port", type=int, default=None,
                        help="port of the fleet control channel (default: a free port)")  # fmt: skip
    return parser


def spec_from_args(args: argparse.Namespace) -> FleetSpec:
    """The FleetSpec the flags (or the --config file, with --seed/--control-port on top) say."""
    if args.config is not None:
        try:
            with args.config.open(encoding="utf-8") as handle:
                data: Any = yaml.safe_load(handle)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise SpecError(f"{args.config}: cannot read a fleet YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise SpecError(f"{args.config}: expected a mapping at the top level")
        if args.seed is not None:
            data["seed"] = args.seed
        if args.control_port is not None:
            data["control_port"] = args.control_port
        return FleetSpec.from_mapping(data)
    try:
        speeds = [float(s) for s in args.speed.split(",") if s.strip()]
    except ValueError as exc:
        raise SpecError(f"--speed: {exc}") from exc
    spec = FleetSpec.uniform(
        args.workers if args.workers is not None else 3,
        seed=args.seed or 0,
        base_port=args.base_port,
        speeds=speeds,
        engine=args.engine,
        models=tuple(args.model or ("sim-model",)),
        host=args.host,
        max_num_seqs=args.max_num_seqs,
        data_parallel=args.data_parallel,
        prefill_ms_per_1k=args.prefill_ms_per_1k,
        decode_ms=args.decode_ms,
    )
    if args.control_port is not None:
        spec = FleetSpec(spec.workers, seed=spec.seed, control_port=args.control_port)
    return spec


async def _serve(spec: FleetSpec) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    fleet = Fleet(spec)
    await fleet.start()
    try:
        for worker in fleet.workers:
            s = worker.spec
            print(f"{worker.name}\t{s.engine}\t{worker.url}\tspeed={s.speed}\t"
                  f"models={','.join(s.models)}")  # fmt: skip
        print(f"control\t{fleet.control_url}")
        print("ready", flush=True)
        await stop.wait()
    finally:
        await fleet.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `confgen simulate` and `python -m confgen.simulate`."""
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
    except (SpecError, OSError, yaml.YAMLError) as exc:
        print(f"confgen simulate: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(spec))
    except OSError as exc:  # a port already taken, typically
        print(f"confgen simulate: {exc}", file=sys.stderr)
        return 1
    return 0
