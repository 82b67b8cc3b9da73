"""Plain `confgen validate` never passes what a real proxy refuses.

Two tiers: the regression corpus (one small topology per class of disagreement found,
each with its expected outcome) and a bounded, seeded hypothesis run that mutates the
examples and valid cases toward edge values. The long run is
`python -m tests.differential.campaign` (see its docstring).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from ._mutate import mutants
from ._oracle import judge

CORPUS = Path(__file__).parent / "corpus"
CASES = sorted(CORPUS.glob("*.yaml"))

# The bounded CI run: measured ~0.45 s per mutant on the 2-core machine (two thirds reach
# both proxies). The proxies are skipped past the soft budget so a loaded machine makes the
# run check less, never fail; CONFGEN_FUZZ_EXAMPLES raises the count for a local run.
EXAMPLES = int(os.environ.get("CONFGEN_FUZZ_EXAMPLES", "110"))
PROXY_BUDGET_S = float(os.environ.get("CONFGEN_FUZZ_PROXY_BUDGET_S", "60"))


def _expectation(case: Path) -> tuple[str, str | None]:
    for line in case.read_text().splitlines():
        if line.startswith("# expect: "):
            words = line.removeprefix("# expect: ").split()
            return words[0], (words[1] if len(words) > 1 else None)
    raise AssertionError(f"{case.name}: no '# expect:' line")


def test_corpus_covers_every_class() -> None:
    """The corpus keeps at least one case per class of issue #10's disagreements."""
    classes = " ".join(case.read_text().splitlines()[0] for case in CASES)
    for needle in ("zero durations", "token buckets", "nginx limits", "auth.client_header", "ASCII digits",
                   "past uint32"):
        assert needle in classes, needle
    for case in CASES:
        assert case.read_text().startswith("# class: "), case.name


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_corpus_case(case: Path) -> None:
    """A corpus topology gets its expected outcome: refused with an error at the expected
    field (never a traceback), or accepted by validate AND rendered for every target AND
    accepted by the real Envoy and the real nginx."""
    expect, where = _expectation(case)
    outcome = judge(case.read_bytes(), name=str(case))
    assert outcome.problems == []
    if expect == "accepted":
        assert outcome.accepted
    else:
        assert expect == "refused"
        assert not outcome.accepted
        assert where in outcome.errors, outcome.errors


def test_strict_dns_pools_are_bounded() -> None:
    """Found by the campaign: 102 strict_dns pools of 1,000 workers passed validate and made
    `envoy --mode validate` run out of file descriptors. Past 10,000 strict_dns workers in all
    the loader refuses, pinned to `pools` (too large to keep as a corpus file)."""
    def topology(count: int) -> bytes:
        workers = "\n".join(f"      - 10.{i >> 16}.{(i >> 8) & 255}.{i & 255}:8000" for i in range(1, count + 1))
        return (
            "version: 1\nname: dns\nlisteners: [{name: public, port: 8080}]\n"
            f"pools:\n  - name: p\n    engine: vllm\n    models: [m]\n    discovery: strict_dns\n"
            f"    workers:\n{workers}\n"
        ).encode()

    refused = judge(topology(10_001), proxies=False)
    assert not refused.accepted and refused.errors == ["pools"] and refused.problems == []
    accepted = judge(topology(10_000), proxies=False)
    assert accepted.accepted and accepted.problems == []


_started: list[float] = []


@seed(20261130)
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
          phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
@given(mutants())
def test_validate_never_passes_what_a_proxy_refuses(mutant: tuple[str, list[str], str]) -> None:
    """Seeded, bounded differential run: for every edge-value mutant of an example or valid
    case, either the loader refuses it cleanly, or every target renders it and the real
    Envoy and nginx accept it. A failure prints the mutant: keep it in corpus/."""
    if not _started:
        _started.append(time.monotonic())
    base, applied, text = mutant
    proxies = time.monotonic() - _started[0] < PROXY_BUDGET_S
    outcome = judge(text.encode(), proxies=proxies)
    assert outcome.problems == [], f"{base} {applied}:\n{text[:4000]}"
