"""``triclip index build --embeddings EMB``: an index folder from embedding shards, without the model.

The shards (``retrieval.shards``, written by ``triclip embed``) hold the full-D compact
vectors, so the top-m embedding of any m is a re-normalised prefix and the model is
never run again. For every m (and for the captions, when the shards have them):

- **in memory** when the index fits ``memory_budget``: ``Flat`` below 100,000 vectors,
  ``HNSW32`` up to 5,000,000 (``index.faiss_index.AutoPolicy``), else ``IVF{nlist},Flat``;
  shards are added in order.
- **beyond the budget**, ``IVF{nlist},PQ{m/4}``; any IVF index (auto or ``--factory``) is
  trained **once** on a sample drawn across all shards (the same rows
  ``index.faiss_index.train_sample`` would draw from the concatenated vectors), then
  every shard is added to its own copy of the trained empty index and the copies are
  merged in shard order with ``IndexIVF.merge_from(part, add_id=offset)``. Each copy
  numbers its vectors from 0, so the offset (the number of vectors in the shards
  before it) is what keeps row ids right: merging without it maps every shard onto
  rows 0..n-1 (the known trap; a test shows it).
- under ``torchrun`` the shards are added in parallel, rank ``r`` taking shards
  ``r, r + W, ...``: rank 0 trains and saves the empty index, every rank writes its
  parts next to the output folder, rank 0 merges them and writes the folder.
- **on disk** when an IVF index's lists (codes + ids) exceed ``memory_budget``
  (``on_disk="auto"``; ``"always"`` / ``"never"`` force it): each shard is added to a
  copy of the trained index **with its global ids** (``add_with_ids``, ids
  ``offsets[s] ...``), the part is saved, and the parts are merged, memory-mapped, into
  one ``OnDiskInvertedLists`` file (``index.faiss_index.merge_on_disk``,
  ``faiss.contrib.ondisk``) that becomes ``{kind}.m{m}.ivfdata`` of the new version; the
  full-D vectors are then written to ``vectors.npy`` shard by shard, never held whole.
  Memory is bounded by one shard, the trained index and the page cache. The parts and
  lists are written in ``.{out}.*.shard-parts`` (``.{out}.shard-parts`` under torchrun)
  beside the output folder (same filesystem: the lists file is renamed into the version,
  not copied), removed at the end. The build holds an ``fcntl.flock`` on ``owner.lock``
  in that folder (its pid and host written inside) for as long as it runs; the kernel
  drops it when the process dies, however it dies. The next build of the same output
  (and ``Searcher.load``) removes the parts folders whose lock nobody holds, i.e. those
  of killed builds (:func:`remove_stale_parts`), and keeps those of live builds.

``nprobe`` of every IVF index is tuned on held-out queries (captions for the image
index, images for the caption index, ``tune_queries`` of them, drawn by a seed): the
smallest power of two whose recall@10 against exact search reaches ``recall_target``,
recorded in the manifest as ``nprobe`` ({str(m): nprobe}) with the curve it came from.

The folder is written with ``index.store`` (format 2, versioned, under the writer lock);
its full-D vectors are kept in memory while writing, as that format holds them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
from retrieval.progress import progress

from index import faiss_index as fi
from index.store import (
    FORMAT,
    TEXT_VECTORS,
    VECTORS,
    IndexContents,
    ivfdata_name,
    write_version,
    writer_lock,
)
from retrieval.errors import UserError
from retrieval.io import claim_output_dir
from retrieval.shards import IMAGE, TEXT, barrier, check_complete, init_distributed, load_shard, shard_name

TUNE_K = 10  # recall@k that nprobe is tuned for
PARTS_SUFFIX = ".shard-parts"  # the parts folder of a build of OUT: .{OUT name}.*.shard-parts beside OUT
OWNER = "owner.lock"  # in a parts folder: flock-ed by the build that owns it while it runs


@dataclass
class EmbeddingsIndexConfig:
    """What ``triclip index build --embeddings`` was asked to do."""

    embeddings: str  # the embeddings folder (triclip embed --out)
    out: str  # index folder to write
    dims: list[int] | None = None  # m's indexed besides D, which always is
    factory: str = "auto"  # FAISS factory for every m, or auto (by size and memory_budget)
    memory_budget: int | None = None  # bytes one index may take in memory (None: half the available memory)
    text_index: bool = True  # also index the captions (when the shards hold them)
    recall_target: float = 0.95  # nprobe: the smallest reaching this recall@10 against exact search
    tune_queries: int = 1000  # held-out queries for the nprobe tuning
    seed: int = 0  # seed of the training sample, k-means and the tuning queries
    lock_timeout: float = 600.0  # seconds to wait for another writer of the folder
    on_disk: str = "auto"  # IVF lists on disk: auto (when they exceed memory_budget), always, never
    overwrite: bool = False  # replace an index already at out (its previous version is kept for one rollback)


def from_build_config(cfg) -> EmbeddingsIndexConfig:
    """The settings of an ``index.build.IndexBuildConfig`` that has ``embeddings`` set."""
    if getattr(cfg, "add", False):
        raise UserError("--add with --embeddings is not supported: build the index from all the shards")
    if getattr(cfg, "ordering", "importance") != "importance":
        raise UserError("--embeddings: the shards hold the importance ordering; --ordering does not apply")
    dims = [cfg.dims] if isinstance(cfg.dims, int) else cfg.dims
    return EmbeddingsIndexConfig(
        embeddings=cfg.embeddings,
        out=cfg.out,
        dims=dims,
        factory=cfg.factory,
        memory_budget=getattr(cfg, "memory_budget", None),
        text_index=getattr(cfg, "text_index", True),
        seed=getattr(cfg, "seed", 0),
        lock_timeout=getattr(cfg, "lock_timeout", 600.0),
        on_disk=getattr(cfg, "on_disk", "auto"),
        overwrite=getattr(cfg, "overwrite", False),
    )


def build_from_embeddings(cfg: EmbeddingsIndexConfig) -> dict:
    """Build the index folder ``cfg.out`` from the shards of ``cfg.embeddings``; returns a summary.

    Under ``torchrun`` every rank must call it; rank 0 writes the folder and returns the
    summary, the others return ``{"rank": r, ...}``.
    """
    started = time.perf_counter()
    emb_manifest = check_complete(cfg.embeddings)
    dims = _validate(cfg, emb_manifest["dim"])
    rank, world, owned = init_distributed()
    work = Path(cfg.out).absolute().parent / f".{Path(cfg.out).name}{PARTS_SUFFIX}"  # torchrun: one for all ranks
    work.parent.mkdir(parents=True, exist_ok=True)
    owner = None  # fd of the flock-ed owner file of our parts folder (rank 0)
    try:
        if rank == 0:
            remove_stale_parts(cfg.out)
        image = ShardVectors.open(cfg.embeddings, emb_manifest["num_shards"], "image")
        text = None
        if cfg.text_index and emb_manifest.get("text"):
            text = ShardVectors.open(cfg.embeddings, emb_manifest["num_shards"], "text")
        budget = cfg.memory_budget if cfg.memory_budget is not None else fi.available_memory() // 2
        factories = {m: choose_factory(image.count, m, budget, cfg.factory) for m in dims}
        text_factories = {m: choose_factory(text.count, m, budget, cfg.factory) for m in dims} if text else {}
        if world == 1:  # a folder of its own: another build of the same index may be running
            work = Path(tempfile.mkdtemp(prefix=f".{Path(cfg.out).name}.", suffix=PARTS_SUFFIX, dir=work.parent))
        elif rank == 0:  # ranks share the name; parts of an earlier, killed build are gone (remove_stale_parts)
            if (work / OWNER).exists():  # still there after remove_stale_parts: its build is alive
                raise UserError(f"another build of {cfg.out} is running (its parts are in {work}); wait for it")
            shutil.rmtree(work, ignore_errors=True)  # an older triclip's, without an owner file
            work.mkdir(parents=True)
        if rank == 0:
            owner = claim_parts(work)
        barrier(world)
        builder = ShardedBuilder(cfg.seed, rank, world, work, on_disk=cfg.on_disk, budget=budget)
        image_indexes = builder.build_all(image, factories, "image")
        text_indexes = builder.build_all(text, text_factories, "text") if text else {}
        if rank != 0:
            return {"rank": rank, "world": world, "seconds": round(time.perf_counter() - started, 2)}
        tuning = {
            "image": {m: tune_nprobe(idx, image, text or image, m, cfg) for m, idx in image_indexes.items()},
            "text": {m: tune_nprobe(idx, text, image, m, cfg) for m, idx in text_indexes.items()} if text else {},
        }
        contents = _contents(cfg, emb_manifest, image, text, image_indexes, text_indexes, work)
        contents.manifest = _manifest(cfg, emb_manifest, contents, factories, text_factories, tuning, budget)
        with writer_lock(cfg.out, cfg.lock_timeout):
            write_version(cfg.out, contents, keep_previous=True)  # an --overwrite keeps one rollback
        return _summary(cfg, contents.manifest, started, rank, world)
    finally:
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)  # parts, and lists / vectors files a failed build left
            if owner is not None:
                os.close(owner)  # releases the flock
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


# ---------------------------------------------------------------------------- parts folders


def claim_parts(work: Path) -> int:
    """Mark the parts folder ``work`` as this build's: an flock on ``work/owner.lock``; returns its fd (keep open)."""
    fd = os.open(work / OWNER, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a folder just made: nobody else holds it
    except OSError:  # a filesystem without flock: nobody can take it either, so the folder is never removed
        pass
    os.write(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode())
    return fd


def remove_stale_parts(out: str | os.PathLike) -> list[Path]:
    """Remove the parts folders that killed builds of ``out`` left beside it; returns them.

    A folder goes only when its ``owner.lock`` exists and nobody holds its flock (the
    build that made it is dead); a live build's folder, one without an owner file (an
    older triclip's, or a build in its first instant: one line says so) and one we may
    not open are kept. Each removal is one line on stderr.
    """
    out = Path(out).absolute()
    prefix = f".{out.name}."
    try:
        names = [p for p in out.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(PARTS_SUFFIX)]
    except OSError:
        return []
    removed = []
    for folder in names:
        try:
            fd = os.open(folder / OWNER, os.O_RDONLY)
        except FileNotFoundError:
            if _age(folder) > 60:  # not a build in its first instant
                print(f"kept {folder}: it has no owner record (an older triclip made it); remove it by hand"
                      f" if no build of {out} is running", file=sys.stderr, flush=True)
            continue
        except OSError:  # not a folder, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live build holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
        if not folder.exists():
            removed.append(folder)
            print(f"removed {folder}: parts of a killed index build", file=sys.stderr, flush=True)
    return removed


def _age(path: Path) -> float:
    """Seconds since ``path`` was last modified (0 when it is gone)."""
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


# ---------------------------------------------------------------------------- shards


@dataclass
class ShardVectors:
    """The vectors of one kind (image or text) across shards, memory-mapped, in shard order."""

    parts: list  # per shard (n_s, D), float16 or float32: ShardFile (or any array)
    offsets: np.ndarray  # (S + 1,) int64: shard s holds rows offsets[s]:offsets[s + 1]

    @classmethod
    def open(cls, emb: str, num_shards: int, kind: str) -> "ShardVectors":
        name = {"image": IMAGE, "text": TEXT}[kind]
        return cls.of([ShardFile(Path(emb) / shard_name(s) / name) for s in range(num_shards)])

    @classmethod
    def of(cls, parts: list[np.ndarray]) -> "ShardVectors":
        return cls(parts, np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64))

    @property
    def count(self) -> int:
        return int(self.offsets[-1])

    @property
    def dim(self) -> int:
        return int(self.parts[0].shape[1])

    def rows(self, rows: np.ndarray, m: int) -> np.ndarray:
        """Top-m embeddings of the given global rows (sorted ascending). Shape: (len(rows), m)."""
        shard = np.searchsorted(self.offsets, rows, side="right") - 1  # (R,)
        out = [prefix(self.parts[s][rows[shard == s] - self.offsets[s]], m) for s in np.unique(shard)]
        return np.concatenate(out) if out else np.zeros((0, m), np.float32)

    def shard(self, s: int, m: int) -> np.ndarray:
        """Top-m embeddings of shard ``s``. Shape: (n_s, m)."""
        return prefix(self.parts[s], m)


