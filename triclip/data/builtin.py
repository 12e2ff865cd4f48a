"""``triclip data prepare NAME --out DIR``: write a built-in dataset as JSONL manifests.

Each builder (a registry entry) writes its images under ``DIR/images/`` and
returns manifest rows per split; :func:`prepare` writes ``DIR/train.jsonl``,
``DIR/val.jsonl`` (and ``DIR/test.jsonl`` when the dataset has a test split)
atomically and returns a summary. Datasets that come from
Debian packages are installed with ``apt-get`` when missing and possible
(:mod:`triclip.data.debian`).

A folder is marked done only once every image its manifests name is a file in it
(:func:`missing_images`, checked before the manifests are written); a folder marked
done that has lost some of its images since is not complete (:func:`data_complete`):
the demo prepares it again.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

from triclip.data import fashion_mnist, openclipart, shapes
from triclip.data.manifest import Built, write_manifest
from triclip.core.errors import UserError
from triclip.core.io import claim_output_dir, folder_done, writing

Builder = Callable[[str, "int | None", int], Built]

BUILTINS: dict[str, Builder] = {
    "shapes": shapes.build,
    "fashion-mnist": fashion_mnist.build,
    "openclipart": openclipart.build,
}


# Disk use per record, rounded up from measurements (shapes: 1.1 KB of PNG and manifest line per
# record at 200 records), and the most records a dataset has (--num caps it).
BYTES_PER_RECORD = {"shapes": 2048, "fashion-mnist": 2048, "openclipart": 1024}
MOST_RECORDS = {"shapes": None, "fashion-mnist": 70_000, "openclipart": 8_121}
DEFAULT_NUM = {"shapes": shapes.DEFAULT_NUM}


def check_space(name: str, out: str, num: int | None) -> None:
    """UserError when ``out``'s filesystem lacks the space ``num`` records of ``name`` will take."""
    most = MOST_RECORDS.get(name)
    records = num if num is not None else DEFAULT_NUM.get(name, most or 0)
    records = min(records, most) if most is not None else records
    need = records * BYTES_PER_RECORD.get(name, 2048)
    where = os.path.abspath(out)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if need > free:
        raise UserError(
            f"--num {num}: {name} would need about {_size(need)} in {out}, and {_size(free)} are free there;"
            " lower --num or choose another --out"
        )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def prepare(name: str, out: str | os.PathLike, num: int | None = None, seed: int = 0, overwrite: bool = False) -> dict:
    """Build dataset ``name`` into ``out``; return ``{"dataset", "out", "train", "val", ["test",] "skipped", ...}``.

    Args:
        name: one of :data:`BUILTINS`.
        out: output folder (created); holds ``train.jsonl``, ``val.jsonl``, ``images/`` (and
            ``test.jsonl`` for datasets with a test split: ``openclipart``).
        num: ``shapes``: number of images (default 2000); others: a cap on the total.
        seed: ``shapes``: the scenes; ``fashion-mnist``: the caption templates; ``openclipart``: the split.
        overwrite: replace a data set already in ``out`` (any other non-empty folder is refused).

    Raises:
        UserError: unknown name, bad ``num``, unusable ``out``, missing Debian package.
    """
    if name not in BUILTINS:
        raise UserError(f"unknown built-in dataset {name!r}; choose one of {', '.join(BUILTINS)}")
    if num is not None and num <= 0:
        raise UserError(f"--num must be positive, got {num}")
    out = os.fspath(out)
    claim_output_dir(out, "data", overwrite=overwrite)
    check_space(name, out, num)
    paths = {split: os.path.join(out, f"{split}.jsonl") for split in ("train", "val", "test")}
    try:
        with writing(out, "data", overwrite=overwrite) as folder:  # a replacement is built beside, then swapped in
            built = BUILTINS[name](str(folder), num, seed)
            splits = {"train": built.train, "val": built.val, "test": built.test}
            _check_images(name, out, folder, splits)  # before the manifests: a folder never names images it lacks
            counts = {
                split: write_manifest(os.path.join(folder, f"{split}.jsonl"), rows)
                for split, rows in splits.items()
                if rows is not None
            }
    except OSError as err:  # unwritable, read-only, full, or not a folder on the way
        where = err.filename or out
        raise UserError(f"cannot build {name} in {out}: {where}: {err.strerror or err}") from None
    return {
        "dataset": name,
        "out": os.path.abspath(out),
        **counts,
        "skipped": dict(sorted(built.skipped.items())),
        **built.info,
        **{f"{split}_manifest": os.path.abspath(paths[split]) for split in counts},
    }


def _check_images(name: str, out: str, folder: str | os.PathLike, splits: dict[str, list[dict] | None]) -> None:
    """UserError (the folder stays unfinished: the next run builds it again) when a row's image is not in ``folder``."""
    absent = missing_images(folder, [row for rows in splits.values() if rows for row in rows])
    if absent:
        raise UserError(
            f"cannot build {name} in {out}: {len(absent)} images the manifests would name are not in it"
            f" (first: {absent[0]}); run the command again"
        )


def missing_images(folder: str | os.PathLike, rows: list[dict] | None = None) -> list[str]:
    """The ``image`` paths of ``rows`` (default: every row of ``folder``'s train / val / test manifests) that are
    not regular files, relative paths taken from ``folder``; an unreadable manifest or row counts as missing."""
    folder = os.fspath(folder)
    if rows is None:
        rows = []
        for split in ("train", "val", "test"):
            path = os.path.join(folder, f"{split}.jsonl")
            if os.path.exists(path):
                rows += _manifest_rows(path)
    return [str(row.get("image")) for row in rows if not _is_image_file(folder, row.get("image"))]


def _manifest_rows(path: str) -> list[dict]:
    """The rows of a manifest a builder wrote; an unreadable file or line gives a row with no image."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line for line in handle if line.strip()]
    except (OSError, UnicodeDecodeError):
        return [{"image": path}]
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        rows.append(row if isinstance(row, dict) else {"image": None})
    return rows


def _is_image_file(folder: str, image: object) -> bool:
    return isinstance(image, str) and bool(image) and os.path.isfile(os.path.join(folder, image))


def data_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a finished data set (its mark says done) whose manifests' images are all there."""
    return folder_done(path, "data") and not missing_images(path)
