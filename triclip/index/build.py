"""The one index builder: full-D compact vectors in shards -> one FAISS index per m, written as a version.

Every ``triclip index build`` ends here (``triclip.index.sources`` prepares the :class:`Collection`):
``--run --data`` embeds the source itself and hands over its vectors as one in-memory
shard; ``--embeddings`` hands over the shards of ``triclip embed``, memory-mapped. The
vectors are ``sqrt(w) * z`` in importance order, so the top-m embedding of any m is a
re-normalised prefix (``triclip.index.vectors.prefix``). For every m (and for the captions, when
there are some):

- **in memory** when the index fits ``memory_budget``: the ``auto`` factory
  (``triclip.index.faiss_index.auto_factory``, one policy for every build) picks ``Flat`` below
  100,000 vectors, ``HNSW32`` up to 5,000,000, else ``IVF{nlist},Flat``; shards are added in
  order. Vectors held in memory (one shard) are built by ``triclip.index.faiss_index.build``.
- **beyond the budget**, ``IVF{nlist},PQ{m/4}``; any IVF index (auto or ``--factory``) is
  trained **once** on a sample drawn across all shards (the same rows
  ``triclip.index.faiss_index.train_sample`` would draw from the concatenated vectors), then
  every shard is added to its own copy of the trained empty index and the copies are
  merged in shard order with ``IndexIVF.merge_from(part, add_id=offset)``. Each copy
  numbers its vectors from 0, so the offset (the number of vectors in the shards
  before it) is what keeps row ids right: merging without it maps every shard onto
  rows 0..n-1 (the known trap; a test shows it).
- under ``torchrun`` (``--embeddings`` only) the shards are added in parallel, rank ``r``
  taking shards ``r, r + W, ...``: rank 0 trains and saves the empty index, every rank
  writes its parts next to the output folder, rank 0 merges them and writes the folder.
- **on disk** when an IVF index's lists (codes + ids) exceed ``memory_budget``
  (``on_disk="auto"``; ``"always"`` / ``"never"`` force it): each shard is added to a
  copy of the trained index **with its global ids** (``add_with_ids``, ids
  ``offsets[s] ...``), the part is saved, and the parts are merged, memory-mapped, into
  one ``OnDiskInvertedLists`` file (``triclip.index.faiss_index.merge_on_disk``,
  ``faiss.contrib.ondisk``) that becomes ``{kind}.m{m}.ivfdata`` of the new version; the
  full-D vectors are then written to ``vectors.npy`` shard by shard, never held whole.
  Memory is bounded by one shard, the trained index, the codes and the page cache; the meta rows are read
  from the shards when needed (``triclip.index.metarows``), never held whole. The parts, lists and
  vectors files are written in the parts folder beside the output folder (same filesystem: the lists file is
  renamed into the version, not copied; ``.{out}.shard-parts`` under torchrun), removed when the version is
  written. A build from embedding shards in one process resumes from it after a kill: its name is a hash of
  the shards and the options, and everything finished in it is reused (``triclip.index.parts``: the owner's
  flock, a second build refused, dead builds' folders removed): the merged indexes, the codes' choices, the
  lists refitted for N and their nprobe tuned at N, the filled codes.

``nprobe`` of every IVF index is tuned on held-out queries (captions for the image
index, images for the caption index, ``tune_queries`` of them, drawn by a seed): the
smallest power of two whose recall@10 against exact search reaches ``recall_target``,
recorded in the manifest as ``nprobe`` ({str(m): nprobe}) with the curve it came from.

The folder is written with ``triclip.index.store`` (versioned, under the writer lock), its
manifest by ``triclip.index.manifest``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import faiss
import numpy as np

from triclip.codecs.threads import all_cores
from triclip.index import faiss_index as fi
from triclip.index.parts import (  # noqa: F401 (OWNER, PARTS_SUFFIX, claim_parts, remove_stale_parts: re-exported)
    OWNER,
    PLAN,
    PARTS_SUFFIX,
    build_key,
    claim_parts,
    fresh_parts,
    open_parts,
    remove_stale_parts,
    resuming_line,
)
from triclip.index.metarows import RENAMES, MetaRows
from triclip.index.manifest import Origin, attach_curves, make_manifest, summary
from triclip.index.store import TEXT_VECTORS, VECTORS, IndexContents, ivfdata_name, write_version, writer_lock
from triclip.index.vectors import SQ8_SAMPLE, STORED_AS, VECTOR_BYTES, ShardVectors, SQ8Rows, exact_topk, stored_dtype
from triclip.core.errors import UserError
from triclip.core.io import atomic_path, write_errors
from triclip.core.progress import progress
from triclip.model.shards import barrier, init_distributed

TUNE_K = 10  # recall@k that nprobe is tuned for
FILL_ROWS = 16384  # rows encoded at once: FAISS's PQ encoder holds ksub x M floats per row (PQ16x8: 16 KiB, 256 MiB here)


@dataclass
class Collection:
    """What one build indexes: the vectors, their rows, and where they came from."""

    image: ShardVectors  # (N, D) full-D compact image vectors
    text: ShardVectors | None  # (T, D) caption vectors, or None (no caption index)
    meta: Sequence[dict]  # one row per image: {"id", "image", "captions", "label", "file"} (a list, or MetaRows)
    text_rows: np.ndarray | None  # (T, 2) image row and caption number of each caption vector
    origin: Origin  # run, transform, source: what the manifest records
    distributed: bool = False  # the shards may be shared between torchrun ranks


def build_and_write(
    cfg, coll: Collection, dims: list[int], curves: Callable[[list[int]], dict | None] | None = None, evaluation=None,
    started: float | None = None,
) -> dict:
    """Build one index per m of ``dims`` (D included) over ``coll`` and write them as a new version of ``cfg.out``.

    ``cfg``: an ``triclip.index.config.IndexBuildConfig``. ``curves(dims)``: the recall-against-m
    curves to keep with the version (rank 0, before the lock), or None. ``evaluation``: the
    ``triclip.index.budgets.EvalSet`` the codes of ``cfg.bytes`` are measured on (None: the indexed
    data's first images). ``started``: when the command began (``time.perf_counter()``; the summary's
    ``seconds`` count from it, the embedding included), else now. Under ``torchrun``
    every rank must call it; rank 0 writes the folder and returns the summary, the others
    return ``{"rank": r, ...}``.
    """
    started = time.perf_counter() if started is None else started
    rank, world, owned = init_distributed() if coll.distributed else (0, 1, False)
    work = Path(cfg.out).absolute().parent / f".{Path(cfg.out).name}{PARTS_SUFFIX}"  # torchrun: one for all ranks
    work.parent.mkdir(parents=True, exist_ok=True)
    owner, resumable, finished = None, False, False  # fd of the flock-ed owner file of our parts folder (rank 0)
    try:
        budget = cfg.memory_budget if cfg.memory_budget is not None else fi.available_memory() // 2
        factories = {m: choose_factory(coll.image.count, m, budget, cfg.factory) for m in dims}
        text_factories = {m: choose_factory(coll.text.count, m, budget, cfg.factory) for m in dims} if coll.text else {}
        builder = ShardedBuilder(cfg.seed, rank, world, None, on_disk=cfg.on_disk, budget=budget)
        if world == 1:  # a folder of its own: the same build's, resumed, or a fresh one
            work, owner, resumable = _claim_work(cfg, coll, builder, factories, text_factories)
        elif rank == 0:
            owner = _claim_shared(cfg.out, work)
        barrier(world)
        builder.work = work
        try:
            dtype = _vectors_dtype(cfg, coll, work) if rank == 0 else None  # refused here, before any work
        except UserError:
            resumable = resumable and any(p.name not in (OWNER, PLAN) for p in work.iterdir())  # keep earlier work only
            raise
        if rank == 0 and isinstance(coll.meta, MetaRows):
            coll.meta.kept = work / RENAMES  # the unique ids' renames, found once: a resumed build reads them back
        with all_cores():  # FAISS adds and encodes on every core, whatever a server set for its searches
            image_indexes = builder.build_all(coll.image, factories, "image")
            text_indexes = builder.build_all(coll.text, text_factories, "text") if coll.text else {}
        if rank != 0:
            return {"rank": rank, "world": world, "seconds": round(time.perf_counter() - started, 2)}
        tuning = {
            "image": {m: tune_nprobe(idx, coll.image, coll.text or coll.image, m, cfg) for m, idx in image_indexes.items()},
            "text": {m: tune_nprobe(idx, coll.text, coll.image, m, cfg) for m, idx in text_indexes.items()},
        }
        contents = _contents(coll, image_indexes, text_indexes, work, dtype)
        kept = curves(contents.dims) if curves is not None else None
        decided = _decisions(factories, text_factories if coll.text else None, tuning, budget, cfg.recall_target)
        if cfg.bytes:
            with all_cores():
                decided["budgets"], kept = _codes(cfg, coll, contents, kept, evaluation, work, budget)
        contents.manifest = make_manifest(cfg, contents, coll.origin, decided)
        measure_in_index(contents, evaluation if cfg.in_index else None)
        with writer_lock(cfg.out, cfg.lock_timeout):
            attach_curves(cfg.out, contents, kept)
            write_version(cfg.out, contents, keep_previous=True)  # an --overwrite keeps one rollback
        finished = True
        out = summary(contents.manifest, cfg.out, started, added=len(coll.meta), rank=rank, world=world)
        return _with_candidates(out, kept)
    finally:
        if rank == 0:
            _release(work, owner, keep=resumable and not finished)
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


def measure_in_index(contents: IndexContents, evaluation) -> None:
    """The manifest's ``in_index``: the validation queries' recall among everything this version holds, by the
    searches it serves (``triclip.index.in_index``); nothing without a validation set. ``contents.manifest`` is
    the new version's."""
    from triclip.index import in_index
    from triclip.index.search import Searcher

    if evaluation is None or evaluation.split != "validation":
        return
    searcher = Searcher(contents, None, None, None)  # queries come as vectors: no model
    found = in_index.measure(searcher, evaluation, sorted(contents.codes), sorted(contents.text_codes))
    if found is not None:
        contents.manifest["in_index"] = found