class ShardFile:
    """One shard's ``.npy`` vectors, memory-mapped only while a slice is copied out.

    A long-lived memory map would keep every page read so far resident (all of them: a
    prefix of each row touches every page), so the process would hold all shards at once.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        arr = np.load(self.path, mmap_mode="r")
        self.shape, self.dtype = arr.shape, arr.dtype

    def __len__(self) -> int:
        return int(self.shape[0])

    def __getitem__(self, key) -> np.ndarray:
        return np.array(np.load(self.path, mmap_mode="r")[key])  # a copy; the map closes on return

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = np.load(self.path)
        return arr if dtype is None else arr.astype(dtype, copy=False)


def prefix(vectors: np.ndarray, m: int) -> np.ndarray:
    """The first m dims re-normalised, float32. (N, D) -> (N, m); same maths as ``index.build.prefix``."""
    part = np.ascontiguousarray(vectors[:, :m], dtype=np.float32)  # (N, m)
    return part / np.maximum(np.linalg.norm(part, axis=1, keepdims=True), 1e-12)


# ---------------------------------------------------------------------------- choosing


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


def choose_factory(n: int, m: int, budget: int, factory: str = "auto") -> str:
    """``factory`` itself, or for ``auto``: Flat / HNSW32 / IVF-Flat in memory, IVF-PQ beyond the budget."""
    if factory != "auto":
        return factory
    policy = fi.AutoPolicy()
    flat = n * m * 4  # float32 codes
    if n < policy.flat_max and flat <= budget:
        return "Flat"
    if n <= policy.hnsw_max and fi.hnsw_bytes(n, m, policy.hnsw_links) <= budget:
        return f"HNSW{policy.hnsw_links}"
    if flat + 8 * n <= budget:  # codes + ids of an IVF-Flat
        return f"IVF{fi.ivf_nlist(n)},Flat"
    return fi.ivf_pq_factory(n, m)


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
        if not is_ivf(empty):
            if self.rank != 0:
                return None
            return build_in_memory(vectors, m, empty, self.seed)
        if self.world == 1 and not disk:
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
        otherwise parts are numbered from 0 and merged in memory with id offsets.
        """
        work = self.work
        if work is None:
            raise ValueError("ShardedBuilder needs a work folder for parts and on-disk lists")
        trained_file = work / f"{tag}.trained.faiss"
        if self.world == 1:
            trained = train_once(vectors, m, empty, self.seed)
        else:
            if self.rank == 0:
                fi.save(train_once(vectors, m, empty, self.seed), trained_file)
            barrier(self.world)
            trained = faiss.read_index(str(trained_file))
        counts = np.diff(vectors.offsets)
        files = [work / f"{tag}.part{s:05d}.faiss" for s in range(len(vectors.parts))]
        mine = range(self.rank, len(vectors.parts), self.world)
        who = f"rank {self.rank} " if self.world > 1 else ""
        for s in progress(mine, desc=f"{who}adding shards (m={m})", unit="shard", disable=None):
            first = int(vectors.offsets[s]) if disk else None
            fi.save(add_shard(trained, vectors.shard(s, m), first), files[s])
        barrier(self.world)
        if self.rank != 0:
            return None
        if disk:
            full = [s for s in range(len(files)) if counts[s]]
            merged = fi.merge_on_disk(trained, [files[s] for s in full], counts[full].tolist(), work / f"{tag}.ivfdata")
        else:
            merged = merge_parts(trained, (faiss.read_index(str(f)) for f in files), vectors.offsets)
        for f in files + [trained_file]:
            f.unlink(missing_ok=True)
        return merged


