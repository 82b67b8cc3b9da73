"""python -m bench run [--quick] [--only SCENARIO ...] [--seed N] [--set KEY=SECONDS] --out DIR"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import report
from ._harness import Context, Result
from .scenarios import ORDER, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the scenarios and write report.md, chart.png, results.json")
    run.add_argument("--quick", action="store_true", help="short runs (a couple of minutes in all)")
    run.add_argument("--only", nargs="+", choices=ORDER, metavar="SCENARIO", help=f"any of: {', '.join(ORDER)}")
    run.add_argument("--seed", type=int, default=7)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--set", action="append", default=[], metavar="KEY=SECONDS", dest="options",
                     help="a scenario's duration knob, e.g. --set steady_s=300 (see each scenario)")
    run.add_argument("--keep-work", action="store_true", help="keep configs, logs and raw records under OUT/work")
    redraw = sub.add_parser("chart", help="redraw DIR/chart.png from DIR/results.json (same numbers)")
    redraw.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "chart":
        report.chart(args.dir / "chart.png", report.results_from_json(args.dir / "results.json"))
        return 0
    names = args.only or list(ORDER)
    info = report.machine(args.seed, args.quick)
    info["argv"] = " ".join(["run", *(sys.argv[2:] if argv is None else argv[1:])])
    work = Path(tempfile.mkdtemp(prefix="confgen-bench-"))
    options: dict[str, float] = {}
    for pair in args.options:
        key, sep, value = pair.partition("=")
        try:
            options[key] = float(value)
        except ValueError:
            parser.error(f"--set {pair!r}: expected KEY=NUMBER")
        if not sep or not key:
            parser.error(f"--set {pair!r}: expected KEY=NUMBER")
    ctx = Context(quick=args.quick, seed=args.seed, out=args.out, work=work, options=options)
    results: list[Result] = []
    errors: dict[str, str] = {}
    started = time.monotonic()
    try:
        for name in names:
            print(f"== {name}", flush=True)
            t0 = time.monotonic()
            try:
                result = load(name).run(ctx)
            except Exception:  # noqa: BLE001 - one failed scenario must not lose the others' numbers
                errors[name] = traceback.format_exc()
                print(errors[name], file=sys.stderr, flush=True)
                continue
            result.wall_s = time.monotonic() - t0
            results.append(result)
            for t in result.targets:
                print(f"   {t.name}: {t.measured} -> {'met' if t.met else 'missed' if t.met is False else '-'}",
                      flush=True)
    finally:
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        path = report.write(args.out, info, results, time.monotonic() - started, errors)
        if args.keep_work:
            shutil.copytree(work, args.out / "work", dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"report: {path} ({time.monotonic() - started:.0f} s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
