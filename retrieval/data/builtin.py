"""``triclip data prepare NAME --out DIR``: write a built-in dataset as two JSONL manifests.

Each builder (a registry entry) writes its images under ``DIR/images/`` and
returns manifest rows per split; :func:`prepare` writes ``DIR/train.jsonl`` and
``DIR/val.jsonl`` atomically and returns a summary. Datasets that come from
Debian packages are installed with ``apt-get`` when missing and possible
(:mod:`retrieval.data.debian`).
"""

from __future__ import annotations

import os
from typing import Callable

from retrieval.data import fashion_mnist, openclipart, shapes
from retrieval.data.manifest import Built, write_manifest
from retrieval.errors import UserError
from retrieval.io import claim_output_dir

Builder = Callable[[str, "int | None", int], Built]

BUILTINS: dict[str, Builder] = {
    "shapes": shapes.build,
    "fashion-mnist": fashion_mnist.build,
    "openclipart": openclipart.build,
}


def prepare(name: str, out: str | os.PathLike, num: int | None = None, seed: int = 0, overwrite: bool = False) -> dict:
    """Build dataset ``name`` into ``out``; return ``{"dataset", "out", "train", "val", "skipped", ...}``.

    Args:
        name: one of :data:`BUILTINS`.
        out: output folder (created); holds ``train.jsonl``, ``val.jsonl``, ``images/``.
        num: ``shapes``: number of images (default 2000); others: a cap on the total.
        seed: ``shapes``: the scenes; ``fashion-mnist``: the caption templates.
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
    train, val = os.path.join(out, "train.jsonl"), os.path.join(out, "val.jsonl")
    try:
        os.makedirs(out, exist_ok=True)
        built = BUILTINS[name](out, num, seed)
        counts = write_manifest(train, built.train), write_manifest(val, built.val)
    except OSError as err:  # unwritable, read-only, full, or not a folder on the way
        where = err.filename or out
        raise UserError(f"cannot build {name} in {out}: {where}: {err.strerror or err}") from None
    return {
        "dataset": name,
        "out": os.path.abspath(out),
        "train": counts[0],
        "val": counts[1],
        "skipped": dict(sorted(built.skipped.items())),
        "train_manifest": os.path.abspath(train),
        "val_manifest": os.path.abspath(val),
    }
