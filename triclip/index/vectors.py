"""The vectors an index is built from: full-D compact vectors in shards, and their top-m prefixes.

Torch-free (numpy and FAISS only): ``triclip search --text`` imports it. A build's vectors
are always a :class:`ShardVectors`: the shards of ``triclip embed`` memory-mapped from disk,
or one in-memory part when ``index build --run --data`` embedded a small source itself.
The stored vectors are ``sqrt(w) * z`` in importance order, unit rows, so the top-m
embedding of any m is the re-normalised prefix (:func:`prefix`).
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from triclip.core.errors import UserError


VECTOR_BYTES = {"float32": 4, "float16": 2, "sq8": 1}  # bytes per dimension of the stored full-D vectors, by dtype
STORED_AS = {"float32": np.float32, "float16": np.float16, "sq8": np.uint8}  # the numpy dtype of each in its .npy
SQ8_SAMPLE = 100_000  # rows an sq8 store's ranges are fitted on (the first ones: the same on a resumed build)
SQ8_ROTATION_SEED = 0  # seed of the fixed random rotation sq8 codes are cut after (:func:`rotation`); the manifest
# records it (``vectors_sq8["rotation_seed"]``), and codes of another are refused, not decoded wrong


def stored_dtype(choice: str, rows: int, dim: int, where: str | os.PathLike, free: int | None = None) -> str:
    """The dtype the full-D vectors of a build are kept in (``index build --vectors``), or UserError.

    ``choice``: ``float32``, ``float16``, ``sq8`` or ``auto`` (float32 unless its ``rows`` x ``dim`` would not fit
    in the ``free`` bytes of the filesystem holding ``where``, then float16, half the disk, then sq8, a quarter). A
    dtype that does not fit is refused in one line, before any work. ``free``: None, measured
    (``shutil.disk_usage``).
    """
    free = shutil.disk_usage(where).free if free is None else free
    need = {dtype: rows * dim * size for dtype, size in VECTOR_BYTES.items()}
    order = ("float32", "float16", "sq8") if choice == "auto" else (choice,)
    fits = [d for d in order if need[d] <= free]
    if fits:
        return fits[0]
    wanted = " or ".join(f"{need[d] / 1e9:.1f} GB as {d}" for d in order)
    raise UserError(f"the full-D vectors of {rows:,} rows x {dim} need {wanted} on disk, and {os.fspath(where)}"
                    f" has {free / 1e9:.1f} GB free: free some space, or build where there is more")


def stored_name(vectors) -> str:
    """The name (a key of :data:`VECTOR_BYTES`) of the precision stored vectors are kept in; float32 for any other."""
    if isinstance(vectors, SQ8Rows):
        return "sq8"
    return str(vectors.dtype) if str(vectors.dtype) in ("float32", "float16") else "float32"


class SQ8Rows:
    """Full-D vectors kept as 8-bit codes (``index build --vectors sq8``), read like an (N, D) float32 array.

    Each row is first turned by a fixed random rotation (:func:`rotation`), which spreads its mass over every
    dimension, so the range each dimension is cut in is narrow against the rows. FAISS's own scalar quantiser
    (``faiss.ScalarQuantizer``, ``QT_8bit``: each turned dimension's range, min to max over the rows it was fitted
    on, in 256 steps; values outside it are clipped) encodes and decodes. Measured (``benchmarks.vectors_dtype``,
    ``scripts/rows_precision.py``): exact search over the decoded rows keeps .968 +- .006 of the float32 top 10
    among 1M rows, against .940 +- .007 without the rotation, and .879 among 10M (one seed: the loss grows with N,
    as near-ties crowd). Written here because FAISS keeps its codes inside an
    index in memory; a re-rank needs them as rows of a plain ``.npy`` file that
    :class:`triclip.index.diskrows.DiskRows` reads from disk a page per row. ``rows[key]`` decodes only the rows
    asked for (any key numpy takes) and turns them back, so "more like this" and the Milvus export read it as they
    read float vectors; a re-rank scores them unturned against queries turned once (:meth:`scored`, the same
    inner products). ``params``: the quantiser's ranges in the turned space (2 x D float32: every dimension's
    minimum, then its width), recorded in the manifest (``vectors_sq8``).
    """

    def __init__(self, codes, params: np.ndarray):
        self.codes = codes  # (N, D) uint8: an array, a memory map or a DiskRows
        self.shape, self.dtype = tuple(codes.shape), np.dtype(np.uint8)
        self.params = np.asarray(params, np.float32).reshape(-1)  # (2 * D,)
        if self.params.shape != (2 * self.shape[1],) or not np.isfinite(self.params).all():
            raise ValueError(f"sq8 ranges must be {2 * self.shape[1]} finite numbers, got {self.params.shape}")
        self._sq = _quantiser(self.shape[1], self.params)
        self.turn = rotation(self.shape[1])  # (D, D): a row x is coded as x @ turn

    @classmethod
    def fit(cls, sample: np.ndarray) -> np.ndarray:
        """The ranges (2 x D float32) of an sq8 store fitted on ``sample`` (n, D); no rows: every range [0, 0]."""
        if not len(sample):
            return np.zeros(2 * sample.shape[1], np.float32)
        sq = faiss.ScalarQuantizer(sample.shape[1], faiss.ScalarQuantizer.QT_8bit)
        sq.train(np.asarray(sample, np.float32) @ rotation(sample.shape[1]))
        return faiss.vector_to_array(sq.trained).astype(np.float32)

    def encode(self, rows: np.ndarray) -> np.ndarray:
        """(n, D) float -> (n, D) uint8 codes of the turned rows in this store's ranges."""
        return encode_sq8(self._sq, np.asarray(rows, np.float32) @ self.turn)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """(..., D) uint8 -> (..., D) float32, turned back."""
        return self._decoded(codes) @ self.turn.T

    def scored(self, rows: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(U,) row ids, (Q, D) queries -> their rows decoded (U, D) and the queries (Q, D), both turned: the same
        inner products as the rows turned back, without a (D, D) product per row (a re-rank's many candidates)."""
        decoded = self._decoded(np.asarray(self.codes[np.asarray(rows, np.int64)]))  # (U, D)
        return decoded, np.asarray(queries, np.float32) @ self.turn

    def _decoded(self, codes: np.ndarray) -> np.ndarray:
        """(..., D) uint8 -> (..., D) float32 in the turned space."""
        flat = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1, self.shape[1])
        return self._sq.decode(flat).reshape(*np.shape(codes)[:-1], self.shape[1])

    def __len__(self) -> int:
        return int(self.shape[0])

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape))

    @property
    def filename(self) -> str | None:
        """The codes' file when they are memory-mapped (as ``np.memmap.filename``), else None."""
        return getattr(self.codes, "filename", None)

    def __getitem__(self, key) -> np.ndarray:
        return self.decode(np.asarray(self.codes[key]))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.decode(np.asarray(self.codes)).astype(dtype or np.float32, copy=False)

    def reconstruct(self, rows: np.ndarray) -> np.ndarray:
        """(U,) row ids -> (U, D) float32, as a codec decodes."""
        return self[np.asarray(rows, np.int64)]

    def with_codes(self, codes) -> "SQ8Rows":
        """The same ranges over other codes (more rows, or the same file read through a DiskRows)."""
        return SQ8Rows(codes, self.params)


