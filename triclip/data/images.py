"""Lazy image references, a cheap header check, and a guarded full decode.

Sources never decode images while they are read: they keep an :class:`ImageRef`
(a file, a tar member, a dataset cell) and check only the header
(:func:`probe_image`: the file is there, Pillow knows the format, the pixel count
is under the limit). :func:`decode_image` does the full decode when a sample is
needed. Pillow's own decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) is never
disabled; ``max_pixels`` can only make it stricter.

Only regular files are opened: a directory, FIFO (opening one would block), device
or socket is a ``not_a_file`` record, found by ``stat`` before anything is opened.
Decoding applies the EXIF orientation and scales 16-bit and float images to 8 bits
by their value range (Pillow's own conversion clips them at 255).
"""

from __future__ import annotations

import io
import os
import stat
import warnings
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import numpy as np
from PIL import Image, ImageOps

from triclip.data.reasons import CORRUPT_IMAGE, DECOMPRESSION_BOMB, MISSING_FILE, NOT_A_FILE, BadRecord

DEFAULT_MAX_PIXELS = 40_000_000  # above this an image is a decompression_bomb: no huge decode in training
PROBES_KEPT = 200_000  # file probes a process remembers (probe_image; ~40 MB at most)
_PROBED: dict[tuple, tuple[int, int]] = {}  # _probe_key -> (width, height)


class ImageRef(Protocol):
    """Where the encoded bytes of one image live."""

    @property
    def location(self) -> str:
        """A readable location, for reports and search results."""

    def open(self) -> BinaryIO:
        """A binary file object over the encoded image.

        Raises:
            OSError: the image is absent or unreadable (``FileNotFoundError`` when absent).
            BadRecord: the image cannot be used for another reason (e.g. ``not_a_file``).
        """


