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
    # 60 % within 1.1x: half are within 1 + 0.1 * 50 / 60
    assert got["half_within"] == pytest.approx(1 + 0.1 * 50 / 60)
    # 20 % within 1.1x, 40 % within 1.25x, 70 % within 1.5x
    wide = prediction_error(_cumulative([0, 10, 10, 20, 0, 10, 10, 20, 10, 10, 0]))
    assert wide is not None and wide["half_within"] == pytest.approx(1.25 + 0.25 * (0.5 - 0.4) / (0.7 - 0.4))


def test_a_biased_predictor_shows_in_the_median_and_nothing_predicted_is_none() -> None:
    late = prediction_error(_cumulative([0] * 9 + [50, 40], past=10))  # observed 1.5-4x the prediction
    assert late is not None and late["median_ratio"] == pytest.approx(2.0) and late["within_25"] == 0
    assert late["half_within"] == pytest.approx(1.5 + 0.5 * 0.5 / 0.5)  # 0 within 1.5x, 50 % within 2x
    assert prediction_error({}) is None and prediction_error(_cumulative([0] * 11)) is None
