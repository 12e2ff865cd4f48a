"""Train/val/test splits by image content: byte-identical images never straddle two splits.

Records whose images have the same bytes are one image: they are merged into one
record (captions: the union, first seen first; label: the first copy's), so a
picture sits in one split only and its captions travel with it. The distinct
images are ranked by a seeded hash of their content and cut into shares by the
largest remainder, so each split holds its share to within one image, and the
same data and seed give the same split on any machine.
:func:`split_source` (``triclip data split``) does this for any accepted source;
``data prepare openclipart`` uses the same ranking.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Iterable

from retrieval.errors import UserError

SPLITS = ("train", "val", "test")  # manifest names, DIR/<split>.jsonl


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
        return {"train": 1.0 - self.val - self.test, "val": float(self.val), "test": float(self.test)}


def check_shares(val: object, test: object) -> None:
    """Raise ``UserError`` unless both shares are finite numbers >= 0 that leave train a share > 0."""
    for name, share in (("--val", val), ("--test", test)):
        if not isinstance(share, numbers.Real) or isinstance(share, bool) or not math.isfinite(share):
            raise UserError(f"{name} must be a number, got {share!r}")
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