@dataclass(frozen=True)
class FileImage:
    """An image file on disk."""

    path: str  # absolute path

    @property
    def location(self) -> str:
        return self.path

    def open(self) -> BinaryIO:
        return open_regular(self.path)


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


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    kinds.update({stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"})
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def open_regular(path: str) -> BinaryIO:
    """Open a regular file for binary reading, without ever blocking on a FIFO or device.

    The path is checked with ``stat`` first, then opened non-blocking and checked
    again on the open descriptor (it may have been swapped in between).

    Raises:
        BadRecord: ``not_a_file`` for a directory, FIFO, device or socket;
            ``missing_file`` for a path with a NUL byte.
        OSError: absent, unreadable, a symlink loop, a name too long.
    """
    if "\0" in path:
        raise BadRecord(MISSING_FILE, f"{path!r}: the path contains a NUL byte")
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise BadRecord(NOT_A_FILE, f"{path}: {_kind(mode)}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BadRecord(NOT_A_FILE, f"{path}: {_kind(mode)}")
        return os.fdopen(fd, "rb")  # left non-blocking: no effect on disk files, no hang on /proc/kmsg-like ones
    except BaseException:
        os.close(fd)
        raise


def pixel_limit(max_pixels: int) -> int:
    """The stricter of ``max_pixels`` and Pillow's own ``Image.MAX_IMAGE_PIXELS``."""
    pillow = Image.MAX_IMAGE_PIXELS
    return max_pixels if pillow is None else min(max_pixels, int(pillow))


def _value_range(mode: str, top: float) -> float:
    """The value that means white for a high-depth image whose largest value is ``top``."""
    if mode.startswith("I;16"):
        return 65535.0
    steps = (1.0, 255.0, 65535.0) if mode == "F" else (65535.0,)  # floats in [0, 1] are common
    return next((step for step in steps if top <= step), max(top, 1.0))


def to_8bit(image: Image.Image) -> Image.Image:
    """A 16-bit (``I;16*``), 32-bit (``I``) or float (``F``) grey image as 8-bit ``L``, scaled by its range.

    16-bit images use the full 0..65535 range; ``I`` images too unless their values
    exceed it; float images in [0, 1] are scaled by 255. Other modes are returned as they are.
    """
    if not (image.mode.startswith("I") or image.mode == "F"):
        return image
    values = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)  # (H, W)
    white = _value_range(image.mode, float(values.max(initial=0.0)))
    scaled = np.clip(np.rint(values * (255.0 / white)), 0, 255).astype(np.uint8)  # (H, W)
    return Image.fromarray(scaled, mode="L")


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB; transparent pixels become white (clip art is drawn on transparency);
    high-depth grey images are scaled to 8 bits first (:func:`to_8bit`)."""
    image = to_8bit(image)
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba)  # alpha_composite's bytes (tests/data/test_data_hostile.py), 7x faster
        return white
    return image.convert("RGB")


def _open_checked(handle: BinaryIO, max_pixels: int, where: str) -> Image.Image:
    """``Image.open`` (header only) with every failure turned into a :class:`BadRecord`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(handle)
    except Image.DecompressionBombError as err:
        raise BadRecord(DECOMPRESSION_BOMB, f"{where}: {err}") from None
    except Image.UnidentifiedImageError:  # Pillow's message names the handle (<_io.BufferedReader name=3>)
        raise BadRecord(CORRUPT_IMAGE, f"{where}: not an image file Pillow can read") from None
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
    except IsADirectoryError as err:
        raise BadRecord(NOT_A_FILE, f"{ref.location}: {err.strerror or err}") from None
    except OSError as err:  # absent, unreadable, a symlink loop, a name too long, ...
        raise BadRecord(MISSING_FILE, f"{ref.location}: {err.strerror or err}") from None
    except ValueError as err:  # e.g. "embedded null byte" from a reference that is not a FileImage
        raise BadRecord(MISSING_FILE, f"{ref.location!r}: {err}") from None


def _orient(image: Image.Image) -> None:
    """Apply the EXIF orientation in place; a damaged EXIF block leaves the image as stored."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ImageOps.exif_transpose(image, in_place=True)
    except Exception:  # noqa: BLE001  unreadable EXIF is not a reason to lose the image
        pass


def probe_image(ref: ImageRef, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Check an image cheaply (header only) and return its ``(width, height)``.

    A file that passed is not opened again by this process while its ``stat`` (device, inode, size, modification
    and change times) stays the same: a source read by several steps in one process (the demo's two trainings, solve,
    evaluation and index) pays for its headers once.

    Raises:
        BadRecord: ``missing_file``, ``corrupt_image`` (unknown or unreadable header)
            or ``decompression_bomb``.
    """
    key = _probe_key(ref, max_pixels)
    if key in _PROBED:
        return _PROBED[key]
    with _open_handle(ref) as handle:
        with _open_checked(handle, max_pixels, ref.location) as image:
            size = image.size
    if key is not None and len(_PROBED) < PROBES_KEPT:
        _PROBED[key] = size
    return size


def _probe_key(ref: ImageRef, max_pixels: int) -> tuple | None:
    """What identifies a probe of a regular file as it is now; None: not a file, or not there."""
    if not isinstance(ref, FileImage):
        return None
    try:
        st = os.stat(ref.path)
    except (OSError, ValueError):  # absent, unreadable, a NUL byte: the probe says which
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return ref.path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, max_pixels


def decode_image(ref: ImageRef, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode an image fully and return it as RGB, turned upright by its EXIF orientation.

    Raises:
        BadRecord: as :func:`probe_image`, plus ``corrupt_image`` for a truncated or
            damaged body.
    """
    with _open_handle(ref) as handle:
        with _open_checked(handle, max_pixels, ref.location) as image:
            try:
                image.load()
                _orient(image)
                return to_rgb(image)
            except Exception as err:  # truncated data, bad CRC, zlib errors, ...
                raise BadRecord(CORRUPT_IMAGE, f"{ref.location}: {err}") from None
