"""The overload scenario's optional parts on their own, without re-running the surges:

    python -m bench.scenarios.overload_extra --out DIR [--seeds 7 8] [--fleets-s 45] [--two] [--classes]

(what `python -m bench run --only overload --set overload_two=1 --set overload_fleets_s=45`
adds to a full run), written as the same report tables to DIR/report.md."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .._harness import Context, Result, fmt_ms
from . import overload as ov
from ._runner import measure_or_fail


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scenarios.overload_extra")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[7])
    ap.add_argument("--fleets-s", type=float, default=0.0)
    ap.add_argument("--two", action="store_true")
    ap.add_argument("--classes", action="store_true")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="confgen-bench-extra-"))
    ctx = Context(quick=False, seed=args.seeds[0], out=args.out, work=work)
    res = Result("overload_extra", "Overload: traffic classes, two Envoys, 78 % on every fleet")
    cap = ov.FLEET.capacity_rps()
    try:
        if args.classes:
            ov._classes(ctx, res, args.seeds, cap)
        if args.two:
            for surge in ov.SURGES[:2]:
                for seed in args.seeds:
                    reqs = ov.surge_requests(ov.FLEET, cap, surge, seed + 11)
                    r = measure_or_fail(ctx, ov.FLEET.spec(seed), list(ov.FLEET.max_num_seqs), reqs, ov.TWO,
                                        f"ov-two-{surge.key}-{seed}", warmup_s=ov.LEAD_S + ov.FROM_S,
                                        deadline_s=reqs[-1]["t"] + 1.0, timeout_s=90.0, ingresses=2)
                    print(f"  two Envoys {surge.label} seed {seed}: shed {r['shed']}/{r['requests']} "
                          f"({(r['shed_share'] or 0):.1%}, excess {surge.excess:.1%}), admitted P99 "
                          f"{fmt_ms(r['p99_ms'])} ms, TTFT P99 {fmt_ms(r['ttft_p99_ms'])}, done/s "
                          f"{r['throughput_rps']:.1f}", flush=True)
                    res.tables.append((f"two Envoys, {surge.label}, seed {seed}", ["shed share", "P50 ms", "P99 ms",
                                       "TTFT P99 ms", "TPOT P99 ms", "done/s"],
                                       [[f"{(r['shed_share'] or 0):.1%}", fmt_ms(r["p50_ms"]), fmt_ms(r["p99_ms"]),
                                         fmt_ms(r["ttft_p99_ms"]), fmt_ms(r.get("tpot_p99_ms")),
                                         f"{r['throughput_rps']:.1f}"]]))
        if args.fleets_s > 0:
            ov._every_fleet(ctx, res, args.seeds, args.fleets_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {res.title}", ""]
    for title, head, table in res.tables:
        lines += [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in table]
        lines.append("")
    lines += ["## Targets", ""] + [f"- {t.name}: {t.measured} (goal {t.goal}) -> {'met' if t.met else 'MISSED'}"
                                   for t in res.targets]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    (args.out / "targets.json").write_text(json.dumps([t.row() for t in res.targets], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
