"""The settings of ``triclip index build``, one field each.

Torch- and FAISS-free on purpose: the command line builds its options from this class
(``triclip.app.options``) without loading either. A field's comment is its ``--help`` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from triclip.data.records import DataConfig
from triclip.core.errors import UserError


@dataclass
class IndexBuildConfig:
    """What ``triclip index build`` was asked to do.

    ``codec`` is a name the codec registry holds (``triclip.index.codecs.names()``): not a ``Literal`` here, which
    would name them a second time (the registry needs FAISS); the command line offers them as ``--codec``'s
    choices and :func:`triclip.index.sources.build_index` refuses another before any work.
    """

    run: str | None = None  # run directory (triclip train --out); not with --embeddings
    data: str | None = None  # data source to index (any format triclip.data accepts), or a split folder (data split / data prepare --out): every image of all its splits; not with --embeddings
    val_data: str | None = None  # validation data for the recall-against-m curves kept with the index (None: DIR/val.jsonl of a split folder --data DIR, else the indexed data, its first 5,000 images)
    out: str = ""  # index folder to write
    dims: list[int] | None = None  # m's indexed besides D, which always is, e.g. 16,32,64 (None: D only; with --add: the index's)
    factory: str = "auto"  # FAISS index-factory string for every m, or auto (chosen per m and size)
    bytes: list[int] | None = None  # byte budgets per image, e.g. 8,16,32,64: per budget the code (every codec of --codec and m that fits) with the best recall measured on --val-data is stored (search --bytes B)
    codec: str | None = None  # with --bytes: use this codec (its best m) instead of the best of all
    latency_ms: float | None = None  # with --bytes: the code kept answers one query (one thread) within this many ms at the collection's size (None: no slower than the exact float32 scan of it at full D)
    rescore: bool = True  # with --bytes: a code may be the first of two stages, its shortlist re-ranked by the float vectors read from disk (memory-mapped) (--no-rescore: the codes alone)
    add: bool = False  # append to the existing index at --out instead of building a new one
    overwrite: bool = False  # replace the index at --out (its previous version is kept: triclip index rollback --index OUT)
    weights: Literal["best", "last"] = "best"  # the run's best epoch by validation t2i_r10 (last when none is kept), or its last
    batch_size: int = 64  # images per embedding batch
    device: str | None = None  # torch device (None: cuda when available, else cpu)
    data_config: DataConfig = field(default_factory=DataConfig)  # how to read data (flattened into --sep, --image-key, ...)
    text_index: bool = True  # caption vectors too, for image->text and text->text search (--no-text-index: images only)
    ordering: Literal["importance", "first", "random", "pca"] = "importance"  # compact ordering; pca fits on this data
    seed: int = 0  # seed of the random ordering and of index training
    workers: int = 0  # DataLoader worker processes decoding images
    lock_timeout: float = 600.0  # seconds to wait for another writer of the same index before giving up
    embeddings: str | None = None  # build from `triclip embed` shards instead of --run + --data
    memory_budget: int | None = None  # bytes one index may take in memory, e.g. 8G (None: half the available)
    on_disk: Literal["auto", "always", "never"] = "auto"  # IVF lists in a mapped file (auto: beyond --memory-budget)
    recall_target: float = 0.95  # IVF nprobe: the smallest reaching this recall@10 against exact search (codes of --bytes: against the code's own exhaustive scan; their float re-rank's shortlist: against exact float32 search)
    tune_queries: int = 1000  # held-out queries the nprobe of an IVF index is tuned on


def parse_bytes(text: str) -> int:
    """``"8G"``, ``"512M"``, ``"1.5T"``, ``"100000"`` -> bytes (powers of 1024); UserError otherwise."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = raw[-1:] if raw[-1:] in units and raw[-1:] else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        raise UserError(f"--memory-budget expects a size like 8G or 512M, got {text!r}") from None
    if value <= 0:
        raise UserError(f"--memory-budget must be positive, got {text!r}")
    return int(value * units[unit])
