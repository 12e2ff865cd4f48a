"""Cached outputs of locked towers (LiT): computed once, reused by later epochs and runs.

A locked tower is a fixed function, so its output for a record never changes.
The cache key hashes the tower's weights, the image transform and the data's
fingerprint (keys and captions), so a different model or different data can
never read a stale entry. Files live in ``$TRICLIP_CACHE`` (default
``~/.cache/triclip``) as safetensors, written atomically.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from triclip.core.progress import progress

from triclip.core.errors import UserError
from triclip.core.io import atomic_path
from triclip.model.accel import IMAGE_BATCH, module_hash
from triclip.model.prefetch import ordered_map, prefetched


def cache_dir() -> Path:
    """``$TRICLIP_CACHE/features``; UserError when ``$TRICLIP_CACHE`` is something other than a folder."""
    root = Path(os.environ.get("TRICLIP_CACHE", Path.home() / ".cache" / "triclip"))
    if root.exists() and not root.is_dir():
        raise UserError(f"TRICLIP_CACHE={root} is not a folder; point it at a folder (or unset it)")
    return root / "features"


def nothing_decoded(pairs, dataset) -> UserError:
    """The error when no image of ``pairs`` decoded in a pass over ``dataset`` (a ``PairDataset``): every skip
    reason, read-time ones too, and why the first image fails (its path and the OS or decoder error)."""
    from triclip.data.reasons import count_by_reason

    skipped = count_by_reason(pairs.skipped, dataset.skipped)
    first = dataset.first_failure()
    return UserError(
        f"no image of {pairs.source or 'the data'} could be decoded; skipped: {skipped}"
        + (f"; the first: {first}" if first else "")
    )


def _key(*parts: str) -> str:
    text = re.sub(r" at 0x[0-9a-f]+", "", "\n".join(parts))  # object addresses in reprs change per process
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@torch.no_grad()
def image_tower_outputs(model, pairs, device, batch_size: int = IMAGE_BATCH, workers: int = 0) -> dict[str, torch.Tensor]:
    """``{"features": (N, F_img), "valid": (N,) bool, "bad": (N,) int8}`` for every record of ``pairs``.

    Records whose image fails to decode get ``valid = False`` and ``bad = k + 1`` for
    reason ``REASONS[k]`` (see :func:`skipped_images`).
    """
    from triclip.data import PairDataset

    path = image_cache_path(model, pairs)
    if path.exists():
        return load_file(str(path))
    dataset = PairDataset(pairs, model.image_transform(train=False), train=False)
    feats, valid = None, torch.zeros(len(pairs.records), dtype=torch.bool)
    model.image_tower.eval()
    for idx, out in image_tower_pass(model, dataset, device, batch_size, workers, desc="caching locked image tower"):
        if feats is None:
            feats = torch.zeros(len(pairs.records), out.shape[1])
        feats[idx] = out.float().cpu()
        valid[idx] = True
    if feats is None:
        raise nothing_decoded(pairs, dataset)
    result = {"features": feats, "valid": valid, "bad": dataset._bad.clone()}
    with atomic_path(path) as tmp:
        save_file(result, str(tmp))
    return result


@torch.no_grad()
def image_tower_pass(
    model, dataset, device, batch_size: int, workers: int = 0, desc: str = "embedding images", threads: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(index (b,), tower features (b, F))`` for each batch of ``dataset`` (a ``PairDataset``) with a
    decodable image, in order, through the fast path; a progress bar from the second batch on.

    ``threads`` (default :func:`~triclip.model.accel.pass_threads`; ``workers`` 0 only): that many
    threads each decode a batch and run a single-threaded tower on it. With one, the next batch is decoded
    in a background thread (``workers`` 0) or by DataLoader worker processes while the tower runs.
    The features are the same bit for bit either way (tests/training/test_cache.py, tests/model/test_accel.py).
    """
    from triclip.model.accel import image_features, pass_threads
    from triclip.data import collate_pairs

    if threads is None:
        threads = pass_threads(model.image_tower, device) if workers == 0 else 1
    starts = range(0, len(dataset), batch_size)
    if threads > 1:

        def work(start: int):  # one batch on this thread: decode, then the tower single-threaded
            with torch.no_grad():  # grad mode is per thread
                batch = collate_pairs([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
                if batch is None:  # every image of the batch failed to decode
                    return None
                return batch["index"], image_features(model, batch["image"], single_thread=True)

        results = ordered_map(work, starts, threads)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate_pairs)
        batches = prefetched(loader) if workers == 0 else loader  # decoding overlaps the tower
        results = (None if b is None else (b["index"], image_features(model, b["image"].to(device))) for b in batches)
    for result in progress(results, desc=desc, unit="batch", total=len(starts), disable=len(starts) < 2):
        if result is not None:
            yield result


@torch.no_grad()
def text_tower_outputs(model, pairs, device, batch_size: int = 256) -> dict[str, torch.Tensor]:
    """``{"features": (M, F_txt), "offsets": (N+1,)}``: all captions, record i owns rows
    ``offsets[i]:offsets[i+1]``."""
    from triclip.model.accel import distinct_texts, text_batches

    path = text_cache_path(model, pairs)
    if path.exists():
        return load_file(str(path))
    captions = [c for r in pairs.records for c in r.captions]
    counts = torch.tensor([len(r.captions) for r in pairs.records])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    distinct, inverse = distinct_texts(captions)  # openclipart's train split: 11,987 captions, 4,032 distinct
    model.text_tower.eval()
    batches = text_batches(model, distinct, batch_size)
    results = text_tower_pass(model, distinct, batches, device)
    feats = None
    for rows, out in progress(zip(batches, results), desc="caching locked text tower", unit="batch", total=len(batches)):
        if feats is None:
            feats = torch.zeros(len(distinct), out.shape[1])
        feats[torch.tensor(rows)] = out.float().cpu()
    result = {"features": feats[inverse], "offsets": offsets}  # (M, F): one row per caption, in record order
    with atomic_path(path) as tmp:
        save_file(result, str(tmp))
    return result


def text_tower_pass(model, texts: Sequence[str], batches: list[list[int]], device) -> Iterator[torch.Tensor]:
    """The text tower's features (b, F) of ``texts`` for each batch of rows in ``batches``, in order,
    through the fast path. As :func:`image_tower_pass`: with more than one batch, as many threads as
    :func:`~triclip.model.accel.pass_threads` each run a batch through a single-threaded tower; the batches are
    tokenized in the calling thread (a tokenizer's padding settings are not thread-safe). One batch (a query):
    the tower on all of torch's threads."""
    from triclip.model.accel import pass_threads, text_features

    threads = pass_threads(model.text_tower, device) if len(batches) > 1 else 1

    def tokens_of(rows: list[int]):
        tokens = model.tokenize([texts[i] for i in rows])
        return {k: v.to(device) for k, v in tokens.items()} if isinstance(tokens, dict) else tokens.to(device)

    def run(tokens) -> torch.Tensor:  # (b, F)
        with torch.no_grad():  # grad mode is per thread
            return text_features(model, tokens, single_thread=threads > 1)

    tokenized = map(tokens_of, batches)
    return ordered_map(run, tokenized, threads) if threads > 1 else map(run, tokenized)


# Bumped when image decoding changes what a file decodes to (2: EXIF orientation, 16-bit scaling),
# so features cached by an older decoder are not reused.
DECODER_VERSION = 2


def image_cache_path(model, pairs) -> Path:
    """Where the locked image tower's outputs for ``pairs`` are (or would be) cached."""
    transform = repr(model.image_transform(train=False))
    key = _key("image", module_hash(model.image_tower), transform, f"decoder={DECODER_VERSION}", pairs.fingerprint)
    return cache_dir() / f"image-{key}.safetensors"


def text_cache_path(model, pairs) -> Path:
    """Where the locked text tower's outputs for ``pairs`` are (or would be) cached."""
    max_length = getattr(model.text_tower, "max_length", None)  # truncation changes the outputs
    key = _key("text", module_hash(model.text_tower), f"max_length={max_length}", pairs.fingerprint)
    return cache_dir() / f"text-{key}.safetensors"


def existing_locked_outputs(model, pairs) -> dict:
    """Like :func:`locked_tower_outputs`, but only what is cached already (``None`` elsewhere); computes nothing."""
    image_locked, text_locked = getattr(model, "_locked", (False, False))
    image, text = image_cache_path(model, pairs), text_cache_path(model, pairs)
    return {
        "image": load_file(str(image)) if image_locked and image.exists() else None,
        "text": load_file(str(text)) if text_locked and text.exists() else None,
    }


def skipped_images(cached: dict[str, torch.Tensor]) -> Counter:
    """The records a cached image pass could not decode, by reason."""
    from triclip.data.reasons import REASONS

    bad = cached.get("bad")
    if bad is None:  # a cache written before reasons were kept
        return Counter({"corrupt_image": int((~cached["valid"].bool()).sum())}) - Counter()
    totals = torch.bincount(bad.long(), minlength=len(REASONS) + 1).tolist()
    return Counter({reason: n for reason, n in zip(REASONS, totals[1:]) if n})


def locked_tower_outputs(model, pairs, device, workers: int = 0) -> dict:
    """``{"image": ..., "text": ...}``: the cached outputs of the towers that ``model`` keeps
    locked (``None`` for an unlocked tower)."""
    image_locked, text_locked = getattr(model, "_locked", (False, False))
    return {
        "image": image_tower_outputs(model, pairs, device, workers=workers) if image_locked else None,
        "text": text_tower_outputs(model, pairs, device) if text_locked else None,
    }
