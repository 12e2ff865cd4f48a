"""open_clip's CSV/TSV: a header row, one (image path, caption) pair per row.

Columns default to open_clip's ``filepath`` and ``title`` (``--csv-img-key``,
``--csv-caption-key`` there); the separator defaults to ``,`` for ``.csv`` and a
tab for ``.tsv``. Rows naming the same image are merged into one record with all
their captions (COCO-style files list each image once per caption). A row with the
wrong number of fields is a ``bad_row``.
"""

from __future__ import annotations

import csv
import os
from typing import Iterator

from retrieval.data.images import FileImage
from retrieval.data.reasons import BAD_ROW, EMPTY_CAPTION, BadRecord
from retrieval.data.records import DataConfig, Record
from retrieval.data.sources import clean_label, register_source, resolve_path
from retrieval.errors import UserError

DEFAULT_SEPARATORS = {".csv": ",", ".tsv": "\t"}  # extension -> separator


def _is_table(path: str) -> bool:
    return os.path.isfile(path) and os.path.splitext(path)[1].lower() in DEFAULT_SEPARATORS


def _column(header: list[str], name: str, option: str, path: str) -> int:
    if name not in header:
        raise UserError(f"{path}: no column {name!r} (columns: {', '.join(header)}); choose one with {option}")
    return header.index(name)


@register_source("csv", _is_table, "a .csv/.tsv file with a header row")
def read_table(path: str, config: DataConfig) -> Iterator[Record | BadRecord]:
    """Yield one record per distinct image path, and a ``BadRecord`` per malformed row."""
    sep = config.sep or DEFAULT_SEPARATORS[os.path.splitext(path)[1].lower()]
    base = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        rows = csv.reader(handle, delimiter=sep)
        header = [name.strip() for name in next(rows, [])]
        image_col = _column(header, config.image_key or "filepath", "--image-key", path)
        caption_col = _column(header, config.caption_key or "title", "--caption-key", path)
        label_col = _label_column(header, config.label_key, path)
        groups: dict[str, tuple[list[str], object]] = {}  # image as written -> (captions, label)
        for number, row in enumerate(rows, 2):
            if not row:
                continue
            image = row[image_col].strip() if len(row) == len(header) else ""
            if not image:
                yield BadRecord(BAD_ROW, f"row {number}: {len(row)} fields for {len(header)} columns")
                continue
            captions, _ = groups.setdefault(image, ([], row[label_col] if label_col is not None else None))
            caption = " ".join(row[caption_col].split())
            if caption and caption not in captions:
                captions.append(caption)
    for image, (captions, label) in groups.items():
        if not captions:
            yield BadRecord(EMPTY_CAPTION, image)
            continue
        yield Record(key=image, captions=captions, label=clean_label(label), image=FileImage(resolve_path(base, image)))


def _label_column(header: list[str], label_key: str | None, path: str) -> int | None:
    """The label column: the one named by ``label_key``, else ``label`` when present, else none."""
    if label_key is not None:
        return _column(header, label_key, "--label-key", path)
    return header.index("label") if "label" in header else None