@functools.lru_cache(maxsize=4)
def rotation(dim: int, seed: int = SQ8_ROTATION_SEED) -> np.ndarray:
    """The fixed random rotation of sq8 codes: a (D, D) orthogonal float32 matrix, the same for a ``dim`` and
    ``seed`` on every machine up to float rounding (PCG64 normals, the QR in float64, its signs fixed so that R's
    diagonal is positive). Read-only: one cached copy."""
    normal = np.random.default_rng(seed).standard_normal((dim, dim))
    q, r = np.linalg.qr(normal)
    turn = (q * np.where(np.diag(r) < 0, -1.0, 1.0)).astype(np.float32)
    turn.flags.writeable = False
    return turn


def sq8_ranges(entry, kind: str, dim: int) -> np.ndarray:
    """The ranges (2 x D) of the ``kind`` ("image" / "text") vectors in a manifest's ``vectors_sq8`` entry;
    ValueError says what is missing (no ranges, or codes cut after another rotation than :func:`rotation`)."""
    if not isinstance(entry, dict) or entry.get("rotation_seed") != SQ8_ROTATION_SEED:
        raise ValueError(f"vectors_sq8 lacks rotation_seed {SQ8_ROTATION_SEED}, the rotation its codes were cut after")
    try:
        ranges = np.asarray(entry[kind], np.float32)  # (2 * D,)
    except (KeyError, TypeError, ValueError):
        ranges = None
    if ranges is None or ranges.shape != (2 * dim,) or not np.isfinite(ranges).all():
        raise ValueError(f"vectors_sq8 lacks the {kind} vectors' ranges (2 x {dim} finite numbers)")
    return ranges


def appended(stored, rows: np.ndarray):
    """Stored full-D vectors with ``rows`` (n, D) after them, in the same precision (sq8: the same ranges)."""
    if isinstance(stored, SQ8Rows):
        return stored.with_codes(np.concatenate([np.asarray(stored.codes), stored.encode(rows)]))
    return np.concatenate([stored, np.asarray(rows).astype(stored.dtype)])


def _quantiser(dim: int, params: np.ndarray) -> "faiss.ScalarQuantizer":
    sq = faiss.ScalarQuantizer(dim, faiss.ScalarQuantizer.QT_8bit)
    sq.trained.resize(len(params))
    faiss.copy_array_to_vector(params, sq.trained)
    return sq