def _new(m: int, factory: str) -> faiss.Index:
    try:
        return fi.new_index(m, factory)
    except ValueError as err:
        raise UserError(f"--factory at m={m}: {err}") from None


def build_in_memory(vectors: ShardVectors, m: int, index: faiss.Index, seed: int = 0) -> faiss.Index:
    """Flat / HNSW (and any index that is not IVF): train on the sample if needed, add shards in order."""
    if not index.is_trained:
        index = train_once(vectors, m, index, seed)
    for s in progress(range(len(vectors.parts)), desc=f"indexing shards (m={m})", unit="shard", disable=None):
        if len(vectors.parts[s]):
            fi.add_vectors(index, vectors.shard(s, m))
    return index


def train_once(vectors: ShardVectors, m: int, index: faiss.Index, seed: int = 0) -> faiss.Index:
    """Train ``index`` (empty) on a sample drawn across the shards; the rows ``fi.build`` would draw."""
    fi._prepare_training(index, seed)
    ivf = fi._ivf_or_none(index)
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


def exact_topk(vectors: ShardVectors, queries: np.ndarray, m: int, k: int = TUNE_K) -> np.ndarray:
    """Ids of the k best rows by inner product over every shard (exact, shard by shard). Shape: (Q, k)."""
    best_s = np.full((len(queries), 0), -np.inf, np.float32)
    best_i = np.zeros((len(queries), 0), np.int64)
    for s in range(len(vectors.parts)):
        if not len(vectors.parts[s]):
            continue
        base = vectors.shard(s, m)  # (n_s, m)
        scores, ids = faiss.knn(queries, base, min(k, len(base)), metric=faiss.METRIC_INNER_PRODUCT)
        all_s = np.concatenate([best_s, scores], 1)
        all_i = np.concatenate([best_i, ids + vectors.offsets[s]], 1)
        order = np.argsort(-all_s, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(all_s, order, 1), np.take_along_axis(all_i, order, 1)
    return best_i


def tune_nprobe(index, base: ShardVectors, queries_from: ShardVectors, m: int, cfg) -> dict | None:
    """The smallest power-of-two nprobe whose recall@10 reaches ``cfg.recall_target`` (None: not IVF)."""
    if not is_ivf(index):
        return None
    nlist = faiss.extract_index_ivf(index).nlist
    rng = np.random.default_rng(cfg.seed + 1)
    q = min(cfg.tune_queries, queries_from.count)
    rows = np.sort(rng.choice(queries_from.count, size=q, replace=False))
    queries = queries_from.rows(rows, m)  # (Q, m)
    truth = exact_topk(base, queries, m)
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


# ---------------------------------------------------------------------------- folder


def _validate(cfg: EmbeddingsIndexConfig, dim: int) -> list[int]:
    dims = sorted(set(int(m) for m in (cfg.dims or [])) | {dim})
    if dims[0] < 1 or dims[-1] > dim:
        raise UserError(f"--dims must be in [1, {dim}] (the embeddings' D), got {cfg.dims}")
    if not 0 < cfg.recall_target <= 1:
        raise UserError(f"the recall target must be in (0, 1], got {cfg.recall_target}")
    if cfg.tune_queries < 1:
        raise UserError(f"tune_queries must be >= 1, got {cfg.tune_queries}")
    if cfg.memory_budget is not None and cfg.memory_budget <= 0:
        raise UserError(f"--memory-budget must be positive, got {cfg.memory_budget}")
    if cfg.on_disk not in ("auto", "always", "never"):
        raise UserError(f"--on-disk must be auto, always or never, got {cfg.on_disk!r}")
    if not cfg.factory.strip():
        raise UserError("--factory must be a FAISS factory string or auto")
    if cfg.factory != "auto":
        for m in dims:
            _new(m, cfg.factory)
    claim_output_dir(cfg.out, "index", overwrite=cfg.overwrite)
    return dims


def _contents(cfg, emb_manifest, image: ShardVectors, text, image_indexes, text_indexes, work: Path) -> IndexContents:
    """The version to write; with an index on disk, its lists and the vectors are files in ``work``."""
    metas, text_rows = [], []
    for s in range(emb_manifest["num_shards"]):
        shard = load_shard(cfg.embeddings, s, text=text is not None)
        if text is not None:
            text_rows.append(shard["text_rows"] + np.array([image.offsets[s], 0]))
        metas.append(shard["meta"])
    meta = _unique_ids([row for part in metas for row in part])
    contents = IndexContents({}, meta, None, image_indexes)
    if text is not None:
        contents.text_rows = np.concatenate(text_rows).astype(np.int64).reshape(-1, 2)
        contents.text_indexes = text_indexes
    files = {}
    for kind, table in (("image", image_indexes), ("text", text_indexes)):
        for m, index in table.items():
            if fi.is_on_disk(index):
                files[ivfdata_name(kind, m)] = Path(fi.on_disk_lists(index).filename)
    if files:  # too big for memory: the vectors go to their file shard by shard
        files[VECTORS] = work / VECTORS
        contents.vectors = stack_to_file(image, files[VECTORS])  # (N, D) memory-mapped
        if text is not None:
            files[TEXT_VECTORS] = work / TEXT_VECTORS
            contents.text_vectors = stack_to_file(text, files[TEXT_VECTORS])  # (T, D)
        contents.files = files
        return contents
    contents.vectors = np.concatenate([np.asarray(p, np.float32) for p in image.parts])  # (N, D)
    if text is not None:
        contents.text_vectors = np.concatenate([np.asarray(p, np.float32) for p in text.parts])  # (T, D)
    return contents


def stack_to_file(vectors: ShardVectors, file: Path) -> np.ndarray:
    """Write every shard's vectors, float32, into one ``.npy`` file, a shard at a time. Returns it mapped read-only."""
    out = np.lib.format.open_memmap(file, mode="w+", dtype=np.float32, shape=(vectors.count, vectors.dim))
    for s, part in enumerate(vectors.parts):
        if len(part):
            out[vectors.offsets[s] : vectors.offsets[s + 1]] = np.asarray(part[:], np.float32)
    out.flush()
    del out
    return np.load(file, mmap_mode="r")


def _unique_ids(meta: list[dict]) -> list[dict]:
    """Ids stay unique across shards (``key#2``...); the source's keys already are, normally."""
    taken: Counter = Counter()
    for row in meta:
        taken[row["id"]] += 1
        if taken[row["id"]] > 1:
            row["id"] = f"{row['id']}#{taken[row['id']]}"
    return meta


def _manifest(cfg, emb: dict, contents, factories, text_factories, tuning, budget) -> dict:
    from index.build import run_recall  # the run's measured recall per m, if its folder is still there

    from retrieval.run import METRICS

    dims = contents.dims
    transform = emb["transform"]
    nprobe = {str(m): t["nprobe"] for m, t in tuning["image"].items() if t is not None}
    skipped = Counter(emb.get("skipped", {}))
    for s in range(emb["num_shards"]):
        skipped.update(load_shard(cfg.embeddings, s, text=False)["info"].get("skipped", {}))
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    return {
        "format": FORMAT,
        "run": emb["run"],
        "fingerprint": emb["fingerprint"],
        "model": emb.get("model"),
        "ordering": transform["ordering"],
        "dim": emb["dim"],
        "dims": dims,
        "transform": transform,
        "importance": [round(float(v), 6) for v in emb["importance"]],
        "recall": run_recall(emb["run"], transform["ordering"], dims),
        "recall_source": os.path.join(emb["run"], METRICS),
        "factories": {str(m): f for m, f in factories.items()},
        "text_factories": {str(m): f for m, f in text_factories.items()} if contents.text_vectors is not None else None,
        "factory_option": cfg.factory,
        "metric": "inner_product",
        "count": len(contents.meta),
        "text_count": None if contents.text_vectors is None else int(len(contents.text_vectors)),
        "sources": [{"embeddings": os.path.abspath(cfg.embeddings), "data": emb.get("data"),
                     "fingerprint": emb.get("data_fingerprint"), "added": len(contents.meta)}],
        "skipped": dict(skipped),
        "embeddings": os.path.abspath(cfg.embeddings),
        "memory_budget": int(budget),
        "on_disk_option": cfg.on_disk,  # the manifest's on_disk (the lists files) is written by index.store
        "nprobe": nprobe,  # {str(m): nprobe} for the IVF image indexes
        "text_nprobe": {str(m): t["nprobe"] for m, t in tuning["text"].items() if t is not None},
        "nprobe_tuning": {
            "recall_target": cfg.recall_target,
            "k": TUNE_K,
            "image": {str(m): t for m, t in tuning["image"].items() if t is not None},
            "text": {str(m): t for m, t in tuning["text"].items() if t is not None},
        },
        "created": now,
        "updated": now,
    }


def _summary(cfg, manifest: dict, started: float, rank: int, world: int) -> dict:
    return {
        "index": os.path.abspath(cfg.out),
        "embeddings": manifest["embeddings"],
        "count": manifest["count"],
        "text_count": manifest["text_count"],
        "dims": manifest["dims"],
        "dim": manifest["dim"],
        "factories": manifest["factories"],
        "nprobe": manifest["nprobe"],
        "on_disk": manifest.get("on_disk", {}),
        "recall": manifest["recall"],
        "fingerprint": manifest["fingerprint"],
        "skipped": manifest["skipped"],
        "rank": rank,
        "world": world,
        "seconds": round(time.perf_counter() - started, 2),
    }
