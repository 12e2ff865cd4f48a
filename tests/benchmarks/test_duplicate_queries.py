"""The recall ceiling of identical captions against the real metric on an oracle embedding."""

import pytest
import torch

from benchmarks.duplicate_queries import group_sizes, recall_ceiling
from triclip.compact.metrics import retrieval_recall


def _oracle(captions: list[str]):
    """One caption per image; texts one-hot per distinct text; images of a text score 1, 1-e, 1-2e, ..."""
    distinct = sorted(set(captions))
    text = torch.eye(len(distinct), dtype=torch.float64)[[distinct.index(c) for c in captions]]  # (M, T)
    seen: dict[str, int] = {}
    image = torch.empty_like(text)
    for i, c in enumerate(captions):
        j = seen[c] = seen.get(c, -1) + 1
        image[i] = text[i] * (1.0 - 1e-3 * j)
    return image, text, torch.arange(len(captions))


@pytest.mark.parametrize("k", [1, 5, 10])
def test_ceiling_equals_the_recall_of_the_best_ranking(k):
    captions = ["a"] * 15 + ["b"] * 3 + ["c"] + ["d"] * 7
    image, text, owner = _oracle(captions)
    best = retrieval_recall(image, text, owner, ks=(k,))[f"t2i_r{k}"]
    assert recall_ceiling(captions, k) == pytest.approx(best, abs=1e-12)
    assert recall_ceiling(captions, 10) == pytest.approx((10 + 3 + 1 + 7) / 26)


def test_unique_captions_have_no_ceiling_and_group_sizes_count_texts():
    assert recall_ceiling(["x", "y", "z"], 1) == 1.0
    assert group_sizes(["a", "b", "a", "a"]).tolist() == [3, 1, 3, 3]
    with pytest.raises(ValueError):
        recall_ceiling([], 10)
