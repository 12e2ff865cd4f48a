"""Writing manifests and images atomically, the deterministic train/val split by name, and
what a built-in dataset builder returns."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from PIL import Image

from triclip.core.io import atomic_path


def manifest_row(image: str, captions: list[str], label: Any = None) -> dict:
    """One manifest line: ``{"image": path relative to the manifest, "captions": [...], "label": ...}``."""
    return {"image": image, "captions": list(captions), "label": label}


def _atomic_write(path: str, write, mode: str, sync: bool) -> None:
    """Write through ``write(handle)`` into a temp file beside ``path``, then replace it (``triclip.core.io.atomic_path``)."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as handle:
            write(handle)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())


def write_manifest(path: str, rows: Iterable[dict]) -> int:
    """Write JSONL rows atomically (UTF-8, one object per line); return the number of rows."""
    lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in rows]
    _atomic_write(path, lambda handle: handle.writelines(lines), "w", sync=True)
    return len(lines)


def save_image(image: Image.Image, path: str) -> None:
    """Save an image atomically; the format follows the extension."""
    fmt = Image.registered_extensions()[os.path.splitext(path)[1].lower()]
    _atomic_write(path, lambda handle: image.save(handle, format=fmt), "wb", sync=False)


def split_of(name: str, val_fraction: float = 0.1) -> str:
    """``"val"`` or ``"train"`` from a hash of ``name``: the same on every machine and run."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1], got {val_fraction}")
    bucket = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64
    return "val" if bucket < val_fraction else "train"


@dataclass
class Built:
    """What a built-in dataset builder produced: manifest rows per split and skipped records."""

    train: list[dict]  # rows of train.jsonl
    val: list[dict]  # rows of val.jsonl
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    test: list[dict] | None = None  # rows of test.jsonl; None: the dataset has no test split
    info: dict = field(default_factory=dict)  # more summary fields (e.g. duplicates_merged)
