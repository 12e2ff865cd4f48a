"""benchmarks.bench_lite_variants: the best round per preset and its ratio to the first preset."""

import pytest

from benchmarks.bench_lite_variants import summarize


def test_summarize_takes_the_best_round_and_divides_by_the_first_preset():
    rows = summarize({"lite": [2.0, 1.0, 1.5], "lite2": [4.0, 2.5, 3.0]}, items=100)
    assert [r["preset"] for r in rows] == ["lite", "lite2"]
    assert rows[0]["per_s"] == pytest.approx(100.0) and rows[0]["ratio_to_first"] == pytest.approx(1.0)
    assert rows[1]["per_s"] == pytest.approx(40.0) and rows[1]["ratio_to_first"] == pytest.approx(0.4)
