"""Statistics helpers agree with numpy and pick one consistent run."""

from __future__ import annotations

import numpy as np

from pagoda.bench.common import format_table, median_index, parse_int_list, percentile, summarize


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    xs = rng.exponential(size=101).tolist()
    for q in (0, 10, 50, 90, 99, 100):
        assert abs(percentile(xs, q) - float(np.percentile(xs, q))) < 1e-12
    assert percentile([], 50) != percentile([], 50)  # NaN


def test_summarize_scales():
    s = summarize([0.001, 0.002, 0.003], scale=1e3)
    assert abs(s["mean"] - 2.0) < 1e-9 and abs(s["p50"] - 2.0) < 1e-9 and s["count"] == 3


def test_median_index_and_parsing():
    assert median_index([3.0, 1.0, 2.0]) == 2
    assert median_index([4.0, 1.0, 3.0, 2.0]) in (3,)  # lower median: 2.0
    assert parse_int_list("16, 32,64") == [16, 32, 64]
    text = format_table(["a", "b"], [["x", 1234.5], ["y", 0.5]])
    assert "1,234.5" in text and "0.500" in text