def _claim_work(cfg, coll: Collection, builder: "ShardedBuilder", factories: dict, text_factories: dict):
    """The parts folder of a one-process build: ``(folder, owner fd, resumable)``. A build from embedding shards
    gets the folder of its key (``triclip.index.parts``: resumed when a dead build of the same key left one);
    vectors held in memory get a fresh one."""
    if coll.origin.embeddings is None:
        return (*fresh_parts(cfg.out), False)
    emb = Path(coll.origin.embeddings)
    folders = sorted({Path(p.path).parent for v in (coll.image, coll.text) if v is not None for p in v.parts})
    if cfg.val_embeddings:  # what the codes are chosen on: a rewritten VAL changes the key too
        val = Path(cfg.val_embeddings)
        folders += sorted(d for d in val.iterdir() if d.is_dir() and d.name.startswith("shard-"))
    files = [emb / "manifest.json"] + [f for d in folders for f in sorted(d.iterdir()) if f.is_file()]
    disk = {kind: {str(m): builder.wants_disk(_new(m, f), v.count, m, f) for m, f in table.items()}
            for kind, table, v in (("image", factories, coll.image), ("text", text_factories, coll.text)) if v}
    decided = {"factories": factories, "text_factories": text_factories, "disk": disk}
    key, plan = build_key(cfg, files, decided)
    work, fd, resumed = open_parts(cfg.out, key, plan)
    if resumed:
        print(f"resuming the build of {cfg.out} from {work}", file=sys.stderr, flush=True)
    return work, fd, True


