"""A torch ``Dataset`` over a :class:`PairSet`: decoded image + one caption per item.

In training mode each item takes one of its image's captions, chosen by a hash of
``(seed, epoch, index)``: random across epochs, yet the same in every run and in
every DataLoader worker. In evaluation mode it takes the first caption (evaluation
code reads ``pairs.records[i].captions`` for all of them). A record whose image
fails to decode gives ``None`` and is counted once, by reason, in :attr:`PairDataset.skipped`
(kept in shared memory, so failures met in DataLoader worker processes count too);
:func:`collate_pairs` drops the ``None``s.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from triclip.data.reasons import REASONS, BadRecord
from triclip.data.records import PairSet

Transform = Callable[[Image.Image], torch.Tensor]


def pick_caption(num_captions: int, seed: int, epoch: int, index: int) -> int:
    """Index of the caption to use: uniform over ``num_captions``, a pure function of its inputs."""
    if num_captions <= 0:
        raise ValueError(f"num_captions must be positive, got {num_captions}")
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_captions


def to_tensor(image: Image.Image) -> torch.Tensor:
    """PIL RGB image -> float tensor in [0, 1]. Shape: (3, H, W)."""
    array = np.asarray(image, dtype=np.float32) / 255.0  # (H, W, 3)
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class PairDataset(Dataset):
    """Image-caption pairs for training or evaluation.

    Args:
        pairs: the records, from :func:`load_pairs`.
        transform: the model's image transform (PIL RGB -> tensor); ``None`` gives
            :func:`to_tensor`, for images of one size.
        train: choose a random caption per epoch (``True``) or the first (``False``).
        seed: seeds the caption choice.
    """

    def __init__(self, pairs: PairSet, transform: Transform | None = None, train: bool = True, seed: int = 0):
        self.pairs = pairs
        self.transform = transform or to_tensor
        self.train = train
        self.seed = seed
        self.epoch = 0
        # per record: 0 = not known bad, k + 1 = failed with REASONS[k]; in shared memory, so DataLoader
        # workers' findings are seen here, and a bad record is counted once however many epochs meet it
        self._bad = torch.zeros(len(pairs.records), dtype=torch.int8).share_memory_()  # (N,)

    def __len__(self) -> int:
        return len(self.pairs.records)

    def set_epoch(self, epoch: int) -> None:
        """Choose the captions of ``epoch`` (call before iterating; workers started later see it)."""
        self.epoch = epoch

    @property
    def skipped(self) -> Counter:
        """Records that failed to decode so far, by reason (all worker processes included)."""
        totals = torch.bincount(self._bad.long(), minlength=len(REASONS) + 1).tolist()  # (len(REASONS) + 1,)
        return Counter({reason: n for reason, n in zip(REASONS, totals[1:]) if n})

    def first_failure(self) -> str | None:
        """Why the first record that failed to decode fails now, e.g. its path and the OS error (decoded again, in
        this process: a DataLoader worker's detail is not kept); None when none failed."""
        failed = torch.nonzero(self._bad).flatten()  # (k,)
        if len(failed) == 0:
            return None
        record = self.pairs.records[int(failed[0])]
        try:
            record.open_image(self.pairs.max_pixels)
        except BadRecord as bad:
            return bad.detail or bad.reason
        return f"{record.path}: decodes when tried again (it failed during the pass)"

    def caption_index(self, index: int) -> int:
        """Which caption of record ``index`` this epoch uses."""
        count = len(self.pairs.records[index].captions)
        return pick_caption(count, self.seed, self.epoch, index) if self.train else 0

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        record = self.pairs.records[index]
        if self._bad[index]:
            return None
        try:
            image = record.open_image(self.pairs.max_pixels)
        except BadRecord as bad:
            self._bad[index] = REASONS.index(bad.reason) + 1
            return None
        caption = record.captions[self.caption_index(index)]
        return {"image": self.transform(image), "caption": caption, "index": index, "label": record.label}


def collate_pairs(batch: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Stack a batch, dropping the ``None`` items of bad records; ``None`` if none is left.

    Returns:
        ``{"image": (B, 3, H, W) tensor, "caption": list[str], "index": (B,) long tensor,
        "label": list}``.
    """
    items = [item for item in batch if item is not None]
    if not items:
        return None
    return {
        "image": torch.stack([item["image"] for item in items]),  # (B, 3, H, W)
        "caption": [item["caption"] for item in items],
        "index": torch.tensor([item["index"] for item in items], dtype=torch.long),  # (B,)
        "label": [item["label"] for item in items],
    }
