"""benchmarks/bench_train.py compares like with like: the open_clip_train side sees the same
batches, computes the same objective and takes the same optimizer step as triclip's."""

import copy

import pytest
import torch

from benchmarks.bench_train import (
    BenchConfig,
    OpenClipTrainer,
    Plan,
    TriclipTrainer,
    epoch_plan,
    pack_tokens,
    unpack_tokens,
)
from triclip.data import load_pairs
from triclip.model.model import ModelConfig, build_model

BATCH = 8


@pytest.fixture(scope="module")
def trainers(shapes_data):
    """A triclip and an open_clip trainer of one tiny model (same initial weights)."""
    pairs = load_pairs(str(shapes_data / "train.jsonl"))
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny"))
    triclip = TriclipTrainer(model, pairs, BATCH, seed=3, workers=0, total_steps=10)
    open_clip = OpenClipTrainer(copy.deepcopy(model), pairs, BATCH, seed=3, workers=0, total_steps=10)
    return triclip, open_clip


def test_open_clip_loader_yields_triclip_batches(trainers):
    triclip, open_clip = trainers
    ours = [batch for _, batch in triclip.source.epoch(2, 0, 0, 1)][:3]
    theirs = list(open_clip.loader(2, 3).dataloader)
    assert len(theirs) == 3
    for a, (images, tokens) in zip(ours, theirs):
        assert torch.equal(a.image, images)  # same records, order and transform
        assert torch.equal(a.text, tokens)  # same captions and tokenizer
    other_epoch = next(iter(open_clip.loader(3, 1).dataloader))[0]
    assert not torch.equal(other_epoch, theirs[0][0])  # each epoch (round) has its own order


def test_epoch_plan_covers_distinct_records(trainers):
    source = trainers[0].source
    plan = epoch_plan(source, epoch=1, steps=100)
    assert len(plan) == source.batches_per_epoch()
    flat = [i for batch in plan for i in batch]
    assert all(len(batch) == BATCH for batch in plan) and len(set(flat)) == len(flat)


def test_one_step_of_each_trainer_gives_the_same_weights(shapes_data):
    """Same weights, batch, loss (ClipLoss vs infonce), lr schedule, clipping and AdamW: same update."""
    pairs = load_pairs(str(shapes_data / "train.jsonl"))
    torch.manual_seed(1)
    model = build_model(ModelConfig(preset="tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    triclip = TriclipTrainer(model, pairs, BATCH, seed=0, workers=0, total_steps=4)
    open_clip = OpenClipTrainer(copy.deepcopy(model), pairs, BATCH, seed=0, workers=0, total_steps=4)
    for epoch in range(3):  # one step per epoch: open_clip's scheduler step is then the epoch, like our counter
        triclip.run(epoch, 1)
        open_clip.run(epoch, 1)
    a, b = triclip.model.state_dict(), open_clip.model.state_dict()
    moved = [k for k in a if not torch.equal(a[k], before[k])]
    assert len(moved) > 10  # both towers, heads and the logit scale trained
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-6, msg=k)


def test_pack_tokens_round_trip():
    ids = torch.randint(0, 100, (4, 7))
    assert pack_tokens(ids) == (ids, ())
    tokens = {"input_ids": ids, "attention_mask": (ids > 50).long(), "token_type_ids": torch.zeros_like(ids)}
    packed, keys = pack_tokens(tokens)
    assert packed.shape == (4, 3, 7)
    back = unpack_tokens(packed, keys)
    assert back.keys() == tokens.keys() and all(torch.equal(back[k], tokens[k]) for k in tokens)


def test_plans_and_bad_settings():
    cfg = BenchConfig(steps=10, round_steps=3)
    assert cfg.plan("tiny") == Plan(9, 3, 5)  # a whole number of rounds
    assert BenchConfig().plan("lite") == Plan(6, 1, 1)
    assert BenchConfig(warmup=0, cache_steps=2).cache_plan() == Plan(2, 1, 0)
    for bad in ({"batch": 1}, {"steps": 0}, {"warmup": -1}, {"presets": [], "cache_preset": None}):
        with pytest.raises(ValueError):
            BenchConfig(**bad)
