"""The long differential run: many mutants, several processes, every finding kept.

    nice -n 10 python -m tests.differential.campaign --mutants 10000 --jobs 2 --out DIR

Each job draws mutants from the same strategy as the suite's bounded run (its own seed),
judges each one (validate, render for every target, real Envoy and nginx), and never
stops at a finding: each is written to DIR/finding-<job>-<n>.yaml (the mutant, with the
problems as comments) and counted. DIR/summary-<job>.json holds the counts.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

from ._mutate import mutants
from ._oracle import judge


def _compile_templates_once() -> None:
    """The nginx renderer builds a fresh Jinja environment per render, so every render
    compiles its templates again (a third of a mutant's time when profiled). The campaign
    judges thousands of mutants: within its own processes, reuse one environment."""
    import confgen.nginx
    from confgen.nginx import _templates, upstream

    shared = functools.cache(_templates.environment)
    for module in (_templates, upstream, confgen.nginx):
        if hasattr(module, "environment"):
            module.environment = shared  # type: ignore[attr-defined]


def run_job(job: int, count: int, out: Path, first_seed: int) -> dict[str, object]:
    _compile_templates_once()
    stats: Counter[str] = Counter()
    started = time.monotonic()

    @seed(first_seed + job)
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(mutants())
    def one(mutant: tuple[str, list[str], str]) -> None:
        base, applied, text = mutant
        outcome = judge(text.encode())
        stats["mutants"] += 1
        stats["accepted" if outcome.accepted else "refused"] += 1
        if stats["mutants"] % 50 == 0:  # progress, readable while the run goes on
            progress = {"job": job, "seconds": round(time.monotonic() - started, 1), **stats}
            (out / f"progress-{job}.json").write_text(json.dumps(progress) + "\n")
        if outcome.problems:
            stats["findings"] += 1
            notes = "".join(f"# {line}\n" for p in outcome.problems for line in p.splitlines())
            header = f"# base: {base}\n# mutations: {applied}\n"
            (out / f"finding-{job}-{stats['findings']}.yaml").write_text(header + notes + text)

    one()
    summary = {"job": job, "seed": first_seed + job, "seconds": round(time.monotonic() - started, 1), **stats}
    (out / f"summary-{job}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mutants", type=int, default=10_000, help="in all, split over the jobs")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    per_job = -(-args.mutants // args.jobs)
    with multiprocessing.Pool(args.jobs) as pool:
        results = pool.starmap(run_job, [(j, per_job, args.out, args.seed) for j in range(args.jobs)])
    total: Counter[str] = Counter()
    for result in results:
        total.update({k: v for k, v in result.items() if k in ("mutants", "accepted", "refused", "findings")})
    print(json.dumps(dict(total), indent=2))


if __name__ == "__main__":
    main()
