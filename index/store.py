"""The index directory: its files, reading them, and replacing them all at once.

    INDEX/index.faiss     image vectors (row i = line i of meta.jsonl)
    INDEX/text.faiss      caption vectors, optional (image->text and text->text search)
    INDEX/text_rows.npy   (T, 2) int64: caption vector t is caption text_rows[t, 1] of image row text_rows[t, 0]
    INDEX/meta.jsonl      one line per image row: {"id", "image", "captions", "label"}
    INDEX/manifest.json   run, fingerprint, compact transform, factory, counts (written last)

A write builds a complete new directory beside ``INDEX`` and swaps it in with
``os.replace``; the old one is removed only after the swap, so a crash leaves
either the old index or the new one (or, between the two renames, the old one
under ``.INDEX.old-*``), never a mixture.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from index import faiss_index as fi
from retrieval.errors import UserError

IMAGE_INDEX = "index.faiss"
TEXT_INDEX = "text.faiss"
TEXT_ROWS = "text_rows.npy"
META = "meta.jsonl"
MANIFEST = "manifest.json"
FORMAT = 1  # manifest["format"]; bumped when the layout changes


@dataclass
class IndexContents:
    """Everything an index directory holds, in memory."""

    manifest: dict  # see build.py for the keys
    image_index: faiss.Index  # image vectors, row i = meta[i]
    meta: list[dict]  # {"id", "image", "captions", "label"} per image row
    text_index: faiss.Index | None = None  # caption vectors, or None
    text_rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # (T, 2) image row, caption no.


def is_index_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a manifest (an index directory written by triclip)."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of an index directory; UserError when it is missing or unreadable."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise UserError(f"{path} is not a triclip index (no {MANIFEST})")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {file}: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{file} has an unknown format (expected format {FORMAT})")
    return manifest


def load_contents(path: str | os.PathLike) -> IndexContents:
    """Read a whole index directory, checking that its parts agree in size."""
    path = Path(path)
    manifest = read_manifest(path)
    try:
        image_index = fi.load(path / IMAGE_INDEX)
        text_index = fi.load(path / TEXT_INDEX) if manifest.get("text_count") is not None else None
    except ValueError as err:
        raise UserError(str(err)) from None
    meta = _read_meta(path / META)
    text_rows = np.load(path / TEXT_ROWS) if text_index is not None else np.zeros((0, 2), np.int64)
    contents = IndexContents(manifest, image_index, meta, text_index, text_rows)
    _check_sizes(contents, path)
    return contents


def _read_meta(file: Path) -> list[dict]:
    try:
        with open(file, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {file}: {err}") from None


def _check_sizes(c: IndexContents, path: Path) -> None:
    sizes = {"manifest count": c.manifest.get("count"), "index vectors": c.image_index.ntotal, "meta lines": len(c.meta)}
    if c.text_index is not None:
        sizes_t = {
            "text count": c.manifest.get("text_count"),
            "text vectors": c.text_index.ntotal,
            "text rows": len(c.text_rows),
        }
        if len(set(sizes_t.values())) != 1:
            raise UserError(f"{path} is inconsistent: {sizes_t}")
    if len(set(sizes.values())) != 1:
        raise UserError(f"{path} is inconsistent: {sizes}")


def write_contents(path: str | os.PathLike, contents: IndexContents) -> None:
    """Write every file into a new directory beside ``path`` and swap it in (see the module docstring)."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        fi.save(contents.image_index, tmp / IMAGE_INDEX)
        if contents.text_index is not None:
            fi.save(contents.text_index, tmp / TEXT_INDEX)
            np.save(tmp / TEXT_ROWS, np.asarray(contents.text_rows, dtype=np.int64).reshape(-1, 2))
        with open(tmp / META, "w", encoding="utf-8") as fh:
            for row in contents.meta:
                fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        (tmp / MANIFEST).write_text(json.dumps(contents.manifest, indent=1, default=str) + "\n", encoding="utf-8")
        _swap_in(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(new: Path, path: Path) -> None:
    if not path.exists():
        os.replace(new, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    os.rmdir(old)  # a free name: os.replace onto it
    os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)
