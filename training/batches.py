"""Training batches: images or cached tower outputs, captions or cached text outputs.

``BatchSource.epoch(e, first_batch, rank, world)`` yields the batches of epoch e
in a fixed order drawn from ``(seed, e)``: the global batch b is
``perm[b*G:(b+1)*G]`` and rank r takes slice r of it, so K ranks see exactly the
batches of one process with a K times larger batch. A locked tower's input is
replaced by its cached output (``training.cache``): no image is decoded when the
image tower is locked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from retrieval.data import BadRecord
from training.cache import image_tower_outputs, text_tower_outputs


@dataclass
class Batch:
    image: torch.Tensor  # (B, 3, H, W) images, or (B, F_img) locked-tower outputs
    text: object  # tokens (tensor or dict of tensors), or (B, F_txt) locked-tower outputs
    image_is_features: bool
    text_is_features: bool
    size: int  # B


def caption_choice(seed: int, epoch: int, counts: torch.Tensor) -> torch.Tensor:
    """Which caption each record uses in ``epoch``: (N,) long, ``0 <= c_i < counts_i``."""
    g = torch.Generator().manual_seed(_mix(seed, epoch, 1))
    u = torch.rand(len(counts), generator=g, dtype=torch.float64)
    return (u * counts).long().clamp(max=counts - 1)


def _mix(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


class _Images(torch.utils.data.Dataset):
    """Record index -> (index, image tensor) or (index, skip reason)."""

    def __init__(self, records, transform):
        self.records, self.transform = records, transform

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        try:
            return i, self.transform(self.records[i].open_image())
        except BadRecord as bad:
            return i, bad.reason


def _collate(items):
    return items  # list of (index, tensor | reason); stacked in BatchSource


class BatchSource:
    """Batches for one training run (see module docstring).

    Args:
        model: the DualEncoder (its lock state decides what is cached).
        pairs: the training PairSet.
        global_batch: batch size summed over ranks.
        workers: DataLoader workers for image decoding.
    """

    def __init__(self, model, pairs, seed: int, device: torch.device, global_batch: int, workers: int = 0):
        self.model, self.pairs, self.seed, self.device = model, pairs, seed, device
        self.global_batch, self.workers = global_batch, workers
        self.image_locked, self.text_locked = getattr(model, "_locked", (False, False))
        self.image_cache = image_tower_outputs(model, pairs, device, workers=workers) if self.image_locked else None
        self.text_cache = text_tower_outputs(model, pairs, device) if self.text_locked else None
        valid = self.image_cache["valid"] if self.image_cache else torch.ones(len(pairs.records), dtype=torch.bool)
        self.indices = valid.nonzero().squeeze(1)  # (N_valid,)
        self.counts = torch.tensor([len(r.captions) for r in pairs.records])
        self.skipped: Counter = Counter()
        if len(self.indices) < global_batch:
            from retrieval.errors import UserError

            raise UserError(f"{len(self.indices)} usable training records, fewer than one batch of {global_batch}")

    def batches_per_epoch(self) -> int:
        return len(self.indices) // self.global_batch  # drop_last: every batch is full

    def epoch(self, epoch: int, first_batch: int, rank: int, world: int):
        """Yield ``(b, Batch)`` for b = first_batch .. batches_per_epoch-1."""
        g = torch.Generator().manual_seed(_mix(self.seed, epoch, 0))
        perm = self.indices[torch.randperm(len(self.indices), generator=g)]
        chosen = caption_choice(self.seed, epoch, self.counts)
        local = self.global_batch // world
        plan = [
            perm[b * self.global_batch + rank * local : b * self.global_batch + (rank + 1) * local].tolist()
            for b in range(first_batch, self.batches_per_epoch())
        ]
        images = iter(self._image_loader(plan)) if not self.image_locked else None
        for offset, idx in enumerate(plan):
            if images is not None:
                items = next(images)
                good = [(i, x) for i, x in items if torch.is_tensor(x)]
                self.skipped.update(x for _, x in items if not torch.is_tensor(x))
                idx = [i for i, _ in good]
                image = torch.stack([x for _, x in good]).to(self.device)
            else:
                image = self.image_cache["features"][idx].to(self.device)
            yield first_batch + offset, Batch(image, self._text(idx, chosen), self.image_locked, self.text_locked, len(idx))

    def _image_loader(self, plan):
        dataset = _Images(self.pairs.records, self.model.image_transform(train=True))
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=plan, num_workers=self.workers, collate_fn=_collate, persistent_workers=False
        )

    def _text(self, idx: list[int], chosen: torch.Tensor):
        idx_t = torch.tensor(idx, dtype=torch.long)
        if self.text_locked:
            rows = self.text_cache["offsets"][idx_t] + chosen[idx_t]
            return self.text_cache["features"][rows].to(self.device)
        captions = [self.pairs.records[i].captions[int(chosen[i])] for i in idx]
        tokens = self.model.tokenize(captions)
        if isinstance(tokens, dict):
            return {k: v.to(self.device) for k, v in tokens.items()}
        return tokens.to(self.device)

    def eval_cache(self, pairs) -> dict:
        """Locked-tower outputs for evaluation data (``None`` for an unlocked tower)."""
        return {
            "image": image_tower_outputs(self.model, pairs, self.device, workers=self.workers) if self.image_locked else None,
            "text": text_tower_outputs(self.model, pairs, self.device) if self.text_locked else None,
        }
