"""The settings of ``triclip index build``, ``index rollback`` and ``search``, one field each.

Torch- and FAISS-free on purpose: the command line builds its options from these classes
(``triclip.app.options``) and checks them (:func:`check_build`, :func:`check_search`) without
loading either: D, the m's and the byte budgets come from a run's ``config.json``, an embeddings
folder's or an index's manifest. A field's comment is its ``--help`` text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from triclip.core.config import bounded, check_device, check_fields, option_flag
from triclip.core.errors import UserError
from triclip.data.config import check_data
from triclip.data.records import DataConfig

ADD_KEEPS = ("ordering", "memory_budget", "on_disk", "vectors", "recall_target", "tune_queries")  # --add: the index's own
FLOAT_BYTES = 4  # bytes per dimension of the float vectors: a budget above FLOAT_BYTES * D buys nothing
SHORTLIST_FACTOR = 20  # funnel / rescore candidates per wanted hit (openclipart titles, m=32: recall@10 0.996 at 20, 0.987 at 10)


@dataclass
class IndexBuildConfig:
    """What ``triclip index build`` was asked to do.

    ``codec`` is a name the codec registry holds (``triclip.codecs.names()``): not a ``Literal`` here, which
    would name them a second time (the registry needs FAISS); the command line offers them as ``--codec``'s
    choices and :func:`triclip.index.sources.build_index` refuses another before any work.
    """

    run: str | None = None  # run directory (triclip train --out); not with --embeddings
    data: str | None = None  # data source to index (any format triclip.data accepts), or a split folder (data split / data prepare --out): every image of all its splits; not with --embeddings
    val_data: str | None = None  # validation data for the recall-against-m curves kept with the index (None: DIR/val.jsonl of a split folder --data DIR, else the indexed data, its first 5,000 images)
    out: str = ""  # index folder to write
    in_index: bool = True  # with a validation set, measure its recall among everything indexed (triclip.index.in_index); False: a build an --add will grow at once
    dims: list[int] | None = bounded(None, low=1)  # m's indexed besides D, which always is, e.g. 16,32,64 (None: D only; with --add: the index's)
    factory: str = "auto"  # FAISS index-factory string for every m, or auto (chosen per m and size)
    bytes: list[int] | None = bounded(None, low=1)  # byte budgets per image, e.g. 8,16,32,64, each at most 4 x D (the float vectors' size): per budget the code (every codec of --codec and m that fits) with the best recall measured on --val-data is stored (search --bytes B); a new index only (--add extends the index's own budgets)
    codec: str | None = None  # with --bytes: use this codec (its best m) instead of the best of all
    latency_ms: float | None = bounded(None, above=0)  # with --bytes: the code kept answers one query (one thread) within this many ms at the collection's size (None: no slower than the exact float32 scan of it at full D)
    rescore: bool = True  # with --bytes: a code may be the first of two stages, its shortlist re-ranked by the float vectors read from disk (memory-mapped) (--no-rescore: the codes alone)
    add: bool = False  # append to the existing index at --out instead of building a new one
    overwrite: bool = False  # replace the index at --out (its previous version is kept: triclip index rollback --index OUT)
    weights: Literal["best", "last"] = "best"  # the run's best epoch by validation t2i_r10 (last when none is kept), or its last
    batch_size: int = bounded(64, low=1)  # images per embedding batch
    device: str | None = None  # torch device (None: cuda when available, else cpu)
    data_config: DataConfig = field(default_factory=DataConfig)  # how to read data (flattened into --sep, --image-key, ...)
    text_index: bool = True  # caption vectors too, for image->text and text->text search (--no-text-index: images only)
    ordering: Literal["importance", "first", "random", "pca"] = "importance"  # compact ordering; pca fits on this data
    seed: int = 0  # seed of the random ordering and of index training
    workers: int = bounded(0, low=0)  # DataLoader worker processes decoding images
    lock_timeout: float = bounded(600.0, low=0)  # seconds to wait for another writer of the same index before giving up
    embeddings: str | None = None  # build from `triclip embed` shards instead of --run + --data
    val_embeddings: str | None = None  # with --embeddings and --bytes: the validation split embedded by `triclip embed --split val` with the same run; the codes are chosen on it (None: on the shards' first 5,000 images)
    memory_budget: int | None = bounded(None, above=0)  # bytes one index may take in memory, e.g. 8G (None: half the available); with --bytes, float vectors beyond it are read from disk by a re-rank, whose cold reads the choice times and charges
    on_disk: Literal["auto", "always", "never"] = "auto"  # IVF lists in a mapped file (auto: beyond --memory-budget)
    vectors: Literal["auto", "float32", "float16", "sq8"] = "auto"  # precision of the full-D vectors kept on disk for re-ranks, "more like this" and --add: float32 (4 x D bytes a row), float16 (half of that; an inner product of unit vectors moves by at most 2^-11 = 0.00049), sq8 (a quarter: FAISS's 8-bit scalar quantiser after a fixed random rotation, each turned dimension's range in 256 steps) or auto (float32 unless it would not fit in the free disk of --out, then float16, then sq8; refused before any work when none fits)
    recall_target: float = bounded(0.95, above=0, high=1)  # IVF nprobe: the smallest reaching this recall@10 against exact search (codes of --bytes: against the code's own exhaustive scan; their float re-rank's shortlist: against exact float32 search)
    tune_queries: int = bounded(1000, low=1)  # held-out queries the nprobe of an IVF index is tuned on


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


@dataclass
class ExportConfig:
    """What ``triclip index export`` was asked to do (``triclip.index.milvus_export``)."""

    index: str  # index folder to export (index build --out); read only: nothing in it changes
    to: str  # where: a Milvus Lite file PATH.db (a folder, made if missing) or a Milvus server http://HOST:19530
    collection: str = "triclip"  # collection of the image rows; the captions go to COLLECTION_captions
    bytes: int | None = None  # a byte budget of the index (index build --bytes): its code's m, and the Milvus index nearest that code (IVF_PQ, IVF_SQ8, IVF_RABITQ; docs/scale_out.md); None: the float vectors at D (FLAT on Milvus Lite, HNSW on a server)
    chunk: int = 2000  # rows sent per request: memory is bounded by it, whatever the index's size
    nlist: int | None = None  # IVF lists of the Milvus index (None: 4 sqrt(rows), at most 65536)
    nprobe: int | None = None  # IVF lists searched per query, recorded for triclip search (None: a quarter of nlist, at least 16)
    text: bool = True  # export the caption vectors too (image->text search; --no-text: images only)
    shards: int | None = None  # a new collection's shards (write channels; None: the server's default, 1); Milvus Lite has one
    replicas: int = 1  # in-memory replicas the collection is loaded with (query nodes serving it; Milvus Lite: 1)
    timeout: float = 10.0  # seconds to wait for Milvus before giving up (an address that does not answer)
    overwrite: bool = False  # drop the collections when they hold another index's, version's or run's rows, and export anew


DEFAULTS = IndexBuildConfig()  # what a field is when not given (ADD_KEEPS: given with --add is refused)


@dataclass
class RollbackConfig:
    """What ``triclip index rollback`` was asked to do."""

    index: str  # index folder (index build --out)


@dataclass
class SearchConfig:
    """What ``triclip search`` was asked: the queries, what to search, how to print the hits."""

    index: str  # index folder (index build --out)
    text: list[str] | None = field(default=None, metadata={"repeat": True, "help": "a text query"})
    text_file: str | None = None  # a file of text queries, one per line
    image: list[str] | None = field(default=None, metadata={"repeat": True, "help": "an image query file"})
    target: Literal["image", "text"] = "image"  # search the images or the captions
    m: int | None = bounded(None, low=1)  # search the index at m (None: D); not with --funnel or --bytes
    funnel: int | None = bounded(None, low=1, metavar="M")  # shortlist at m=M, re-rank at full D; not with --bytes
    bytes: int | None = bounded(None, low=1, metavar="B")  # search the codes of B bytes per vector (index build --bytes): the image codes, the caption codes with --target text (None: float at m)
    rescore: str | None = field(default=None, metadata={"metavar": "float|B2|none", "help": (
        "with --bytes: re-rank the codes' shortlist with the float vectors or the codes of B2 bytes; none: the"
        " codes alone (default: the stages index build chose for B)")})
    factor: int | None = bounded(None, low=1, help=(
        f"funnel / rescore candidates per hit, with --funnel or --rescore (default: {SHORTLIST_FACTOR})"))
    k: int = bounded(10, low=1, flags=["-k"])  # hits per query
    run: str | None = None  # run to embed queries with (None: the one the index records)
    collection: str | None = None  # with a Milvus --index: the collection (None: its one triclip collection)
    json: bool = False  # print a list of hits (one query) or of hit lists (several)
    timing: bool = False  # print where the time went on stderr
    device: str | None = None  # cpu, cuda, cuda:1 for the query model (None: cuda when available, else cpu)


# ---------------------------------------------------------------------------- checks before anything loads


def check_build(cfg: IndexBuildConfig) -> None:
    """UserError (one line) for settings ``index build`` cannot use, found without loading a model, data or
    an index: bounds, the sources given, options that do not apply, and the m's and byte budgets against D
    (the run's ``config.json``, the embeddings' or, with ``--add``, the index's manifest)."""
    check_fields(cfg)
    check_device(cfg.device)
    if cfg.embeddings is not None and (cfg.run or cfg.data):
        raise UserError("--embeddings replaces --run and --data: give one or the other")
    if cfg.embeddings is None and (not cfg.run or not cfg.data):
        raise UserError("give --run RUN --data P, or --embeddings EMB (from triclip embed)")
    if not cfg.out:
        raise UserError("index build needs --out")
    if cfg.embeddings is not None and cfg.add:
        raise UserError("--add with --embeddings is not supported: build the index from all the shards")
    if cfg.embeddings is not None and cfg.ordering != "importance":
        raise UserError("--embeddings: the shards hold the importance ordering; --ordering does not apply")
    if cfg.embeddings is not None and (cfg.val_data or cfg.weights != "best"):
        raise UserError("--embeddings: the shards were embedded with their run's weights and no curves are measured"
                        " from them; --val-data and --weights do not apply")
    if cfg.val_embeddings is not None and (cfg.embeddings is None or not cfg.bytes):
        raise UserError("--val-embeddings is what the codes of --bytes are chosen on in a build from --embeddings:"
                        " give --embeddings and --bytes, or leave it out (with --run, --val-data does that)")
    if cfg.add and (cfg.bytes or cfg.codec):
        raise UserError("--add extends the index's own byte budgets with the same codes: leave out --bytes and --codec"
                        " (a new budget needs a new index: --overwrite)")
    if cfg.codec is not None and not cfg.bytes:
        raise UserError(f"--codec {cfg.codec} picks the code of each --bytes budget: give --bytes too")
    if cfg.latency_ms is not None and not cfg.bytes:
        raise UserError("--latency-ms bounds the codes of --bytes: give --bytes too")
    check_dims(cfg.dims)
    if not cfg.factory.strip():
        raise UserError("--factory must be a FAISS factory string or auto")
    for option, path in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        check_data(path, option)
    dim = _add_target(cfg) if cfg.add else _source_dim(cfg)
    check_width(dim, cfg.dims, "--dims")
    check_width(dim, cfg.bytes, "--bytes")


def check_dims(dims) -> None:
    """UserError when ``--dims`` is given but names no m (left out, the index holds D only)."""
    if dims is not None and not listed(dims):
        raise UserError("--dims names no m: give some, e.g. 16,32, or leave it out for D only")


def check_width(dim: int | None, values, option: str) -> None:
    """UserError unless every m of ``--dims`` is at most D, every budget of ``--bytes`` at most the float
    vectors' size (``FLOAT_BYTES`` x D); ``dim`` None: D is not known yet (checked after the model loads)."""
    values = listed(values)
    if dim is None or not values:
        return
    if option == "--bytes" and max(values) > FLOAT_BYTES * dim:
        raise UserError(f"--bytes {max(values)} is above the float vectors' size, {FLOAT_BYTES} x D = {FLOAT_BYTES * dim}"
                        f" bytes at D={dim}: a budget is at most that")
    if option != "--bytes" and max(values) > dim:
        raise UserError(f"{option} {max(values)} exceeds the model's embedding dimension D={dim}")


def listed(values: int | list[int] | None) -> list[int] | None:
    """``--dims`` / ``--bytes`` as a list (a library caller may give one int)."""
    return [values] if isinstance(values, int) else values


def _source_dim(cfg: IndexBuildConfig) -> int | None:
    """D of what is indexed: the embeddings' manifest, or the run's ``config.json`` (UserError: neither is there)."""
    if cfg.embeddings is not None:
        from triclip.model.shards import read_manifest

        return int(read_manifest(cfg.embeddings)["dim"])
    from triclip.model.runfile import run_dim

    return run_dim(cfg.run)


def _add_target(cfg: IndexBuildConfig) -> int:
    """``--add``: the index to extend; ``--dims`` and ``--factory``, when given, must be its own. Returns its D."""
    from triclip.index.versions import is_index_dir, peek_manifest

    if cfg.overwrite:
        raise UserError("--add extends the index and --overwrite replaces it: give one of them")
    if not is_index_dir(cfg.out):
        raise UserError(f"--add needs an existing index at {cfg.out}")
    manifest = peek_manifest(cfg.out)
    dim = manifest.get("dim")
    dims = listed(cfg.dims)
    if dims is not None and sorted(set(dims) | {dim}) != manifest.get("dims"):
        raise UserError(f"--add: the index holds m = {manifest.get('dims')}, not --dims {','.join(map(str, dims))}")
    if cfg.factory != "auto" and cfg.factory != manifest.get("factory_option"):
        raise UserError(f"--add: the index was built with --factory {manifest.get('factory_option')}, not {cfg.factory}")
    kept = [option_flag(name) for name in ADD_KEEPS if getattr(cfg, name) != getattr(DEFAULTS, name)]
    if not cfg.text_index and manifest.get("text_count") is not None:
        kept.append("--no-text-index")
    if kept:
        raise UserError(f"--add extends the index as it was built (its ordering, captions, memory budget, lists,"
                        f" vectors and nprobe): {', '.join(kept)} do not apply; leave them out")
    from triclip.model.runfile import read_config

    read_config(cfg.run)  # UserError: not a run
    return dim


def check_search(cfg: SearchConfig) -> dict:
    """UserError (one line) for a search that cannot be answered, found from the index's manifest before the
    index or a model loads: bounds, options that do not apply, the queries, and --m / --funnel / --bytes /
    --rescore against what the index holds. Returns the manifest."""
    from triclip.index.versions import peek_manifest

    check_fields(cfg)
    check_device(cfg.device)
    rules = (
        (cfg.rescore is not None and cfg.bytes is None, "--rescore re-ranks the shortlist of --bytes B's codes: give --bytes"),
        (cfg.m is not None and cfg.bytes is not None, "--bytes searches a budget's codes, --m an index at m: give one"),
        (cfg.funnel is not None and cfg.bytes is not None,
         "--bytes searches a budget's codes: not with --funnel (--rescore re-ranks their shortlist)"),
        (cfg.m is not None and cfg.funnel is not None, "--funnel searches at its own m and re-ranks at D: not with --m"),
        (cfg.factor is not None and cfg.funnel is None and cfg.rescore is None,
         "--factor sets the shortlist of --funnel or --rescore: give one of them"),
        (not cfg.text and cfg.text_file is None and not cfg.image, "give at least one --text, --text-file or --image query"),
    )
    for wrong, message in rules:
        if wrong:
            raise UserError(message)
    for what, path in [("--text-file", cfg.text_file), *(("query image", p) for p in cfg.image or [])]:
        if path is not None and not os.path.isfile(path):
            raise UserError(f"cannot read {what} {path}: no such file")
    if cfg.run is not None:
        from triclip.model.runfile import read_config

        read_config(cfg.run)  # UserError: not a run
    from triclip.index.milvus import is_milvus_uri

    if is_milvus_uri(cfg.index):
        return {}  # a collection: what it holds is checked when it is opened
    if cfg.collection is not None:
        raise UserError("--collection names a Milvus collection: give a Milvus --index (PATH.db or http://HOST:19530)")
    manifest = peek_manifest(cfg.index)
    _check_against_index(cfg, manifest)
    return manifest


def rescore_value(text: str | None) -> int | str | None:
    """``--rescore``: ``"float"``, ``"none"``, or the budget B2 as an int (UserError otherwise)."""
    if text in (None, "float", "none"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"--rescore takes float, none or a number of bytes, got {text!r}") from None
    if value < 1:
        raise UserError(f"--rescore must be float or a number of bytes >= 1, got {value}")
    return value


def _check_against_index(cfg: SearchConfig, manifest: dict) -> None:
    """--m / --funnel among the index's m's; --bytes / --rescore among its budgets (of the --target side)."""
    dim, dims = manifest.get("dim"), manifest.get("dims") or []
    if cfg.target == "text" and manifest.get("text_count") is None:
        raise UserError(f"{cfg.index} has no caption vectors (built without the text index): --target text needs them")
    for option, m in (("--m", cfg.m), ("--funnel", cfg.funnel)):
        if m is not None and m not in dims:
            raise UserError(f"{option[2:]}={m} is not indexed here; choose from {dims}")
    if isinstance(dim, int):
        check_width(dim, cfg.bytes, "--bytes")
    budgets = manifest.get("budgets") or {}
    built = sorted(int(b) for b, entry in budgets.items() if cfg.target == "image" or (entry or {}).get("text"))
    for option, budget in (("--bytes", cfg.bytes), ("--rescore", rescore_value(cfg.rescore))):
        if isinstance(budget, int) and budget not in built:
            side = "" if cfg.target == "image" else " for the captions"
            raise UserError(f"{option} {budget}: no codes of that many bytes{side} here; choose from"
                            f" {built or 'none (index build --bytes builds some)'}")