def _vectors_dtype(cfg, coll: Collection, work: Path) -> str:
    """The dtype the full-D vectors are written in (``--vectors``, ``triclip.index.vectors.stored_dtype``); a
    resumed build keeps the one its vectors file was written in."""
    if (work / VECTORS).exists():
        held = np.load(work / VECTORS, mmap_mode="r").dtype
        return next(name for name, dtype in STORED_AS.items() if np.dtype(dtype) == held)
    rows = coll.image.count + (coll.text.count if coll.text is not None else 0)
    dtype = stored_dtype(cfg.vectors, rows, coll.image.dim, work.parent)
    if dtype != cfg.vectors and dtype != "float32":  # auto fell back: say so (a re-rank by sq8 rows keeps less)
        print(f"the full-D vectors are kept as {dtype} ({VECTOR_BYTES[dtype]} B a dimension): float32 would not"
              f" fit in the free disk of {work.parent}", file=sys.stderr, flush=True)
    return dtype


def _claim_shared(out: str, work: Path) -> int:
    """torchrun: the ranks share the folder ``work``; parts of an earlier, killed build are removed."""
    remove_stale_parts(out)
    if (work / OWNER).exists():  # still there after remove_stale_parts: its build is alive
        raise UserError(f"another build of {out} is running (its parts are in {work}); wait for it")
    shutil.rmtree(work, ignore_errors=True)  # an older triclip's, without an owner file
    work.mkdir(parents=True)
    return claim_parts(work)


def _release(work: Path, owner: int | None, keep: bool) -> None:
    """The parts folder at the end of a build: removed (done, or not resumable), or kept for the same command
    to resume (one line says so); the flock released."""
    try:
        if keep and work.is_dir():
            print(f"kept the finished parts in {work}: the same command resumes from them", file=sys.stderr,
                  flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)  # parts, and lists / vectors files a failed build left
    finally:
        if owner is not None:
            os.close(owner)  # releases the flock


