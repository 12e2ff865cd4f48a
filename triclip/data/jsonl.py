"""JSONL manifests: one pair per line, ``{"image": path, "captions": [...], "label": optional}``.

Image paths are relative to the manifest's folder (or absolute). ``captions`` may
also be a single string. Field names come from :class:`DataConfig`. A line that is
not valid UTF-8 is a ``bad_encoding`` record; a byte order mark is ignored.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from triclip.data.images import FileImage
from triclip.data.reasons import BAD_ENCODING, BAD_ROW, EMPTY_CAPTION, BadRecord
from triclip.data.records import DataConfig, Record
from triclip.data.sources import clean_captions, clean_label, register_source, resolve_path
from triclip.data.text import read_lines


def _is_manifest(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".jsonl")


@register_source("jsonl", _is_manifest, "a .jsonl manifest")
def read_jsonl(path: str, config: DataConfig) -> Iterator[Record | BadRecord]:
    """Yield one record per non-blank line; a bad line yields ``BadRecord(bad_row)`` (or ``bad_encoding``)."""
    image_key, caption_key = config.image_key or "image", config.caption_key or "captions"
    label_key = config.label_key or "label"
    base = os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as handle:
        for line in read_lines(handle):
            if not line.valid:
                yield BadRecord(BAD_ENCODING, f"line {line.number}: not valid UTF-8")
            elif line.text.strip():
                yield _parse_line(line.text, line.number, base, image_key, caption_key, label_key)


def _nonblank_str(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _encodable(values: list) -> bool:
    """False when a string holds a lone surrogate (JSON allows ``"\\ud800"``; UTF-8 does not)."""
    try:
        "".join(v for v in values if isinstance(v, str)).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _parse_line(
    line: str, number: int, base: str, image_key: str, caption_key: str, label_key: str
) -> Record | BadRecord:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as err:  # bad JSON, huge integers, absurd nesting
        return BadRecord(BAD_ROW, f"line {number}: {type(err).__name__}: {err}")
    if not isinstance(row, dict) or not _nonblank_str(row.get(image_key)) or caption_key not in row:
        return BadRecord(BAD_ROW, f"line {number}: needs a non-empty string {image_key!r} and {caption_key!r}")
    captions = clean_captions(row[caption_key])
    if captions is None:
        return BadRecord(BAD_ROW, f"line {number}: {caption_key!r} must be a string or a list of strings")
    if not captions:
        return BadRecord(EMPTY_CAPTION, f"line {number}")
    image = row[image_key]
    label = clean_label(row.get(label_key))
    if not _encodable([image, *captions, label]):
        return BadRecord(BAD_ENCODING, f"line {number}: a lone surrogate escape (\\udXXX) is not text")
    return Record(key=image, captions=captions, label=label, image=FileImage(resolve_path(base, image)))
