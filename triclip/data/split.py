"""Train/val/test splits by image content: byte-identical images never straddle two splits.

Records whose images have the same bytes are one image: they are merged into one
record (captions: the union, first seen first; label: the first copy's), so a
picture sits in one split only and its captions travel with it. The distinct
images are ranked by a seeded hash of their content and cut into shares by the
largest remainder, so each split holds its share to within one image, and the
same data and seed give the same split on any machine.

:func:`split_source` (``triclip data split``) does this for any accepted source
and writes ``DIR/{train,val,test}.jsonl``. Image files stay where they are (the
manifests point at them, relative to ``DIR``); images a source holds as bytes
(Hugging Face cells, WebDataset members) are written once under ``DIR/images/``,
named by their hash. Every image is read and decoded once, so a damaged one is
skipped and counted here rather than in training. ``data prepare openclipart``
uses the same ranking.
"""

from __future__ import annotations

import hashlib
import io
import math
import numbers
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from PIL import Image

from triclip.data.images import BytesImage, FileImage, ImageRef, decode_image
from triclip.data.manifest import manifest_row, write_manifest
from triclip.data.reasons import MISSING_FILE, NOT_A_FILE, BadRecord, count_by_reason, merge_examples, note_example
from triclip.data.records import DataConfig, PairSet
from triclip.data.sources import load_pairs, with_unique_key
from triclip.core.errors import UserError
from triclip.core.io import atomic_path, claim_output_dir, writing
from triclip.core.progress import progress

SPLITS = ("train", "val", "test")  # manifest names, DIR/<split>.jsonl


def split_manifests(path: str | os.PathLike) -> list[str]:
    """The manifests of a split folder (``data split`` / ``data prepare`` --out: ``DIR/train.jsonl`` ...), in
    SPLITS order; [] when ``path`` is not a folder holding any of them."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return []
    return [m for m in (os.path.join(path, f"{name}.jsonl") for name in SPLITS) if os.path.isfile(m)]


def split_val(path: str | os.PathLike | None) -> str | None:
    """``DIR/val.jsonl`` when ``path`` is a split folder that has one, else None."""
    val = os.path.join(os.fspath(path), "val.jsonl") if path else None
    return val if val in split_manifests(path or "") else None


def load_collection(path: str | os.PathLike, config: DataConfig | None = None) -> PairSet:
    """Every record of a split folder, all its splits in one PairSet (a data split never holds an image
    twice); any other source as ``load_pairs`` reads it. What ``index build --data DIR`` indexes."""
    manifests = split_manifests(path)
    if not manifests:
        return load_pairs(path, config)
    config = config or DataConfig()
    parts = [load_pairs(m, config) for m in manifests]
    seen: Counter = Counter()
    records = [with_unique_key(r, seen) for part in parts for r in part.records]
    names = "+".join(os.path.basename(m) for m in manifests)
    skipped = sum((part.skipped for part in parts), Counter())
    return PairSet(records=records, skipped=skipped, source=f"splits:{os.fspath(path)} ({names})", max_pixels=config.max_pixels,
                   examples=merge_examples(*(part.examples for part in parts)))


@dataclass(frozen=True)
class SplitConfig:
    """How to cut distinct images into splits; checked on construction (``UserError``, one line)."""

    val: float = 0.1  # share of distinct images in val.jsonl
    test: float = 0.1  # share of distinct images in test.jsonl
    seed: int = 0  # which images go where: same data and seed, same split

    def __post_init__(self) -> None:
        check_shares(self.val, self.test)
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool):
            raise UserError(f"--seed must be an integer, got {self.seed!r}")

    @property
    def shares(self) -> dict[str, float]:
        """``{"train": 1 - val - test, "val": val, "test": test}``."""
        train = round(1.0 - self.val - self.test, 12)  # 0.8, not 0.7999999999999999
        return {"train": train, "val": float(self.val), "test": float(self.test)}


def check_shares(val: object, test: object) -> None:
    """Raise ``UserError`` unless both shares are finite numbers >= 0 that leave train a share > 0."""
    for name, share in (("--val", val), ("--test", test)):
        if not isinstance(share, numbers.Real) or isinstance(share, bool) or not math.isfinite(share):
            raise UserError(f"{name} must be a finite number, got {share!r}")
        if share < 0:
            raise UserError(f"{name} must be >= 0, got {share}")
    if val + test >= 1:  # type: ignore[operator]
        raise UserError(f"--val + --test must be below 1 (train needs a share), got {val} + {test}")


def apportion(n: int, shares: dict[str, float]) -> dict[str, int]:
    """Counts per split that add up to ``n``, each within one of ``n * share`` (largest remainder).

    Ties between equal remainders go to the split named first in ``shares``.
    """
    quotas = {name: n * share for name, share in shares.items()}
    counts = {name: math.floor(q) for name, q in quotas.items()}
    left = n - sum(counts.values())
    names = list(shares)
    by_remainder = sorted(names, key=lambda name: (-(quotas[name] - counts[name]), names.index(name)))
    for name in by_remainder[:left]:
        counts[name] += 1
    return counts


def rank_key(digest: str, seed: int) -> bytes:
    """Where an image with content hash ``digest`` falls in the seeded order."""
    return hashlib.sha256(f"split:{seed}:{digest}".encode("utf-8")).digest()


def assign_splits(digests: list[str], config: SplitConfig) -> list[str]:
    """The split of each distinct image, given its content hash.

    The images are ordered by :func:`rank_key`; the first ``test`` share goes to
    test, the next ``val`` share to val, the rest to train (counts from :func:`apportion`).

    Args:
        digests: content hashes, one per distinct image (no repeats).
        config: the shares and the seed.

    Returns:
        ``"train"``, ``"val"`` or ``"test"`` for each digest, in the same order.
    """
    if len(set(digests)) != len(digests):
        raise ValueError("assign_splits needs distinct digests: merge byte-identical images first")
    counts = apportion(len(digests), config.shares)
    order = sorted(range(len(digests)), key=lambda i: rank_key(digests[i], config.seed))
    names = ["test"] * counts["test"] + ["val"] * counts["val"] + ["train"] * counts["train"]
    result = [""] * len(digests)
    for position, index in enumerate(order):
        result[index] = names[position]
    return result


def merge_captions(caption_lists: Iterable[Iterable[str]]) -> list[str]:
    """The union of several records' captions: first seen first, each once, empties dropped."""
    return list(dict.fromkeys(c for captions in caption_lists for c in captions if c))


