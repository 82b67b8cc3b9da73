"""The bench's summary of the picker's prediction error, from its Prometheus histogram."""

from __future__ import annotations

import pytest

from bench._stats import prediction_error

EDGES = ("0.25", "0.5", "0.67", "0.8", "0.9", "1.0", "1.1", "1.25", "1.5", "2.0", "4.0")


def _cumulative(counts: list[int], past: int = 0) -> dict[str, float]:
    out, running = {}, 0
    for le, n in zip(EDGES, counts, strict=True):
        running += n
        out[le] = float(running)
    out["+Inf"] = float(running + past)
    return out


def test_shares_and_median_from_cumulative_buckets() -> None:
    # 10 under 0.8, 10 in (0.8, 0.9], 30 in (0.9, 1.0], 30 in (1.0, 1.1], 10 in (1.1, 1.25], 10 above
    got = prediction_error(_cumulative([0, 2, 3, 5, 10, 30, 30, 10, 5, 4, 1]))
    assert got is not None and got["requests"] == 100
    assert got["within_10"] == pytest.approx(0.6) and got["within_25"] == pytest.approx(0.8)
    assert got["median_ratio"] == pytest.approx(0.9 + 0.1 * 30 / 30)  # the 50th of 100 ends the (0.9, 1.0] bucket


def test_a_biased_predictor_shows_in_the_median_and_nothing_predicted_is_none() -> None:
    late = prediction_error(_cumulative([0] * 9 + [50, 40], past=10))  # observed 1.5-4x the prediction
    assert late is not None and late["median_ratio"] == pytest.approx(2.0) and late["within_25"] == 0
    assert prediction_error({}) is None and prediction_error(_cumulative([0] * 11)) is None