def _codes(cfg, coll: Collection, contents: IndexContents, kept: dict | None, evaluation, work: Path,
           memory: int) -> tuple[dict, dict]:
    """The codes of every ``--bytes`` budget, chosen by measured recall within the latency bound
    (``triclip.index.budgets``): image codes by text->image recall, caption codes (with captions) by image->text
    recall. Puts them in ``contents.codes`` / ``contents.text_codes`` (inverted lists beyond ``memory`` bytes,
    or with ``--on-disk always``, in a lists file in ``work``: :func:`fill_codes`); returns the manifest's
    ``budgets`` and the curves with their frontiers (``bytes``, ``text_bytes``)."""
    from triclip.index import budgets as bud
    from triclip.index import report
    from triclip.index.finalists import settle
    from triclip.index.store import code_name

    if evaluation is None:
        if coll.text is None:
            raise UserError("--bytes measures text->image recall: it needs the caption vectors (no --no-text-index)"
                            " or --val-data")
        evaluation = bud.indexed_evaluation(coll.image, coll.text, coll.text_rows, coll.meta, bud.EVAL_MAX_IMAGES,
                                            str(coll.origin.source.get("data") or coll.origin.embeddings))
    budgets = bud.parse_budgets(cfg.bytes)
    rules = bud.Rules(coll.image.count, cfg.latency_ms, cfg.recall_target, cfg.rescore,
                      reads_from=_reads_from(contents.files.get(VECTORS), contents.vectors, memory),
                      vector_bytes=contents.vectors.dtype.itemsize, sq8=_ranges_of(contents.vectors))
    entries, fills = {}, {}  # fills: a code kept by several budgets (no_worse_than_smaller) is encoded once
    choices = kept_in(work / "codes.image.choices.pkl", lambda: settle(
        bud.choose_all(budgets, coll.image, evaluation, cfg.codec, cfg.seed, rules), coll.image, evaluation, rules,
        cfg.seed), coll.image.dim)
    for choice in choices:
        file = code_name(choice.budget)
        contents.codes[choice.budget], entries[str(choice.budget)] = _stored(
            choice, coll.image, evaluation, rules, cfg, memory, work, file, contents, fills)
    own = (kept or {}).get("curves", {}).get((kept or {}).get("ordering"), {})
    curves = kept or {"metric": "t2i_r10", "split": evaluation.split, "data": evaluation.data,
                      "ordering": coll.origin.transform["ordering"], "curves": {}}
    _share_files(entries, contents.codes, "image")
    curves["bytes"] = report.frontier(choices, own, evaluation)
    if coll.text is not None:
        reverse = evaluation.reverse()
        text_rules = replace(rules, reads_from=_reads_from(contents.files.get(TEXT_VECTORS), contents.text_vectors,
                                                           memory), vector_bytes=contents.text_vectors.dtype.itemsize,
                           sq8=_ranges_of(contents.text_vectors))
        text_choices = kept_in(work / "codes.text.choices.pkl", lambda: settle(bud.choose_all(
            budgets, coll.text, reverse, cfg.codec, cfg.seed, text_rules), coll.text, reverse, text_rules, cfg.seed),
            coll.text.dim)
        for choice in text_choices:
            file = code_name(choice.budget, "text")
            contents.text_codes[choice.budget], entries[str(choice.budget)]["text"] = _stored(
                choice, coll.text, reverse, text_rules, cfg, memory, work, file, contents, fills)
        _share_files(entries, contents.text_codes, "text")
        curves["text_bytes"] = report.frontier(text_choices, None, reverse)
    return entries, curves


def _share_files(entries: dict, codes: dict, kind: str) -> None:
    """Name in each budget's manifest entry the file its codes go in (``store.shared_names``), and its lists file
    when they are on disk: a budget that keeps a smaller budget's very code names that budget's files, so the code
    is stored and read once."""
    from triclip.index.store import shared_names

    for budget, name in shared_names(codes, kind).items():
        entry = entries[str(budget)] if kind == "image" else entries[str(budget)]["text"]
        entry["file"] = name
        if "lists" in entry:
            entry["lists"] = f"{name}.ivfdata"


def _ranges_of(stored) -> np.ndarray | None:
    """The sq8 ranges of stored vectors kept as codes (a re-rank decodes them), None for floats."""
    return stored.params if isinstance(stored, SQ8Rows) else None


def _reads_from(file: Path | None, stored: np.ndarray, memory: int) -> str | None:
    """The float vectors file a re-rank reads from disk: the ``stored`` vectors written to a file (a build from
    shards) and larger than the ``memory`` budget, so their pages cannot be counted on to stay cached; None: they
    stay in memory."""
    return str(file) if file is not None and stored.nbytes > memory else None


def _stored(choice, vectors: ShardVectors, evaluation, rules, cfg, memory: int, work: Path, file: str,
            contents: IndexContents, fills: dict | None = None) -> tuple:
    """The code stored for one budget and side, and its manifest entry: the kept code sized for the collection's N
    (inverted lists refitted for N: ``scale.sized_for_n``), filled (:func:`fill_codes`; the finalists' fill of
    it when they made one), its nprobe tuned at N on the filled lists (``scale.tune_at_n``; the finalists'
    tuning when this is their fill). The refit code and the tuning are kept in the parts folder (:func:`kept_in`):
    a resumed build reads them back instead of refitting and streaming all N rows again. ``fills``: ids of a kept
    code and variant -> what was stored for them, for the next budget that keeps the very same (a smaller
    budget's code, as the finalists settled it at N: ``finalists.settle`` gives both the same variant)."""
    from triclip.index import report, scale

    fills = {} if fills is None else fills
    key = (id(choice.codec), id(choice.kept))  # a budget keeping a smaller one's very code, as settled at N
    if key in fills:  # that budget's fill and tuning: the same object, its nprobe set once
        stored, sized, at_n = fills[key]
        return stored, report.manifest_entry(choice, stored, evaluation, file, sized, at_n, rules.vector_bytes)
    codec, sized = choice.codec, None
    if scale.resized_for_n(choice.codec, vectors):
        codec, sized = kept_in(work / f"{file}.sized.pkl", lambda: choice.sized_at_n or scale.sized_for_n(
            choice.codec, vectors, cfg.seed), vectors.dim)  # refitted already when a near-tie was settled at N
    stored = fill_codes(codec, vectors, cfg.on_disk, memory, work, file, contents, choice.filled_at_n)
    at_n = None
    if sized is not None:
        tuned = choice.tuned_at_n if stored is choice.filled_at_n else None  # the finalists' tuning of this code
        at_n = kept_in(work / f"{file}.at_n.pkl", lambda: tuned or scale.tune_at_n(stored, vectors, evaluation, choice,
                                                                                 rules), vectors.dim)
        stored.set_nprobe(at_n["nprobe"])  # tune_at_n sets it; read back on a resume, it is set here
    fills[key] = stored, sized, at_n
    return stored, report.manifest_entry(choice, stored, evaluation, file, sized, at_n, rules.vector_bytes)