def content_hash(data: bytes) -> str:
    """sha256 of an image's bytes, as hex: what "byte-identical" means here."""
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------- any source


def split_source(
    path: str | os.PathLike,
    out: str | os.PathLike,
    data: DataConfig | None = None,
    config: SplitConfig | None = None,
    overwrite: bool = False,
) -> dict:
    """Split a data source by image content into ``out/{train,val,test}.jsonl``.

    Args:
        path: any accepted source (``.jsonl``, ``.csv``/``.tsv``, a ``save_to_disk``
            folder or ``hf:NAME``, WebDataset shards).
        out: output folder; a new or empty one, or a data set with ``overwrite``.
        data: how to read the source (keys, separator, HF split).
        config: shares and seed (checked when it was made).
        overwrite: replace a data set already in ``out``.

    Returns:
        ``{"source", "out", "seed", "shares", "records", "images", "duplicates_merged",
        "label_conflicts", "images_written", "train", "val", "test", "skipped",
        "<split>_manifest"}``: ``records`` usable records (``images`` distinct ones plus
        ``duplicates_merged`` copies), ``train``/``val``/``test`` images per split.

    Raises:
        UserError: bad ``out``, bad source, no usable record, or too few images for train.
    """
    config = config or SplitConfig()
    out = os.path.abspath(os.fspath(out))
    claim_output_dir(out, "data", overwrite=overwrite)
    pairs = load_pairs(path, data)
    try:
        with writing(out, "data", overwrite=overwrite) as folder:  # a replacement is built beside, then swapped in
            images, unreadable, written, skipped, counts, examples = _write_split(pairs, path, config, str(folder))
    except OSError as err:  # unwritable, full, or not a folder on the way
        raise UserError(f"cannot write the split in {out}: {err.filename or out}: {err.strerror or err}") from None
    manifests = {split: os.path.join(out, f"{split}.jsonl") for split in SPLITS}
    return {
        "source": pairs.source,
        "out": out,
        "seed": int(config.seed),
        "shares": config.shares,
        "records": sum(image.copies for image in images),
        "images": len(images),
        "duplicates_merged": sum(image.copies - 1 for image in images),
        "label_conflicts": sum(image.labels_differ for image in images),
        "images_written": written,
        **counts,
        "skipped": skipped,
        "skipped_examples": examples,
        **{f"{split}_manifest": manifests[split] for split in SPLITS},
    }


