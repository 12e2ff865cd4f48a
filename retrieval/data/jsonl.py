"""JSONL manifests: one pair per line, ``{"image": path, "captions": [...], "label": optional}``.

Image paths are relative to the manifest's folder (or absolute). ``captions`` may
also be a single string. Field names come from :class:`DataConfig`.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from retrieval.data.images import FileImage
from retrieval.data.reasons import BAD_ROW, EMPTY_CAPTION, BadRecord
from retrieval.data.records import DataConfig, Record
from retrieval.data.sources import clean_captions, clean_label, register_source, resolve_path


def _is_manifest(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".jsonl")


@register_source("jsonl", _is_manifest, "a .jsonl manifest")
def read_jsonl(path: str, config: DataConfig) -> Iterator[Record | BadRecord]:
    """Yield one record per non-blank line; a bad line yields ``BadRecord(bad_row)``."""
    image_key, caption_key = config.image_key or "image", config.caption_key or "captions"
    label_key = config.label_key or "label"
    base = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                yield _parse_line(line, number, base, image_key, caption_key, label_key)


def _nonblank_str(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _parse_line(
    line: str, number: int, base: str, image_key: str, caption_key: str, label_key: str
) -> Record | BadRecord:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        return BadRecord(BAD_ROW, f"line {number}: {err}")
    if not isinstance(row, dict) or not _nonblank_str(row.get(image_key)) or caption_key not in row:
        return BadRecord(BAD_ROW, f"line {number}: needs a non-empty string {image_key!r} and {caption_key!r}")
    captions = clean_captions(row[caption_key])
    if captions is None:
        return BadRecord(BAD_ROW, f"line {number}: {caption_key!r} must be a string or a list of strings")
    if not captions:
        return BadRecord(EMPTY_CAPTION, f"line {number}")
    image = row[image_key]
    label = clean_label(row.get(label_key))
    return Record(key=image, captions=captions, label=label, image=FileImage(resolve_path(base, image)))
