"""A prefetched loader yields the plain loader's items, in order, made ahead in a background thread;
an ordered map yields a function's results in order, computed by several threads at once."""

import threading
import time

import pytest
import torch

from triclip.data import PairDataset, collate_pairs, load_pairs
from triclip.data.builtin import prepare
from triclip.model.prefetch import PrefetchConfig, ordered_map, prefetched
from triclip.model.towers import efficientnet_lite0_transform


def _threads() -> int:
    return sum(t.name == "triclip-prefetch" or t.name.startswith("triclip-pass") for t in threading.enumerate())


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


# ---------------------------------------------------------------------------- ordered_map


def test_ordered_map_gives_the_results_in_order_while_jobs_finish_out_of_order():
    finished = []

    def work(job):
        time.sleep(0.02 * (job % 3 == 0))  # every third job is the slow one: later jobs finish first
        finished.append(job)
        return job * job

    assert list(ordered_map(work, range(20), threads=3)) == [j * j for j in range(20)]
    assert finished != sorted(finished)  # the jobs really ran at once
    assert _threads() == 0


def test_ordered_map_runs_its_jobs_on_that_many_threads_at_once():
    barrier = threading.Barrier(2, timeout=10)  # two jobs must run together, or the barrier breaks

    def work(job):
        barrier.wait()
        return threading.current_thread().name

    names = list(ordered_map(work, range(4), threads=2))
    assert len(set(names)) == 2 and all(n.startswith("triclip-pass") for n in names)


def test_ordered_map_raises_an_error_at_its_place_after_the_results_before_it():
    def work(job):
        if job == 3:
            raise ValueError("broken image batch")
        return job

    seen = []
    with pytest.raises(ValueError, match="broken image batch"):
        for result in ordered_map(work, range(10), threads=2):
            seen.append(result)
    assert seen == [0, 1, 2]
    assert _threads() == 0


def test_leaving_an_ordered_map_early_cancels_the_jobs_not_started():
    started = []

    def work(job):
        started.append(job)
        return job

    for result in ordered_map(work, range(1000), threads=2, cfg=PrefetchConfig(depth=2)):
        if result == 3:
            break
    assert _threads() == 0  # joined before the generator closed
    assert len(started) <= 4 + 2 + 2  # what was used, and at most threads + depth submitted ahead