def _write_split(pairs: PairSet, path, config: SplitConfig, out: str):
    """The images and manifests of the split in ``out``; ``(images, unreadable, written, skipped, counts, examples)``:
    ``examples`` names the first skipped records of each reason (:func:`triclip.data.reasons.merge_examples`)."""
    unread: dict[str, list[str]] = {}
    images, unreadable, written = collect_images(pairs, out, unread)
    skipped = count_by_reason(pairs.skipped, unreadable)
    examples = merge_examples(pairs.examples, unread)
    if not images:
        raise UserError(f"no usable records in {os.fspath(path)}; skipped: {skipped}")
    splits = assign_splits([image.digest for image in images], config)
    if "train" not in splits:
        raise UserError(
            f"only {len(images)} distinct image(s) in {os.fspath(path)}: too few to split "
            f"with --val {config.val} --test {config.test} (train would be empty)"
        )
    manifests = {split: os.path.join(out, f"{split}.jsonl") for split in SPLITS}
    counts = {
        split: write_manifest(manifests[split], [im.row() for im, s in zip(images, splits) if s == split])
        for split in SPLITS
    }
    return images, unreadable, written, skipped, counts, examples


@dataclass
class DistinctImage:
    """One distinct image of a source and everything its copies said about it."""

    digest: str  # sha256 of the image bytes
    image: str  # path written in the manifest, relative to the output folder
    captions: list[str]  # union of the copies' captions, first seen first
    label: Any  # the first copy's label
    copies: int = 1  # records that had these bytes
    labels_differ: bool = False  # a later copy had another label

    def add(self, captions: list[str], label: Any) -> None:
        """Fold in one more record with the same bytes."""
        self.copies += 1
        self.labels_differ |= label != self.label
        self.captions = merge_captions([self.captions, captions])

    def row(self) -> dict:
        return manifest_row(self.image, self.captions, self.label)


def collect_images(pairs: PairSet, out: str, examples: dict | None = None) -> tuple[list[DistinctImage], Counter, int]:
    """Read, hash and check every record's image; merge byte-identical ones (``examples``, when given, collects
    the first skipped records' details by reason: :func:`triclip.data.reasons.note_example`).

    Returns:
        The distinct images in order of first appearance, the records skipped by
        reason (unreadable or undecodable images), and how many images were written
        under ``out/images/``.
    """
    found: dict[str, DistinctImage] = {}
    skipped: Counter = Counter()
    written = 0
    for record in progress(pairs.records, desc="hashing images", unit=" img"):
        try:
            data = read_image_bytes(record.image)
            digest = content_hash(data)
            if digest not in found:
                extension = check_image(data, record.image.location, pairs.max_pixels)
        except BadRecord as bad:
            skipped[bad.reason] += 1
            if examples is not None:
                note_example(examples, bad)
            continue
        if digest in found:
            found[digest].add(record.captions, record.label)
            continue
        if isinstance(record.image, FileImage):
            where = os.path.relpath(record.image.path, out).replace(os.sep, "/")
        else:
            where = f"images/{digest[:24]}{extension}"
            with atomic_path(os.path.join(out, where)) as tmp:
                tmp.write_bytes(data)
            written += 1
        found[digest] = DistinctImage(digest, where, list(record.captions), record.label)
    return list(found.values()), skipped, written


def read_image_bytes(ref: ImageRef) -> bytes:
    """The encoded bytes of an image.

    Raises:
        BadRecord: ``missing_file`` (absent or unreadable) or ``not_a_file``.
    """
    try:
        with ref.open() as handle:
            return handle.read()
    except IsADirectoryError as err:
        raise BadRecord(NOT_A_FILE, f"{ref.location}: {err.strerror or err}") from None
    except (OSError, ValueError) as err:  # ValueError: e.g. a NUL byte in a path
        raise BadRecord(MISSING_FILE, f"{ref.location}: {err}") from None


def check_image(data: bytes, location: str, max_pixels: int) -> str:
    """Decode an image fully (as training will); return the file extension of its format.

    Raises:
        BadRecord: ``corrupt_image`` or ``decompression_bomb``.
    """
    decode_image(BytesImage(data, location), max_pixels).close()
    with Image.open(io.BytesIO(data)) as image:
        fmt = image.format or ""
    return {"JPEG": ".jpg", "TIFF": ".tif"}.get(fmt, f".{fmt.lower()}" if fmt else ".img")