def fill_codes(codec, vectors: ShardVectors, on_disk: str, memory: int, work: Path, file: str,
               contents: IndexContents, filled=None):
    """``codec`` (trained) filled with every row of ``vectors``: in memory, or for inverted lists (not fast-scan
    ones) beyond ``memory`` bytes (``on_disk`` "auto"; "always": any size) in ``{file}.ivfdata``, written in
    ``work`` and named in ``contents.files`` so the version takes it in. ``filled``: the same code already
    filled in memory (by the finalists), kept as it is where the lists stay in memory."""
    lists = fi.ivf_list_bytes(codec.index, vectors.count) if hasattr(codec, "filled_on_disk") else None
    blocked = lists is not None and isinstance(
        faiss.downcast_InvertedLists(faiss.extract_index_ivf(codec.index).invlists), faiss.BlockInvertedLists)
    with all_cores():  # a search of the choice may have set the serving count in this thread
        if lists is None or blocked or on_disk == "never" or (on_disk == "auto" and lists <= memory):
            return filled if filled is not None else _filled(codec, vectors, work / f"{file}.filled")
        name = f"{file}.ivfdata"
        contents.files[name] = work / name
        with write_errors(work / name):
            return codec.filled_on_disk(vectors, work / name)


def _filled(codec, vectors: ShardVectors, file: Path):
    """``scale.fill`` of ``codec``, saved to ``file`` in the parts folder; an earlier run's file read back."""
    from triclip import codecs
    from triclip.index import scale

    if file.exists():
        return codecs.load(file, vectors.dim)
    full = scale.fill(codec, vectors.chunked(FILL_ROWS))
    with write_errors(file):
        full.save(file)
    return full


def kept_in(file: Path, make: Callable, dim: int):
    """``make()``, pickled to ``file`` in the parts folder (atomic), every codec in it saved beside it with
    ``Codec.save``; an earlier run's value read back (``dim``: D, for the codecs' files)."""
    if file.exists():
        with open(file, "rb") as f:
            return _CodecUnpickler(f, file.parent, dim).load()
    value = make()
    with atomic_path(file) as tmp, open(tmp, "wb") as f:
        _CodecPickler(f, file).dump(value)  # the codecs' files first: a pickle there has all of its codecs
    return value


class _CodecPickler(pickle.Pickler):
    """Pickles codecs (FAISS objects do not pickle) as files ``{file}.{n}`` written by ``Codec.save``."""

    def __init__(self, f, file: Path):
        super().__init__(f)
        self.file, self.saved = file, {}

    def persistent_id(self, obj):
        from triclip import codecs

        if not isinstance(obj, codecs.Codec):
            return None
        if id(obj) not in self.saved:
            name = f"{self.file.name}.{len(self.saved)}"
            with write_errors(self.file.parent / name):
                obj.save(self.file.parent / name)
            self.saved[id(obj)] = name
        return self.saved[id(obj)]


class _CodecUnpickler(pickle.Unpickler):
    def __init__(self, f, folder: Path, dim: int):
        super().__init__(f)
        self.folder, self.dim, self.read = folder, dim, {}

    def persistent_load(self, name):
        from triclip import codecs

        if name not in self.read:
            self.read[name] = codecs.load(self.folder / name, self.dim)
        return self.read[name]


def _with_candidates(out: dict, curves: dict | None) -> dict:
    """The summary with every candidate each budget tried (from the curves' frontiers), for the build's table."""
    for key, side in (("bytes", None), ("text_bytes", "text")):
        for budget, tried in ((curves or {}).get(key) or {}).get("candidates", {}).items():
            entry = (out.get("budgets") or {}).get(budget)
            if entry is not None and (side is None or entry.get(side)):
                (entry if side is None else entry[side])["candidates"] = tried
    return out


def _decisions(factories: dict, text_factories: dict | None, tuning: dict, budget: int, target: float) -> dict:
    """The manifest entries the builder decided: factories, nprobe and its tuning, the memory budget."""
    return {
        "factories": {str(m): f for m, f in factories.items()},
        "text_factories": None if text_factories is None else {str(m): f for m, f in text_factories.items()},
        "memory_budget": int(budget),
        "nprobe": {str(m): t["nprobe"] for m, t in tuning["image"].items() if t is not None},
        "text_nprobe": {str(m): t["nprobe"] for m, t in tuning["text"].items() if t is not None},
        "nprobe_tuning": {
            "recall_target": target,
            "k": TUNE_K,
            "image": {str(m): t for m, t in tuning["image"].items() if t is not None},
            "text": {str(m): t for m, t in tuning["text"].items() if t is not None},
        },
    }


