"""Lazy image references, a cheap header check, and a guarded full decode.

Sources never decode images while they are read: they keep an :class:`ImageRef`
(a file, a tar member, a dataset cell) and check only the header
(:func:`probe_image`: the file is there, Pillow knows the format, the pixel count
is under the limit). :func:`decode_image` does the full decode when a sample is
needed. Pillow's own decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) is never
disabled; ``max_pixels`` can only make it stricter.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from PIL import Image

from retrieval.data.reasons import CORRUPT_IMAGE, DECOMPRESSION_BOMB, MISSING_FILE, BadRecord

DEFAULT_MAX_PIXELS = 40_000_000  # above this an image is a decompression_bomb: no huge decode in training


class ImageRef(Protocol):
    """Where the encoded bytes of one image live."""

    @property
    def location(self) -> str:
        """A readable location, for reports and search results."""

    def open(self) -> BinaryIO:
        """A binary file object over the encoded image; raises ``FileNotFoundError`` if absent."""


@dataclass(frozen=True)
class FileImage:
    """An image file on disk."""

    path: str  # absolute path

    @property
    def location(self) -> str:
        return self.path

    def open(self) -> BinaryIO:
        return open(self.path, "rb")


@dataclass(frozen=True)
class BytesImage:
    """An image held in memory (small test data, or bytes a source already has)."""

    data: bytes  # the encoded image
    name: str = "<bytes>"  # shown as its location

    @property
    def location(self) -> str:
        return self.name

    def open(self) -> BinaryIO:
        return io.BytesIO(self.data)


def pixel_limit(max_pixels: int) -> int:
    """The stricter of ``max_pixels`` and Pillow's own ``Image.MAX_IMAGE_PIXELS``."""
    pillow = Image.MAX_IMAGE_PIXELS
    return max_pixels if pillow is None else min(max_pixels, int(pillow))


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB; transparent pixels become white (clip art is drawn on transparency)."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _open_checked(handle: BinaryIO, max_pixels: int, where: str) -> Image.Image:
    """``Image.open`` (header only) with every failure turned into a :class:`BadRecord`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(handle)
    except Image.DecompressionBombError as err:
        raise BadRecord(DECOMPRESSION_BOMB, f"{where}: {err}") from None
    except Exception as err:  # Pillow raises many types for bad headers
        raise BadRecord(CORRUPT_IMAGE, f"{where}: {err}") from None
    width, height = image.size
    if width * height > pixel_limit(max_pixels):
        image.close()
        raise BadRecord(DECOMPRESSION_BOMB, f"{where}: {width}x{height} pixels exceeds {pixel_limit(max_pixels)}")
    return image


def _open_handle(ref: ImageRef) -> BinaryIO:
    try:
        return ref.open()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:
        raise BadRecord(MISSING_FILE, f"{ref.location}: {err.strerror or err}") from None
    except OSError as err:
        raise BadRecord(MISSING_FILE, f"{ref.location}: {err}") from None


def probe_image(ref: ImageRef, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Check an image cheaply (header only) and return its ``(width, height)``.

    Raises:
        BadRecord: ``missing_file``, ``corrupt_image`` (unknown or unreadable header)
            or ``decompression_bomb``.
    """
    with _open_handle(ref) as handle:
        with _open_checked(handle, max_pixels, ref.location) as image:
            return image.size


def decode_image(ref: ImageRef, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode an image fully and return it as RGB.

    Raises:
        BadRecord: as :func:`probe_image`, plus ``corrupt_image`` for a truncated or
            damaged body.
    """
    with _open_handle(ref) as handle:
        with _open_checked(handle, max_pixels, ref.location) as image:
            try:
                image.load()
                return to_rgb(image)
            except Exception as err:  # truncated data, bad CRC, zlib errors, ...
                raise BadRecord(CORRUPT_IMAGE, f"{ref.location}: {err}") from None
