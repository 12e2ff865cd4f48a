"""Batch embedding: the one path from data to (N, D) embeddings, for eval, index and app.

Everything runs under ``torch.no_grad`` in batches, returns float32 CPU tensors of the
model's L2-normalised embedding, and shows progress (triclip.core.progress) when there is more than one
batch. A locked tower's output comes from the on-disk cache (``triclip.model.cache``)
when one is passed, so a run trained on locked towers is embedded without running
them again. The compact transform (``triclip.compact.features``) is applied by the caller.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import NamedTuple, Sequence

import torch
from triclip.core.progress import progress

from triclip.model.accel import IMAGE_BATCH, distinct_texts, image_features, text_batches
from triclip.model.cache import image_tower_pass, nothing_decoded, skipped_images, text_tower_pass
from triclip.data import DEFAULT_MAX_PIXELS, BadRecord, FileImage, PairDataset, PairSet, decode_image
from triclip.core.errors import UserError


class PairEmbeddings(NamedTuple):
    """The embeddings of a PairSet's images and all their captions."""

    image: torch.Tensor  # (N', D) one row per image that decoded
    text: torch.Tensor  # (M, D) every caption of those images, record order then caption order
    text_to_image: torch.Tensor  # (M,) long: row of ``image`` each caption belongs to
    keep: torch.Tensor  # (N',) long: record index of each image row
    skipped: Counter  # records left out because their image did not decode, by reason


def pick_device(device: str | None) -> torch.device:
    """``device`` as given, else CUDA when available, else the CPU; UserError on a bad name."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as err:
        raise UserError(f"--device {device!r}: {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device!r}: no CUDA device is available")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {device!r}: choose cpu or cuda[:N]")
    return dev


@torch.no_grad()
def embed_pairs(
    model, pairs: PairSet, device, batch_size: int = 256, cache: dict | None = None, workers: int = 0
) -> PairEmbeddings:
    """Embed every image and every caption of ``pairs`` (records whose image fails are dropped
    with their captions and counted). ``cache``: :func:`triclip.model.cache.locked_tower_outputs`."""
    model.eval()
    cache = cache or {}
    if cache.get("image") is not None:
        keep = cache["image"]["valid"].nonzero().squeeze(1)
        image_emb = _project_rows(model.project_image, cache["image"]["features"][keep], device, batch_size)
        skipped = skipped_images(cache["image"])
    else:
        image_emb, keep, skipped = embed_records(model, pairs, device, min(batch_size, 64), workers)
    if cache.get("text") is not None:
        offsets = cache["text"]["offsets"]
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in keep.tolist()])
        text_emb = _project_rows(model.project_text, cache["text"]["features"][rows], device, batch_size)
    else:
        text_emb = embed_texts(model, [c for i in keep.tolist() for c in pairs.records[i].captions], device, batch_size)
    counts = torch.tensor([len(pairs.records[i].captions) for i in keep.tolist()])
    text_to_image = torch.repeat_interleave(torch.arange(len(keep)), counts)
    return PairEmbeddings(image_emb, text_emb, text_to_image, keep, skipped)


def _project_rows(project, feats: torch.Tensor, device, batch_size: int) -> torch.Tensor:
    """A head over cached tower outputs. Shape: (N, F) -> (N, D)."""
    return torch.cat([project(feats[s : s + batch_size].to(device)).float().cpu() for s in range(0, len(feats), batch_size)])


@torch.no_grad()
def embed_records(
    model, pairs: PairSet, device, batch_size: int = IMAGE_BATCH, workers: int = 0, threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, Counter]:
    """Embed every record's image by running the image tower (``triclip.model.cache.image_tower_pass``:
    ``threads`` threads each decoding and embedding a batch, by default as many as the fast path takes).

    Returns:
        ``(image_emb (N', D), keep (N',) long, skipped)``: ``keep[i]`` is the record index
        of row i; records whose image fails to decode are left out and counted by reason.
    """
    dataset = PairDataset(pairs, model.image_transform(train=False), train=False)
    embs, keep = [], []
    for idx, features in image_tower_pass(model, dataset, device, batch_size, workers, threads=threads):
        keep.append(idx)
        embs.append(model.project_image(features).float().cpu())  # (B, D)
    if not embs:
        raise nothing_decoded(pairs, dataset)
    return torch.cat(embs), torch.cat(keep), dataset.skipped


@torch.no_grad()
def embed_texts(model, texts: Sequence[str], device, batch_size: int = 256) -> torch.Tensor:
    """Embed captions or text queries. Shape: (M, D)."""
    if not texts:
        return torch.zeros(0, model.embed_dim)
    distinct, inverse = distinct_texts(texts)  # a repeated text runs through the tower once
    batches = text_batches(model, distinct, batch_size)  # similar lengths: little padding
    features = text_tower_pass(model, distinct, batches, device)  # threads each running a batch, in order
    out = [
        model.project_text(f).float().cpu()  # (B, D)
        for f in progress(features, desc="embedding texts", unit="batch", total=len(batches), disable=len(batches) < 2)
    ]
    order = [i for rows in batches for i in rows]
    return torch.cat(out)[torch.tensor(order).argsort()][inverse]  # back to the input order, repeats included


def load_query_image(path: str | os.PathLike):
    """Decode a query image file as RGB (the data layer's checks: bombs, corrupt files); UserError on failure."""
    try:
        return decode_image(FileImage(os.path.abspath(os.fspath(path))), DEFAULT_MAX_PIXELS)
    except BadRecord as bad:
        raise UserError(f"cannot read query image {path}: {bad.reason}") from None


@torch.no_grad()
def embed_pil_images(model, images: Sequence, device, batch_size: int = IMAGE_BATCH) -> torch.Tensor:
    """Embed decoded RGB PIL images. Shape: (Q, D)."""
    if not images:
        return torch.zeros(0, model.embed_dim)
    transform = model.image_transform(train=False)
    tensors = [transform(image) for image in images]
    out = [
        model.project_image(image_features(model, torch.stack(tensors[s : s + batch_size]).to(device))).float().cpu()  # (B, D)
        for s in range(0, len(tensors), batch_size)
    ]
    return torch.cat(out)


def embed_image_files(model, paths: Sequence[str | os.PathLike], device, batch_size: int = IMAGE_BATCH) -> torch.Tensor:
    """Embed query images from files; UserError naming the first unreadable one. Shape: (Q, D)."""
    return embed_pil_images(model, [load_query_image(p) for p in paths], device, batch_size)