def _contents(coll: Collection, image_indexes: dict, text_indexes: dict, work: Path, dtype: str) -> IndexContents:
    """The version to write; with an index on disk, its lists are files in ``work``; the vectors too (as
    ``dtype``), written shard by shard and memory-mapped, with an index on disk or when they come from shard
    files (embeddings): never an (N, D) float matrix in memory."""
    contents = IndexContents({}, coll.meta, None, image_indexes)
    if coll.text is not None:
        contents.text_rows = np.asarray(coll.text_rows, np.int64).reshape(-1, 2)
        contents.text_indexes = text_indexes
    files = {}
    for kind, table in (("image", image_indexes), ("text", text_indexes)):
        for m, index in table.items():
            if fi.is_on_disk(index):
                files[ivfdata_name(kind, m)] = Path(fi.on_disk_lists(index).filename)
    if files or coll.origin.embeddings is not None:  # the vectors go to their file shard by shard
        files[VECTORS] = work / VECTORS
        contents.vectors = _kept_vectors(coll.image, dtype, files[VECTORS])  # (N, D) memory-mapped
        if coll.text is not None:
            files[TEXT_VECTORS] = work / TEXT_VECTORS
            contents.text_vectors = _kept_vectors(coll.text, dtype, files[TEXT_VECTORS])  # (T, D)
        contents.files = files
        return contents
    contents.vectors = _kept_vectors(coll.image, dtype)  # (N, D)
    if coll.text is not None:
        contents.text_vectors = _kept_vectors(coll.text, dtype)  # (T, D)
    return contents


def _kept_vectors(vectors: ShardVectors, dtype: str, file: Path | None = None):
    """The full-D vectors as a version keeps them, in ``dtype`` (``--vectors``): written to ``file`` shard by shard
    and memory-mapped, or in memory (None). sq8: codes in ranges fitted on the first :data:`SQ8_SAMPLE` rows
    (the same rows when a killed build resumes), read through :class:`SQ8Rows`."""
    store = None
    if dtype == "sq8":
        store = SQ8Rows(np.empty((0, vectors.dim), np.uint8), SQ8Rows.fit(vectors.head(SQ8_SAMPLE).full()))
    as_float = lambda rows: np.ascontiguousarray(rows, dtype=STORED_AS[dtype])  # noqa: E731  (n, D)
    encode = store.encode if store is not None else as_float
    held = stack_to_file(vectors, file, encode, STORED_AS[dtype]) if file else encode(vectors.full())
    return held if store is None else store.with_codes(held)


# ---------------------------------------------------------------------------- choosing


def choose_factory(n: int, m: int, budget: int, factory: str = "auto") -> str:
    """``factory`` itself, or for ``auto`` the one policy (``triclip.index.faiss_index.auto_factory``) within ``budget`` bytes."""
    return factory if factory != "auto" else fi.auto_factory(n, m, budget=budget)


def is_ivf(index: faiss.Index) -> bool:
    try:
        faiss.extract_index_ivf(index)
        return True
    except RuntimeError:
        return False


# ---------------------------------------------------------------------------- building


