"""The distinct-captions benchmark's summary: distinct strings shown, lists with a repeat, recall."""

import pytest

from benchmarks.distinct_captions import summary


def test_summary_counts_distinct_strings_repeats_and_own_captions():
    lists = [["Dino", "Dino", "Dino", "a cat"], ["a cat", "a dog", "a hat", "a bat"]]
    own = [{"a cat"}, {"a frog"}]
    assert summary(lists, own) == pytest.approx({"distinct_shown": 3.0, "repeats": 0.5, "recall": 0.5})
    assert summary([["x", "y"]], [{"y", "z"}])["recall"] == 1.0
