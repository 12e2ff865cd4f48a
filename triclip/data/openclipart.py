"""``openclipart``: 8,121 human-made clip-art files (Debian ``openclipart-png``, ``openclipart-svg``).

Captions come from each SVG's RDF metadata (:mod:`triclip.data.svgmeta`):
train records keep every non-empty one of title, description and the keywords
joined by ``", "``; val and test records keep only the title (the retrieval
query; the description when there is no title). The label is the top-level
category folder. Originals go up to 623 million pixels: each real PNG (symlinks
resolved) is decoded once (2 worker processes, killed with the process that started them:
:mod:`triclip.core.workers`) into a thumbnail of at most 224
pixels a side under ``out/images/``, so training never touches the originals;
images over the pixel limit are skipped as ``decompression_bomb``.

The collection repeats itself: 1,221 names are symlinks into other categories,
and some distinct files give byte-identical thumbnails. Files whose thumbnails
are byte-identical are one image: one record (the first name's path and
category, the union of the copies' captions), split 80/10/10 into train/val/test
by a seeded hash of its original bytes (:mod:`triclip.data.split`), so no
picture is in two splits. The shares are of the distinct images; an image with no
title or description that falls in val or test has nothing to query with and is
skipped as ``empty_caption`` (8 of them). ``--num`` caps the number of names, taken in hash order
of their real file (a spread over categories).
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
from collections import Counter, defaultdict
from dataclasses import dataclass

from PIL import Image

from triclip.data.debian import ensure_debian_packages
from triclip.data.images import DEFAULT_MAX_PIXELS, BytesImage, decode_image, open_regular
from triclip.data.manifest import Built, manifest_row
from triclip.data.reasons import EMPTY_CAPTION, MISSING_FILE, BadRecord
from triclip.data.split import SplitConfig, assign_splits, content_hash, merge_captions
from triclip.data.svgmeta import read_svg_metadata
from triclip.core.io import atomic_path
from triclip.core.progress import progress
from triclip.core.workers import die_with_parent

ROOT = "/usr/share/openclipart"  # the packages' folder: ROOT/svg/<category>/..., ROOT/png/<category>/...
PACKAGES = {"openclipart-svg": "svg", "openclipart-png": "png"}  # Debian package -> subfolder of ROOT
MAX_SIDE = 224  # thumbnail size bound, pixels
VAL_FRACTION = 0.1  # share of distinct images in val: ~680 queries, R@10 known to about +-0.02
TEST_FRACTION = 0.1  # share in test: as large as val, so test numbers are as precise as selection's
WORKERS = 2  # processes reading the metadata and making thumbnails
MIN_POOL_JOBS = 64  # fewer jobs (names, thumbnails) than this are run in this process


def list_clipart(svg_root: str) -> list[str]:
    """Paths of every SVG relative to ``svg_root``, without extension, sorted."""
    found = []
    for folder, _, files in os.walk(svg_root):
        for name in files:
            if name.lower().endswith(".svg"):
                found.append(os.path.relpath(os.path.join(folder, name), svg_root)[: -len(".svg")])
    return sorted(found)


def real_name(png_path: str) -> str:
    """The real file name behind any symlink: what the ``--num`` cap orders by."""
    return os.path.basename(os.path.realpath(png_path))


@dataclass(frozen=True)
class Clip:
    """One clip-art name with a PNG and some caption."""

    name: str  # path under svg/ and png/, without extension
    train_captions: list[str]  # title, description, keywords (for a train record)
    query: str  # title, else description, else "" (for a val or test record)
    source: str  # the real PNG file (symlinks resolved)


@dataclass(frozen=True)
class Thumb:
    """What making one thumbnail gave: a skip reason, or the hashes of the original and the thumbnail."""

    reason: str | None  # skip reason, or None when the thumbnail was written
    original: str = ""  # sha256 of the original PNG's bytes
    digest: str = ""  # sha256 of the thumbnail's bytes (as written)
    path: str = ""  # where the thumbnail was written


def make_thumbnail(job: tuple[str, str, int]) -> Thumb:
    """Decode ``source`` once, save its thumbnail to ``destination`` atomically, and hash both.

    Args:
        job: ``(source PNG, destination path, max_pixels)``.
    """
    source, destination, max_pixels = job
    try:
        with open_regular(source) as handle:
            data = handle.read()
        image = decode_image(BytesImage(data, source), max_pixels)
    except OSError:
        return Thumb(MISSING_FILE)
    except BadRecord as bad:
        return Thumb(bad.reason)
    image.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.LANCZOS, reducing_gap=3.0)
    encoded = io.BytesIO()
    image.save(encoded, format="PNG", compress_level=1)  # zlib level 1: half the encode time of 6, files 6% larger
    with atomic_path(destination) as tmp:
        tmp.write_bytes(encoded.getvalue())
    return Thumb(None, content_hash(data), content_hash(encoded.getvalue()), destination)


def _mapped(work, jobs: list, desc: str, unit: str, chunksize: int) -> list:
    """``[work(job) for job in jobs]``, in order, on :data:`WORKERS` processes (in this one for a few jobs)."""
    bar = dict(total=len(jobs), desc=desc, unit=unit)
    workers = min(WORKERS, os.cpu_count() or 1)
    if workers < 2 or len(jobs) < MIN_POOL_JOBS:
        return [work(job) for job in progress(jobs, **bar)]
    # fork where possible: workers only run Pillow and the XML parser, and spawn would re-run a caller's
    # unguarded script
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, die_with_parent, (os.getpid(),)) as pool:
        return list(progress(pool.imap(work, jobs, chunksize=chunksize), **bar))


def _hash_order(key: str) -> bytes:
    return hashlib.sha256(f"order:{key}".encode("utf-8")).digest()


def read_clips(names: list[str], skipped: Counter) -> list[Clip]:
    """The metadata of each name (parsed on :data:`WORKERS` processes: 8,121 SVGs took 10.7 s in one); names
    without a PNG, SVG or any caption are counted in ``skipped``."""
    clips = []
    for found in _mapped(read_clip, names, desc="openclipart metadata", unit=" svg", chunksize=32):
        if isinstance(found, Clip):
            clips.append(found)
        else:
            skipped[found] += 1
    return clips


def read_clip(name: str) -> Clip | str:
    """One name's clip, or why it has none: ``missing_file`` (no PNG, or no readable SVG metadata) or
    ``empty_caption`` (no title, description or keyword: empty in every split)."""
    png = os.path.join(ROOT, "png", name + ".png")
    try:
        meta = read_svg_metadata(os.path.join(ROOT, "svg", name + ".svg"))
    except OSError:
        meta = None
    if meta is None or not os.path.isfile(png):
        return MISSING_FILE
    if not meta.train_captions():
        return EMPTY_CAPTION
    return Clip(name, meta.train_captions(), meta.query_caption(), os.path.realpath(png))


def write_thumbnails(clips: list[Clip], out: str) -> dict[str, Thumb]:
    """Thumbnail each real PNG once, at ``out/images/<its first name>.png``; ``{source: Thumb}``."""
    first: dict[str, str] = {}  # real source PNG -> its first name (clips come sorted)
    for clip in clips:
        first.setdefault(clip.source, clip.name)
    jobs = [(source, _image_path(out, name), DEFAULT_MAX_PIXELS) for source, name in first.items()]
    return dict(zip(first, _mapped(make_thumbnail, jobs, desc="openclipart thumbnails", unit=" img", chunksize=4)))


def _image_path(out: str, name: str) -> str:
    return os.path.join(out, "images", name + ".png")


def group_images(clips: list[Clip], thumbs: dict[str, Thumb], skipped: Counter) -> dict[str, list[Clip]]:
    """Clips grouped by thumbnail bytes, in name order; failed thumbnails counted in ``skipped``."""
    groups: dict[str, list[Clip]] = defaultdict(list)
    for clip in clips:
        thumb = thumbs[clip.source]
        if thumb.reason:
            skipped[thumb.reason] += 1
        else:
            groups[thumb.digest].append(clip)
    return groups


def build(out: str, num: int | None, seed: int) -> Built:
    """Read metadata, make thumbnails, merge identical images, split them; return the manifest rows.

    Args:
        out: output folder; thumbnails go under ``out/images/``.
        num: cap on the number of names read (``None``: all 8,121).
        seed: which images go to val and test (:func:`triclip.data.split.assign_splits`).
    """
    ensure_debian_packages({package: os.path.join(ROOT, sub) for package, sub in PACKAGES.items()})
    names = list_clipart(os.path.join(ROOT, "svg"))
    if num is not None:
        order = {name: _hash_order(real_name(os.path.join(ROOT, "png", name + ".png"))) for name in names}
        names = sorted(sorted(names, key=lambda n: (order[n], n))[:num])
    skipped: Counter = Counter()
    clips = read_clips(names, skipped)
    thumbs = write_thumbnails(clips, out)
    groups = list(group_images(clips, thumbs, skipped).values())
    # split on the originals' bytes (the smallest hash in the group): a Pillow update that changes
    # the thumbnails' encoding leaves the split as it was
    keys = [min(thumbs[clip.source].original for clip in group) for group in groups]
    splits = assign_splits(keys, SplitConfig(val=VAL_FRACTION, test=TEST_FRACTION, seed=seed))
    rows: dict[str, list[dict]] = {"train": [], "val": [], "test": []}
    merged = 0
    for group, split in zip(groups, splits):
        row = image_row(group, split)
        if row is None:  # no title or description in val or test: nothing to query with
            skipped[EMPTY_CAPTION] += len(group)
        else:
            rows[split].append(row)
            merged += len(group) - 1
    remove_unused(thumbs, rows, out)
    return Built(train=rows["train"], val=rows["val"], test=rows["test"], skipped=skipped,
                 info={"duplicates_merged": merged})


def image_row(group: list[Clip], split: str) -> dict | None:
    """The manifest row of one image and its copies (``None`` when it has no caption for its split).

    The first name gives the path and the label; the captions are the union of the
    copies' (train: every caption; val and test: the query captions only).
    """
    if split == "train":
        captions = merge_captions(clip.train_captions for clip in group)
    else:
        captions = merge_captions([clip.query] for clip in group)
    if not captions:
        return None
    name = group[0].name.replace(os.sep, "/")
    return manifest_row(f"images/{name}.png", captions, name.split("/")[0])


def remove_unused(thumbs: dict[str, Thumb], rows: dict[str, list[dict]], out: str) -> None:
    """Delete the thumbnails no row points at (copies of another image, images without a caption)."""
    used = {os.path.normpath(os.path.join(out, row["image"])) for split in rows.values() for row in split}
    for thumb in thumbs.values():
        if thumb.path and os.path.normpath(thumb.path) not in used:
            try:
                os.remove(thumb.path)
            except FileNotFoundError:
                pass