@dataclass
class ShardedBuilder:
    """Builds one index per m from :class:`ShardVectors`: in one process, or across torchrun ranks."""

    seed: int  # training sample and k-means
    rank: int = 0  # this process
    world: int = 1  # processes (torchrun ranks)
    work: Path | None = None  # folder for trained indexes and parts (world > 1) and on-disk lists
    on_disk: str = "never"  # IVF lists on disk: auto (beyond budget), always, never
    budget: int | None = None  # bytes an index may take in memory (on_disk="auto")

    def build_all(self, vectors: ShardVectors, factories: dict[int, str], kind: str) -> dict[int, faiss.Index]:
        """``{m: index}``; on ranks other than 0 the values are ``None`` (rank 0 merges)."""
        return {m: self.build(vectors, m, factory, tag=f"{kind}.m{m}") for m, factory in factories.items()}

    def build(self, vectors: ShardVectors, m: int, factory: str, tag: str = "index") -> faiss.Index | None:
        """One index over the top-m embeddings of every shard, rows in shard order."""
        empty = _new(m, factory)
        disk = self.wants_disk(empty, vectors.count, m, factory)
        if self.world == 1 and not disk and len(vectors.parts) == 1:  # vectors held in memory: built at once
            return _at_once(vectors.shard(0, m), factory, m, self.seed)
        if not is_ivf(empty):
            if self.rank != 0:
                return None
            return build_in_memory(vectors, m, empty, self.seed)
        if self.world == 1 and not disk and self.work is None:
            trained = train_once(vectors, m, empty, self.seed)
            shards = progress(range(len(vectors.parts)), desc=f"adding shards (m={m})", unit="shard", disable=None)
            parts = (add_shard(trained, vectors.shard(s, m)) for s in shards)
            return merge_parts(trained, parts, vectors.offsets)
        return self._build_parts(vectors, m, empty, tag, disk)

    def wants_disk(self, index: faiss.Index, n: int, m: int = 0, factory: str = "") -> bool:
        """Whether the IVF ``index`` with ``n`` vectors is merged on disk (the same answer on every rank)."""
        if self.on_disk not in ("auto", "always", "never"):
            raise UserError(f"--on-disk must be auto, always or never, got {self.on_disk!r}")
        if self.on_disk == "never":
            return False
        lists = fi.ivf_list_bytes(index, n)
        if lists is None:
            if self.on_disk == "always":
                raise UserError(f"--on-disk always: {factory} at m={m} is not an IVF index; only IVF lists go on disk")
            return False
        return self.on_disk == "always" or (self.budget is not None and lists > self.budget)

    def _build_parts(self, vectors: ShardVectors, m: int, empty: faiss.Index, tag: str, disk: bool):
        """Train on rank 0, add shards as saved parts (rank r: shards r, r + W, ...), merge on rank 0.

        ``disk``: parts carry their global ids and are merged into ``work/{tag}.ivfdata``;
        otherwise parts are numbered from 0 and merged in memory with id offsets. In one process every
        file is kept until the merged index is saved: a build run again after a kill reuses the trained
        index, the finished parts and the merged index (``triclip.index.parts``).
        """
        work = self.work
        if work is None:
            raise ValueError("ShardedBuilder needs a work folder for parts and on-disk lists")
        merged_file = work / f"{tag}.merged.faiss"
        what = tag.replace(".m", " m=")
        if self.world == 1 and merged_file.exists():
            resuming_line(len(vectors.parts), len(vectors.parts), what)
            return faiss.read_index(str(merged_file))
        trained_file = work / f"{tag}.trained.faiss"
        trained = self._trained(vectors, m, empty, trained_file)
        counts = np.diff(vectors.offsets)
        files = [work / f"{tag}.part{s:05d}.faiss" for s in range(len(vectors.parts))]
        mine = range(self.rank, len(vectors.parts), self.world)
        todo = [s for s in mine if self.world > 1 or not files[s].exists()]
        resuming_line(len(mine) - len(todo), len(mine), what)
        who = f"rank {self.rank} " if self.world > 1 else ""
        rows = progress(desc=f"{who}adding {what}", total=int(counts[list(mine)].sum()), unit="row", disable=None,
                        initial=int(counts[list(mine)].sum() - counts[todo].sum()))
        for s in todo:
            first = int(vectors.offsets[s]) if disk else None
            save_index(add_shard(trained, vectors.shard(s, m), first), files[s])
            rows.update(int(counts[s]))
        rows.close()
        barrier(self.world)
        if self.rank != 0:
            return None
        if disk:
            full = [s for s in range(len(files)) if counts[s]]
            with write_errors(work / f"{tag}.ivfdata"):
                merged = fi.merge_on_disk(trained, [files[s] for s in full], counts[full].tolist(), work / f"{tag}.ivfdata")
        else:
            merged = merge_parts(trained, (faiss.read_index(str(f)) for f in files), vectors.offsets)
        if self.world == 1:
            save_index(merged, merged_file)  # the parts' work done: a resume starts from here
        for f in files + [trained_file]:
            f.unlink(missing_ok=True)
        return merged

    def _trained(self, vectors: ShardVectors, m: int, empty: faiss.Index, file: Path) -> faiss.Index:
        """The empty index trained once (rank 0), saved to ``file``; read back when an earlier run saved it."""
        if self.world == 1:
            if file.exists():
                return faiss.read_index(str(file))
            trained = train_once(vectors, m, empty, self.seed)
            save_index(trained, file)
            return trained
        if self.rank == 0:
            fi.save(train_once(vectors, m, empty, self.seed), file)
        barrier(self.world)
        return faiss.read_index(str(file))


def save_index(index: faiss.Index, file: Path) -> None:
    """``fi.save`` (atomic); a full disk or a refused write is one line (UserError)."""
    with write_errors(file):
        fi.save(index, file)


def _new(m: int, factory: str) -> faiss.Index:
    try:
        return fi.new_index(m, factory)
    except ValueError as err:
        raise UserError(f"--factory at m={m}: {err}") from None


def _at_once(vectors: np.ndarray, factory: str, m: int, seed: int) -> faiss.Index:
    """``triclip.index.faiss_index.build`` (on a GPU when there is one) of vectors held in memory. (N, m)."""
    try:
        return fi.build(vectors, factory, seed=seed, progress=True)
    except ValueError as err:
        raise UserError(f"--factory at m={m}: {err}") from None


def build_in_memory(vectors: ShardVectors, m: int, index: faiss.Index, seed: int = 0) -> faiss.Index:
    """Flat / HNSW (and any index that is not IVF): train on the sample if needed, add shards in order."""
    if not index.is_trained:
        index = train_once(vectors, m, index, seed)
    rows = progress(desc=f"indexing m={m}", total=vectors.count, unit="row", disable=None)
    for s in range(len(vectors.parts)):
        if len(vectors.parts[s]):
            fi.add_vectors(index, vectors.shard(s, m))
        rows.update(len(vectors.parts[s]))
    rows.close()
    return index


