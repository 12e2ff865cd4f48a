"""Embedding for the index: records' images, captions, query texts and query image files.

Everything runs under ``torch.no_grad`` in batches, returns float32 CPU tensors of the
model's L2-normalised embedding (N, D), and shows a tqdm bar when there is more than
one batch. The compact transform (``retrieval.compact``) is applied by the caller.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Sequence

import torch
from tqdm.auto import tqdm

from retrieval.data import DEFAULT_MAX_PIXELS, BadRecord, FileImage, PairDataset, PairSet, collate_pairs, decode_image
from retrieval.errors import UserError


def pick_device(device: str | None) -> torch.device:
    """``device`` as given, else CUDA when available, else the CPU; UserError on a bad name."""
    try:
        return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as err:
        raise UserError(f"--device {device!r}: {err}") from None


@torch.no_grad()
def embed_records(
    model, pairs: PairSet, device: torch.device, batch_size: int = 64, workers: int = 0
) -> tuple[torch.Tensor, torch.Tensor, Counter]:
    """Embed every record's image.

    Returns:
        ``(image_emb (N', D), keep (N',) long, skipped)``: ``keep[i]`` is the record index
        of row i; records whose image fails to decode are left out and counted by reason.
    """
    dataset = PairDataset(pairs, model.image_transform(train=False), train=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate_pairs)
    embs, keep = [], []
    for batch in tqdm(loader, desc="embedding images", unit="batch", disable=len(loader) < 2):
        if batch is not None:
            keep.append(batch["index"])
            embs.append(model.encode_image(batch["image"].to(device)).float().cpu())  # (B, D)
    if not embs:
        raise UserError(f"no image of {pairs.source or 'the data'} could be decoded; skipped: {dict(dataset.skipped)}")
    return torch.cat(embs), torch.cat(keep), dataset.skipped


@torch.no_grad()
def embed_texts(model, texts: Sequence[str], device: torch.device, batch_size: int = 256) -> torch.Tensor:
    """Embed captions or text queries. Shape: (M, D)."""
    if not texts:
        return torch.zeros(0, model.embed_dim)
    starts = range(0, len(texts), batch_size)
    out = [
        model.encode_text(list(texts[s : s + batch_size])).float().cpu()  # (B, D)
        for s in tqdm(starts, desc="embedding texts", unit="batch", disable=len(starts) < 2)
    ]
    return torch.cat(out)


@torch.no_grad()
def embed_image_files(
    model, paths: Sequence[str | os.PathLike], device: torch.device, batch_size: int = 64
) -> torch.Tensor:
    """Embed query images from files; UserError naming the first unreadable one. Shape: (Q, D)."""
    transform = model.image_transform(train=False)
    tensors = []
    for path in paths:
        try:
            tensors.append(transform(decode_image(FileImage(os.path.abspath(os.fspath(path))), DEFAULT_MAX_PIXELS)))
        except BadRecord as bad:
            raise UserError(f"cannot read query image {path}: {bad.reason}") from None
    if not tensors:
        return torch.zeros(0, model.embed_dim)
    out = [
        model.encode_image(torch.stack(tensors[s : s + batch_size]).to(device)).float().cpu()  # (B, D)
        for s in range(0, len(tensors), batch_size)
    ]
    return torch.cat(out)
