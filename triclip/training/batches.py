"""Training batches: images or cached tower outputs, captions or cached text outputs.

``BatchSource.epoch(e, first_batch, rank, world)`` yields the batches of epoch e
in a fixed order drawn from ``(seed, e)`` (captions: ``triclip.data.pick_caption``): the global batch b is
``perm[b*G:(b+1)*G]`` and rank r takes slice r of it, so K ranks see exactly the
batches of one process with a K times larger batch. A locked tower's input is
replaced by its cached output (``triclip.model.cache``): no image is decoded when the
image tower is locked. A partly locked tower (``triclip.model.unlock``) gets the cached
output of its frozen bottom instead (images: view ``epoch_views(seed, e)[i]`` of record i).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from triclip.data import PairDataset, collate_pairs
from triclip.model.cache import locked_tower_outputs, skipped_images
from triclip.model.unlock import epoch_views, image_bottom_outputs, select_rows, splits, text_bottom_outputs


@dataclass
class Batch:
    image: torch.Tensor  # (B, 3, H, W) images, or (B, F_img) locked-tower outputs
    text: object  # tokens (tensor or dict of tensors), or (B, F_txt) locked-tower outputs
    image_is_features: bool
    text_is_features: bool
    size: int  # B
    image_is_bottom: bool = False  # image holds the frozen bottom's outputs (dict): run the top
    text_is_bottom: bool = False  # text holds the frozen bottom's outputs (dict): run the top


class BatchSource:
    """Batches for one training run (see module docstring).

    Args:
        model: the DualEncoder (its lock state decides what is cached).
        pairs: the training PairSet.
        global_batch: batch size summed over ranks.
        workers: DataLoader workers for image decoding.
        views: cached views per image of a partly locked image tower.
        budget_gb: most GB the cached activations below a cut may take.
    """

    def __init__(
        self, model, pairs, seed: int, device: torch.device, global_batch: int, workers: int = 0,
        views: int = 1, budget_gb: float = 4.0,
    ):
        self.model, self.pairs, self.seed, self.device = model, pairs, seed, device
        self.global_batch, self.workers, self.views = global_batch, workers, views
        self.image_locked, self.text_locked = getattr(model, "_locked", (False, False))
        caches = locked_tower_outputs(model, pairs, device, workers)
        self.image_cache, self.text_cache = caches["image"], caches["text"]
        parts = splits(model)
        self.image_bottom = (
            image_bottom_outputs(model, pairs, device, views, seed, workers, budget_gb) if "image" in parts else None
        )
        self.text_bottom = text_bottom_outputs(model, pairs, device, budget_gb) if "text" in parts else None
        decoded = self.image_cache or self.image_bottom
        valid = decoded["valid"] if decoded else torch.ones(len(pairs.records), dtype=torch.bool)
        self.indices = valid.nonzero().squeeze(1)  # (N_valid,)
        self.dataset = PairDataset(pairs, model.image_transform(train=True), train=True, seed=seed)
        if len(self.indices) < global_batch:
            from triclip.core.errors import UserError

            raise UserError(f"{len(self.indices)} usable training records, fewer than one batch of {global_batch}")

    def batches_per_epoch(self) -> int:
        return len(self.indices) // self.global_batch  # drop_last: every batch is full

    @property
    def skipped(self) -> Counter:
        """Records whose image did not decode, by reason: all of them when the image tower is
        locked (its cache decoded every image), else those met by the epochs so far."""
        if self.image_cache is not None or self.image_bottom is not None:
            return skipped_images(self.image_cache or self.image_bottom)
        return self.dataset.skipped

    def epoch(self, epoch: int, first_batch: int, rank: int, world: int):
        """Yield ``(b, Batch)`` for b = first_batch .. batches_per_epoch-1."""
        perm = self._perm(epoch)
        self.dataset.set_epoch(epoch)
        local = self.global_batch // world
        plan = [
            perm[b * self.global_batch + rank * local : b * self.global_batch + (rank + 1) * local].tolist()
            for b in range(first_batch, self.batches_per_epoch())
        ]
        from_cache = self.image_locked or self.image_bottom is not None
        view = epoch_views(self.seed, epoch, len(self.pairs.records), self.views)  # (N,)
        loader = None if from_cache else iter(
            torch.utils.data.DataLoader(self.dataset, batch_sampler=plan, num_workers=self.workers, collate_fn=collate_pairs)
        )
        for offset, idx in enumerate(plan):
            if loader is not None:
                batch = next(loader)
                if batch is None or (world == 1 and len(batch["index"]) < 2):  # images failed to decode
                    if world > 1:  # the other ranks are already waiting in the loss's all-gather
                        raise RuntimeError(f"rank {rank}: every image of batch {first_batch + offset} failed to decode")
                    continue  # no negatives left: nothing to learn from
                idx = batch["index"].tolist()
                image = batch["image"].to(self.device)
            elif self.image_bottom is not None:
                rows = torch.tensor(idx) * self.views + view[idx]  # (B,) row i * V + v
                image = select_rows(self.image_bottom, rows, self.device)
            else:
                image = self.image_cache["features"][idx].to(self.device)
            text = self._text(idx)
            yield first_batch + offset, Batch(
                image, text, self.image_locked, self.text_locked, len(idx),
                self.image_bottom is not None, self.text_bottom is not None,
            )

    def check_leftover(self, epoch: int) -> None:
        """Decode the records that epoch ``epoch`` left out (its last, partial batch): after one
        full epoch and this, every image has been decoded once and every bad one counted."""
        if self.image_locked or self.image_bottom is not None:
            return  # the cache decoded every image already
        for i in self._perm(epoch)[self.batches_per_epoch() * self.global_batch :].tolist():
            self.dataset[i]  # marks a bad record (PairDataset.skipped)

    def _perm(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return self.indices[torch.randperm(len(self.indices), generator=g)]  # (N_valid,)

    def _text(self, idx: list[int]):
        chosen = [self.dataset.caption_index(i) for i in idx]
        if self.text_locked:
            rows = self.text_cache["offsets"][torch.tensor(idx)] + torch.tensor(chosen)
            return self.text_cache["features"][rows].to(self.device)
        if self.text_bottom is not None:
            rows = self.text_bottom["offsets"][torch.tensor(idx)] + torch.tensor(chosen)
            return select_rows(self.text_bottom, rows, self.device)
        tokens = self.model.tokenize([self.pairs.records[i].captions[c] for i, c in zip(idx, chosen)])
        if isinstance(tokens, dict):
            return {k: v.to(self.device) for k, v in tokens.items()}
        return tokens.to(self.device)