def train_once(vectors: ShardVectors, m: int, index: faiss.Index, seed: int = 0) -> faiss.Index:
    """Train ``index`` (empty) on a sample drawn across the shards; the rows ``fi.build`` would draw."""
    fi._prepare_training(index, seed)
    ivf = fi.ivf_or_none(index)
    want = max(20_000, 64 * ivf.nlist) if ivf is not None else 20_000
    n = vectors.count
    rows = np.arange(n) if n <= want else np.sort(np.random.default_rng(seed).choice(n, size=want, replace=False))
    need, why = fi.min_train_vectors(index)
    if len(rows) < need:
        raise UserError(f"at m={m}: the index needs at least {need} training vectors ({why}), the shards hold {n}")
    try:
        index.train(vectors.rows(rows, m))
    except RuntimeError as err:
        raise UserError(f"at m={m}: FAISS could not train the index: {fi._last_line(err)}") from None
    return index


def add_shard(trained: faiss.Index, vectors: np.ndarray, first_id: int | None = None) -> faiss.Index:
    """A copy of the trained empty index holding one shard's vectors, numbered from 0 (or ``first_id``)."""
    part = faiss.clone_index(trained)
    if len(vectors):
        x = fi.as_float32(vectors, trained.d)  # (n_s, m)
        if first_id is None:
            part.add(x)
        else:
            part.add_with_ids(x, np.arange(first_id, first_id + len(x), dtype=np.int64))
    return part


def merge_parts(trained: faiss.Index, parts, offsets: np.ndarray) -> faiss.Index:
    """Merge shard parts (each numbered from 0) into a copy of ``trained``, part s shifted by ``offsets[s]``.

    ``IndexIVF.merge_from(other, add_id)`` adds ``add_id`` to every id of ``other``; with
    ``add_id = 0`` each shard would land on rows 0..n_s-1.
    """
    merged = faiss.clone_index(trained)
    target = faiss.extract_index_ivf(merged)
    for s, part in enumerate(parts):
        if part.ntotal != offsets[s + 1] - offsets[s]:
            raise ValueError(f"part {s} holds {part.ntotal} vectors, expected {offsets[s + 1] - offsets[s]}")
        if part.ntotal:
            target.merge_from(faiss.extract_index_ivf(part), int(offsets[s]))
    merged.ntotal = target.ntotal  # a wrapper (e.g. a pre-transform) counts its inner index's vectors
    return merged


# ---------------------------------------------------------------------------- nprobe


def tune_nprobe(index, base: ShardVectors, queries_from: ShardVectors, m: int, cfg) -> dict | None:
    """The smallest power-of-two nprobe whose recall@10 reaches ``cfg.recall_target`` (None: not IVF)."""
    if not is_ivf(index):
        return None
    nlist = faiss.extract_index_ivf(index).nlist
    rng = np.random.default_rng(cfg.seed + 1)
    q = min(cfg.tune_queries, queries_from.count)
    rows = np.sort(rng.choice(queries_from.count, size=q, replace=False))
    queries = queries_from.rows(rows, m)  # (Q, m)
    truth = exact_topk(base, queries, TUNE_K, m)
    curve = {}
    nprobe = 1
    while True:
        params = faiss.SearchParametersIVF(nprobe=nprobe)
        _, found = index.search(queries, min(TUNE_K, index.ntotal), params=params)
        curve[nprobe] = round(fi.recall_at_k(found, truth), 4)
        if curve[nprobe] >= cfg.recall_target or nprobe >= nlist:
            break
        nprobe = min(2 * nprobe, nlist)
    return {"nprobe": nprobe, "recall": curve[nprobe], "curve": {str(p): r for p, r in curve.items()}, "queries": q}


def stack_to_file(vectors: ShardVectors, file: Path, encode=None, dtype=np.float32) -> np.ndarray:
    """Write every shard's vectors, as ``encode(rows)`` (n, D) of ``dtype`` gives them (default: float32), into
    one ``.npy`` file, a shard at a time (atomic: a file there is whole, and an earlier run's is reused). Returns
    it mapped read-only.

    Plain writes, not a writable memory map: the pages of a map written through count as the process's
    resident memory until it is closed (the whole file at the end), plain writes only pass through the page
    cache."""
    if file.exists():
        return np.load(file, mmap_mode="r")
    rows = progress(desc=f"writing {file.name}", total=vectors.count, unit="row", disable=None)
    with atomic_path(file) as tmp, open(tmp, "wb") as out:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                  "shape": (vectors.count, vectors.dim)}
        np.lib.format.write_array_header_1_0(out, header)
        encode = encode or (lambda rows: np.ascontiguousarray(rows, dtype=dtype))
        for part in vectors.parts:
            if len(part):
                out.write(np.ascontiguousarray(encode(part[:]), dtype=dtype).tobytes())  # (n_s, D)
            rows.update(len(part))
    rows.close()
    return np.load(file, mmap_mode="r")
