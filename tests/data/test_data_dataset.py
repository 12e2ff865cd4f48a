"""PairDataset: one caption per item (deterministic per seed/epoch/index), None for bad images, collate."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from triclip.data import PairDataset, collate_pairs, load_pairs, pick_caption, to_tensor
from tests.data.data_fixtures import write_image, write_manifest, write_truncated_png


def _pairs(tmp_path: Path, truncated: int = 0):
    rows = []
    for i in range(6):
        write_image(tmp_path / f"{i}.png", colour=(10 * i, 0, 0), size=(8, 8))
        rows.append({"image": f"{i}.png", "captions": [f"img{i} cap{j}" for j in range(3)], "label": i % 2})
    for i in range(truncated):
        write_truncated_png(tmp_path / f"t{i}.png")
        rows.append({"image": f"t{i}.png", "captions": ["cut"]})
    return load_pairs(write_manifest(tmp_path / "m.jsonl", rows))


def test_pick_caption_is_a_deterministic_uniform_choice():
    picks = [pick_caption(3, seed=0, epoch=0, index=i) for i in range(3000)]
    assert picks == [pick_caption(3, 0, 0, i) for i in range(3000)]
    counts = Counter(picks)
    assert set(counts) == {0, 1, 2} and all(900 < n < 1100 for n in counts.values())
    assert picks != [pick_caption(3, 1, 0, i) for i in range(3000)]  # the seed matters
    assert picks != [pick_caption(3, 0, 1, i) for i in range(3000)]  # the epoch matters
    assert pick_caption(1, 5, 7, 9) == 0
    with pytest.raises(ValueError):
        pick_caption(0, 0, 0, 0)


def test_train_items_follow_seed_and_epoch(tmp_path: Path):
    pairs = _pairs(tmp_path)
    dataset = PairDataset(pairs, train=True, seed=3)
    first = [dataset[i]["caption"] for i in range(len(dataset))]
    assert first == [PairDataset(pairs, train=True, seed=3)[i]["caption"] for i in range(len(dataset))]
    for i, caption in enumerate(first):
        assert caption == pairs.records[i].captions[pick_caption(3, 3, 0, i)]
    seen = set()
    for epoch in range(12):
        dataset.set_epoch(epoch)
        seen.update(dataset[0]["caption"] for _ in range(2))
    assert seen == set(pairs.records[0].captions)  # every caption gets used across epochs


def test_eval_items_use_the_first_caption_and_decode_the_image(tmp_path: Path):
    pairs = _pairs(tmp_path)
    item = PairDataset(pairs, train=False)[4]
    assert item["caption"] == "img4 cap0" and item["index"] == 4 and item["label"] == 0
    assert item["image"].shape == (3, 8, 8)
    assert torch.allclose(item["image"][0], torch.full((8, 8), 40 / 255))
    resized = PairDataset(pairs, transform=lambda im: to_tensor(im.resize((4, 4))), train=False)[0]
    assert resized["image"].shape == (3, 4, 4)


def test_bad_image_gives_none_counted_and_dropped_by_collate(tmp_path: Path):
    pairs = _pairs(tmp_path, truncated=2)
    dataset = PairDataset(pairs, train=False)
    items = [dataset[i] for i in range(len(dataset))]
    assert items[6] is None and items[7] is None
    assert dataset.skipped == {"corrupt_image": 2}
    batch = collate_pairs(items)
    assert batch["image"].shape == (6, 3, 8, 8)
    assert batch["index"].tolist() == [0, 1, 2, 3, 4, 5] and batch["index"].dtype == torch.long
    assert batch["caption"][5] == "img5 cap0" and batch["label"] == [0, 1, 0, 1, 0, 1]
    assert collate_pairs([None, None]) is None


def test_skips_are_counted_once_across_dataloader_workers(tmp_path: Path):
    pairs = _pairs(tmp_path, truncated=3)
    dataset = PairDataset(pairs, train=True, seed=1)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate_pairs)
    for epoch in range(2):  # a bad record met again in a later epoch is not counted twice
        dataset.set_epoch(epoch)
        indices = sorted(i for batch in loader if batch is not None for i in batch["index"].tolist())
        assert indices == list(range(6))
        assert dataset.skipped == {"corrupt_image": 3}
