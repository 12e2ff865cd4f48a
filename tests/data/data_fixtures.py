"""Small real files for the data tests: images, broken images, manifests, tar shards."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def image_bytes(colour=(200, 30, 30), size=(16, 12), fmt="PNG", noise: bool = False) -> bytes:
    """An encoded RGB image; ``noise`` makes the body large enough to truncate meaningfully."""
    array = np.zeros((size[1], size[0], 3), dtype=np.uint8) + np.array(colour, dtype=np.uint8)
    if noise:
        array = np.random.default_rng(0).integers(0, 256, array.shape, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt)
    return out.getvalue()


def write_image(path: Path, colour=(200, 30, 30), size=(16, 12), fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = fmt or ("JPEG" if path.suffix.lower() in (".jpg", ".jpeg") else "PNG")
    path.write_bytes(image_bytes(colour, size, fmt))
    return path


def write_truncated_png(path: Path) -> Path:
    """A real PNG cut in half: the header reads, the body does not decode."""
    data = image_bytes(size=(64, 64), noise=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data[: len(data) // 2])
    return path


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def bomb_png_bytes(width: int, height: int) -> bytes:
    """A few-hundred-byte PNG whose header claims ``width x height`` pixels."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + _chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def write_manifest(path: Path, rows: list) -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written as they are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    """A plain tar with the given members, in order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def mean_colour(image: Image.Image) -> tuple[int, int, int]:
    return tuple(int(round(c)) for c in np.asarray(image, dtype=np.float64).reshape(-1, 3).mean(0))
