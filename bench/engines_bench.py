"""Benchmark `engines.extract` against a full prometheus_client parse (a benchmark, not a test).

    python -m bench.engines_bench [BODY_FILE [ENGINE_KIND]]

Without arguments it uses the repository's vLLM V1 fixture, cut to 50 KB at a line end.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from sidecar.observe.engines import extract

_FIXTURE = Path(__file__).resolve().parents[1] / "tests/sidecar/fixtures/vllm_v1_dp2.prom"


def bench_extract(body: bytes, engine_kind: str = "vllm", rounds: int = 300) -> float:
    """Median seconds per `extract(engine_kind, body)` call over `rounds` timed batches."""
    per_call: list[float] = []
    batch = 10
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(batch):
            extract(engine_kind, body)
        per_call.append((time.perf_counter() - start) / batch)
    return statistics.median(per_call)


def bench_full_parse(body: bytes, rounds: int = 20) -> float:
    """Median seconds for a full prometheus_client parse of `body`, for comparison."""
    text = body.decode()
    times: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in text_string_to_metric_families(text):
            pass
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cut(body: bytes, size: int) -> bytes:
    return body if len(body) <= size else body[: body.rindex(b"\n", 0, size) + 1]


def main(argv: list[str]) -> int:
    if argv:
        body, kind = Path(argv[0]).read_bytes(), (argv[1] if len(argv) > 1 else "vllm")
    else:
        body, kind = _cut(_FIXTURE.read_bytes(), 50_000), "vllm"
    print(f"body: {len(body)} bytes, engine {kind}: {extract(kind, body)}")
    print(f"extract:    {bench_extract(body, kind) * 1e3:.3f} ms (median)")
    print(f"full parse: {bench_full_parse(body) * 1e3:.3f} ms (median, prometheus_client)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
