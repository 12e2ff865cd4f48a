"""``openclipart``: 8,121 human-made clip-art images (Debian ``openclipart-png``, ``openclipart-svg``).

Captions come from each SVG's RDF metadata (:mod:`retrieval.data.svgmeta`):
train records keep every non-empty one of title, description and the keywords
joined by ``", "``; val records keep only the title (the retrieval query; the
description when there is no title). The label is the top-level category folder.
The split is a hash of the PNG's real file name, so symlinked copies of one image
in several categories land in the same split. Originals go up to 623 million
pixels: each is decoded once (2 worker processes) into a thumbnail of at most
224 pixels a side under ``out/images/``, so training never touches the originals;
images over the pixel limit are skipped as ``decompression_bomb``. ``--num``
caps the count, taking files in hash order (a spread over categories); the seed
plays no part.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import Counter, defaultdict
from dataclasses import dataclass

from PIL import Image
from retrieval.progress import progress

from retrieval.data.debian import ensure_debian_packages
from retrieval.data.images import DEFAULT_MAX_PIXELS, FileImage, decode_image
from retrieval.data.manifest import Built, manifest_row, save_image, split_of
from retrieval.data.reasons import EMPTY_CAPTION, MISSING_FILE, BadRecord
from retrieval.data.svgmeta import read_svg_metadata

ROOT = "/usr/share/openclipart"  # the packages' folder: ROOT/svg/<category>/..., ROOT/png/<category>/...
PACKAGES = {"openclipart-svg": "svg", "openclipart-png": "png"}  # Debian package -> subfolder of ROOT
MAX_SIDE = 224  # thumbnail size bound, pixels
VAL_FRACTION = 0.1  # share of file names hashed into val
WORKERS = 2  # processes making thumbnails
MIN_POOL_JOBS = 64  # fewer thumbnails than this are made in this process


def list_clipart(svg_root: str) -> list[str]:
    """Paths of every SVG relative to ``svg_root``, without extension, sorted."""
    found = []
    for folder, _, files in os.walk(svg_root):
        for name in files:
            if name.lower().endswith(".svg"):
                found.append(os.path.relpath(os.path.join(folder, name), svg_root)[: -len(".svg")])
    return sorted(found)


def split_key(png_path: str) -> str:
    """The name the split hashes: the real file name behind any symlink."""
    return os.path.basename(os.path.realpath(png_path))


def captions_for(meta, split: str) -> list[str]:
    """Train: title, description, keywords (non-empty, distinct); val: the query caption only."""
    if split == "train":
        return meta.train_captions()
    return [meta.query_caption()] if meta.query_caption() else []


def make_thumbnail(job: tuple[str, tuple[str, ...], int]) -> str | None:
    """Decode ``source`` once and save a thumbnail to every destination; a skip reason or ``None``.

    Args:
        job: ``(source PNG, destination paths, max_pixels)``.
    """
    source, destinations, max_pixels = job
    try:
        image = decode_image(FileImage(source), max_pixels)
    except BadRecord as bad:
        return bad.reason
    image.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.LANCZOS, reducing_gap=3.0)
    for destination in destinations:
        save_image(image, destination)
    return None


def _run_jobs(jobs: list[tuple[str, tuple[str, ...], int]]) -> list[str | None]:
    bar = dict(total=len(jobs), desc="openclipart thumbnails", unit=" img")
    workers = min(WORKERS, os.cpu_count() or 1)
    if workers < 2 or len(jobs) < MIN_POOL_JOBS:
        return [make_thumbnail(job) for job in progress(jobs, **bar)]
    # fork where possible: workers only run Pillow, and spawn would re-run a caller's unguarded script
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers) as pool:
        return list(progress(pool.imap(make_thumbnail, jobs, chunksize=4), **bar))


def _hash_order(key: str) -> bytes:
    return hashlib.sha256(f"order:{key}".encode("utf-8")).digest()


@dataclass(frozen=True)
class Clip:
    """One clip-art file that has captions for its split."""

    name: str  # path under svg/ and png/, without extension
    split: str  # "train" or "val"
    captions: list[str]  # for this split
    source: str  # the real PNG file (symlinks resolved)


def read_clips(names: list[str], keys: dict[str, str], skipped: Counter) -> list[Clip]:
    """Metadata and split of each name; names without a PNG, SVG or caption are counted in ``skipped``."""
    svg_root, png_root = os.path.join(ROOT, "svg"), os.path.join(ROOT, "png")
    clips = []
    for name in progress(names, desc="openclipart metadata", unit=" svg"):
        png = os.path.join(png_root, name + ".png")
        split = split_of(keys[name], VAL_FRACTION)
        try:
            captions = captions_for(read_svg_metadata(os.path.join(svg_root, name + ".svg")), split)
        except OSError:
            captions = None
        if captions is None or not os.path.isfile(png):
            skipped[MISSING_FILE] += 1
        elif not captions:
            skipped[EMPTY_CAPTION] += 1
        else:
            clips.append(Clip(name, split, captions, os.path.realpath(png)))
    return clips


def write_thumbnails(clips: list[Clip], out: str) -> dict[str, str]:
    """Thumbnail every clip under ``out/images/`` (each real PNG decoded once); ``{source: reason}`` of failures."""
    targets: dict[str, list[str]] = defaultdict(list)  # real source PNG -> thumbnails to write
    for clip in clips:
        targets[clip.source].append(os.path.join(out, "images", clip.name + ".png"))
    jobs = [(source, tuple(paths), DEFAULT_MAX_PIXELS) for source, paths in targets.items()]
    return {job[0]: reason for job, reason in zip(jobs, _run_jobs(jobs)) if reason}


def build(out: str, num: int | None, seed: int) -> Built:
    """Read metadata, make thumbnails, and return the manifest rows (seed unused: the split is by name)."""
    ensure_debian_packages({package: os.path.join(ROOT, sub) for package, sub in PACKAGES.items()})
    names = list_clipart(os.path.join(ROOT, "svg"))
    keys = {name: split_key(os.path.join(ROOT, "png", name + ".png")) for name in names}
    if num is not None:
        names = sorted(sorted(names, key=lambda n: (_hash_order(keys[n]), n))[:num])
    skipped: Counter = Counter()
    clips = read_clips(names, keys, skipped)
    failed = write_thumbnails(clips, out)
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    for clip in clips:
        if clip.source in failed:
            skipped[failed[clip.source]] += 1
            continue
        relative = clip.name.replace(os.sep, "/")
        rows[clip.split].append(manifest_row(f"images/{relative}.png", clip.captions, relative.split("/")[0]))
    return Built(train=rows["train"], val=rows["val"], skipped=skipped)
