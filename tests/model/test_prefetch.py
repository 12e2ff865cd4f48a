"""A prefetched loader yields the plain loader's items, in order, made ahead in a background thread."""

import threading

import pytest
import torch

from triclip.data import PairDataset, collate_pairs, load_pairs
from triclip.data.builtin import prepare
from triclip.model.prefetch import PrefetchConfig, prefetched
from triclip.model.towers import efficientnet_lite0_transform


def _threads() -> int:
    return sum(t.name == "triclip-prefetch" for t in threading.enumerate())


def test_same_batches_in_the_same_order_as_the_plain_loader(tmp_path):
    prepare("shapes", str(tmp_path), num=60, seed=0)
    pairs = load_pairs(str(tmp_path / "train.jsonl"))
    dataset = PairDataset(pairs, efficientnet_lite0_transform(train=False, size=64), train=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=7, collate_fn=collate_pairs)  # uneven last batch
    plain = list(loader)
    ahead = list(prefetched(loader))
    assert len(ahead) == len(plain) == len(loader) > 2
    for mine, theirs in zip(ahead, plain):
        assert torch.equal(mine["index"], theirs["index"])
        assert torch.equal(mine["image"], theirs["image"])  # the same decode, bit for bit
        assert mine["caption"] == theirs["caption"]
    assert _threads() == 0


def test_the_next_item_is_made_while_the_caller_uses_this_one():
    second_made = threading.Event()

    def items():
        yield 0
        second_made.set()
        yield 1

    seen = []
    for item in prefetched(items()):
        if item == 0:  # a plain loop makes the second item only after this body: the wait would time out
            assert second_made.wait(timeout=10)
        seen.append(item)
    assert seen == [0, 1]


def test_an_error_is_raised_where_the_plain_loop_meets_it():
    def items():
        yield from range(3)
        raise ValueError("broken image batch")

    seen = []
    with pytest.raises(ValueError, match="broken image batch"):
        for item in prefetched(items(), PrefetchConfig(depth=1)):
            seen.append(item)
    assert seen == [0, 1, 2]
    assert _threads() == 0


def test_leaving_early_stops_the_thread():
    made = []

    def items():
        for i in range(1000):
            made.append(i)
            yield i

    for item in prefetched(items(), PrefetchConfig(depth=2)):
        if item == 3:
            break
    assert _threads() == 0  # joined before the generator closed
    assert len(made) <= 3 + 1 + 2 + 1  # what was used, the queue's depth, and the one being made
