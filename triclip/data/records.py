"""Records, the set of records a source yields, and how a source is read.

A :class:`Record` is one image with all of its captions and an optional label. Its
image is not decoded when the source is read: :meth:`Record.open_image` does that
on demand and raises :class:`BadRecord` with a short reason when it cannot.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from triclip.data.images import DEFAULT_MAX_PIXELS, ImageRef, decode_image
from triclip.core.errors import UserError

BAD_SEPARATORS = '"\r\n\0'  # csv cannot split on a quote, a line break or NUL


@dataclass(frozen=True)
class DataConfig:
    """How to read a data source. ``None`` means the format's default."""

    image_key: str | None = None  # JSONL field / CSV column / HF column / WebDataset extension of the image; a relative image path is read relative to the manifest / CSV file's folder
    caption_key: str | None = None  # same, for the caption(s)
    label_key: str | None = None  # same, for the optional label
    sep: str | None = None  # CSV/TSV separator, one character; "\t" means a tab (default: "," for .csv, tab for .tsv, unless the header row is split by another: tab, comma, ; or |)
    split: str | None = None  # split of a Hugging Face dataset (default: "train")
    max_pixels: int = DEFAULT_MAX_PIXELS  # images with more pixels are skipped as decompression_bomb

    def __post_init__(self) -> None:
        """Raises ``UserError`` (one line) for a setting no source can use."""
        integral = isinstance(self.max_pixels, numbers.Integral) and not isinstance(self.max_pixels, bool)
        if not integral or self.max_pixels <= 0:
            raise UserError(f"max_pixels must be a positive integer, got {self.max_pixels!r}")
        if self.sep == "\\t":  # typed as --sep '\t' on a command line
            object.__setattr__(self, "sep", "\t")
        if self.sep is not None and (len(self.sep) != 1 or self.sep in BAD_SEPARATORS):
            raise UserError(
                f"--sep must be one character other than a quote, a line break or NUL (or \\t for a tab), "
                f"got {self.sep!r}"
            )


@dataclass(frozen=True, eq=False)
class Record:
    """One image, all of its captions, and an optional label.

    Attributes:
        key: stable id, unique within its source (e.g. the image path as written).
        captions: the image's non-empty captions, in source order.
        label: class label (str or int) or ``None``.
        image: where the encoded image lives; read only by :meth:`open_image`.
    """

    key: str
    captions: list[str]
    label: Any
    image: ImageRef

    @property
    def path(self) -> str:
        """A readable location of the image (an absolute path for plain files)."""
        return self.image.location

    def open_image(self, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
        """Decode the image fully, as RGB (transparency composited on white).

        Raises:
            BadRecord: ``missing_file``, ``corrupt_image`` or ``decompression_bomb``.
        """
        return decode_image(self.image, max_pixels)


@dataclass
class PairSet:
    """The usable records of one source and the count of skipped ones by reason."""

    records: list[Record]  # usable records, in source order
    skipped: Counter = field(default_factory=Counter)  # reason -> number of skipped records
    source: str = ""  # format name and path, e.g. "jsonl:/data/train.jsonl"
    max_pixels: int = DEFAULT_MAX_PIXELS  # the limit the records were checked against
    examples: dict = field(default_factory=dict)  # reason -> the first skipped records' details (reasons.EXAMPLES)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def fingerprint(self) -> str:
        """sha256 over every record's key, captions and label: a cache key for features of this data."""
        digest = hashlib.sha256()
        for record in self.records:
            line = json.dumps([record.key, record.captions, record.label], ensure_ascii=False, default=str)
            digest.update(line.encode("utf-8"))
            digest.update(b"\n")
        return digest.hexdigest()