def encode_sq8(sq: "faiss.ScalarQuantizer", rows: np.ndarray) -> np.ndarray:
    """(n, D) float -> (n, D) uint8 codes of a fitted quantiser."""
    return sq.compute_codes(np.ascontiguousarray(rows, dtype=np.float32))


def prefix(vectors: np.ndarray, m: int) -> np.ndarray:
    """The top-m embedding from full-D compact vectors: the first m dims, re-normalised. (N, D) -> (N, m) float32."""
    part = np.ascontiguousarray(vectors[:, :m], dtype=np.float32)  # (N, m)
    return part / np.maximum(np.linalg.norm(part, axis=1, keepdims=True), 1e-12)


@dataclass
class ShardVectors:
    """The vectors of one kind (image or text) across shards, in shard order."""

    parts: list  # per shard (n_s, D), float16 or float32: ShardFile (or any array)
    offsets: np.ndarray  # (S + 1,) int64: shard s holds rows offsets[s]:offsets[s + 1]

    @classmethod
    def open(cls, emb: str, num_shards: int, kind: str) -> "ShardVectors":
        """The ``kind`` ("image" / "text") vectors of the embeddings folder ``emb`` (``triclip embed``)."""
        from triclip.model.shards import IMAGE, TEXT, shard_name

        name = {"image": IMAGE, "text": TEXT}[kind]
        return cls.of([ShardFile(Path(emb) / shard_name(s) / name) for s in range(num_shards)])

    @classmethod
    def of(cls, parts: list[np.ndarray]) -> "ShardVectors":
        """Arrays (or :class:`ShardFile`) as shards; ``ShardVectors.of([x])``: vectors held in memory."""
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

    def chunked(self, rows: int) -> "ShardVectors":
        """The same rows in parts of at most ``rows`` (each read only when used: :class:`ShardSlice`)."""
        return ShardVectors.of([ShardSlice(p, lo, min(lo + rows, len(p))) for p in self.parts
                                for lo in range(0, len(p), rows)])

    def head(self, n: int) -> "ShardVectors":
        """The first ``n`` rows (every row where there are fewer), in the same parts, the last one cut at ``n``."""
        parts = []
        for part, lo in zip(self.parts, self.offsets[:-1].tolist()):
            if lo >= n:
                break
            parts.append(part if lo + len(part) <= n else ShardSlice(part, 0, n - lo))
        return ShardVectors.of(parts)

    def full(self) -> np.ndarray:
        """Every row at full D, float32, in memory. Shape: (N, D)."""
        return np.concatenate([np.asarray(p, np.float32) for p in self.parts])


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


class ShardSlice:
    """Rows ``lo:hi`` of one part (a :class:`ShardFile` or an array), copied out only when used as an array."""

    def __init__(self, part, lo: int, hi: int):
        self.part, self.lo, self.hi = part, lo, hi
        self.shape, self.dtype = (hi - lo, *part.shape[1:]), part.dtype

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, key) -> np.ndarray:
        return np.asarray(self.part[self.lo : self.hi])[key]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = np.asarray(self.part[self.lo : self.hi])  # (hi - lo, D)
        return arr if dtype is None else arr.astype(dtype, copy=False)


def exact_topk(base: ShardVectors | np.ndarray, queries: np.ndarray, k: int, m: int | None = None) -> np.ndarray:
    """Ids of the k largest inner products over every row, exact, shard by shard. Shape: (Q, k').

    ``base``: shards, or an (N, d) array searched as it is. ``m``: compare the top-m
    embeddings (re-normalised prefixes) of the shards; None: the rows as they are.
    """
    if not isinstance(base, ShardVectors):
        base = ShardVectors.of([np.asarray(base, np.float32)])
        m = None
    parts = ((np.arange(base.offsets[s], base.offsets[s + 1]),
              base.shard(s, m) if m is not None else base.parts[s]) for s in range(len(base.parts)))  # (n_s, d)
    return exact_topk_of(parts, queries, k)


def exact_topk_of(parts, queries: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest inner products over ``parts`` (an iterable of (ids (n,), rows (n, d))), exact, a part
    at a time. Shape: (Q, k'), k' = min(k, rows seen)."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    best_s = np.full((len(queries), 0), -np.inf, np.float32)
    best_i = np.zeros((len(queries), 0), np.int64)
    for ids, rows in parts:
        if not len(rows):
            continue
        rows = np.ascontiguousarray(rows, dtype=np.float32)  # (n, d)
        scores, at = faiss.knn(queries, rows, min(k, len(rows)), metric=faiss.METRIC_INNER_PRODUCT)
        all_s = np.concatenate([best_s, scores], 1)
        all_i = np.concatenate([best_i, np.asarray(ids, np.int64)[at]], 1)
        order = np.argsort(-all_s, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(all_s, order, 1), np.take_along_axis(all_i, order, 1)
    return best_i
