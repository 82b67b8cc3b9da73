"""Regenerate the golden outputs: `python -m tests.golden --update` (what `make golden` runs)."""

from __future__ import annotations

import argparse
import shutil
import sys

from tests.golden import GOLDEN, cases, golden_dir, render, stored


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__)
    parser.add_argument("--update", action="store_true", help="rewrite tests/golden from the current renderers")
    args = parser.parse_args(argv)
    changed = 0
    wanted = set()
    for example, target in cases():
        files = render(example, target)
        base = golden_dir(example, target)
        wanted.add(base)
        if stored(example, target) == files:
            continue
        changed += 1
        print(f"{'rewrote' if args.update else 'differs'}: {base.relative_to(GOLDEN)}")
        if args.update:
            shutil.rmtree(base, ignore_errors=True)
            for rel, data in files.items():
                (base / rel).parent.mkdir(parents=True, exist_ok=True)
                (base / rel).write_bytes(data)
    stale = [d for d in GOLDEN.glob("*/*") if d.is_dir() and d not in wanted and d.parent.name != "inputs"]
    for d in stale:
        changed += 1
        print(f"{'removed' if args.update else 'stale'}: {d.relative_to(GOLDEN)}")
        if args.update:
            shutil.rmtree(d)
    for d in GOLDEN.iterdir() if args.update else ():
        if d.is_dir() and d.name not in ("__pycache__", "inputs") and not any(d.iterdir()):
            d.rmdir()
    if not changed:
        print("golden files are current")
    return 1 if changed and not args.update else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
