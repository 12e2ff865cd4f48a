"""The vectors an index is built from: full-D compact vectors in shards, and their top-m prefixes.

Torch-free (numpy and FAISS only): ``triclip search --text`` imports it. A build's vectors
are always a :class:`ShardVectors`: the shards of ``triclip embed`` memory-mapped from disk,
or one in-memory part when ``index build --run --data`` embedded a small source itself.
The stored vectors are ``sqrt(w) * z`` in importance order, unit rows, so the top-m
embedding of any m is the re-normalised prefix (:func:`prefix`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from triclip.core.errors import UserError


VECTOR_BYTES = {"float32": 4, "float16": 2}  # bytes per dimension of the stored full-D vectors, by dtype


def stored_dtype(choice: str, rows: int, dim: int, where: str | os.PathLike, free: int | None = None) -> str:
    """The dtype the full-D vectors of a build are kept in (``index build --vectors``), or UserError.

    ``choice``: ``float32``, ``float16`` or ``auto`` (float32 unless its ``rows`` x ``dim`` would not fit in the
    ``free`` bytes of the filesystem holding ``where``, then float16, half the disk). A dtype that does not fit is
    refused in one line, before any work. ``free``: None, measured (``shutil.disk_usage``).
    """
    free = shutil.disk_usage(where).free if free is None else free
    need = {dtype: rows * dim * size for dtype, size in VECTOR_BYTES.items()}
    order = ("float32", "float16") if choice == "auto" else (choice,)
    fits = [d for d in order if need[d] <= free]
    if fits:
        return fits[0]
    wanted = " or ".join(f"{need[d] / 1e9:.1f} GB as {d}" for d in order)
    raise UserError(f"the full-D vectors of {rows:,} rows x {dim} need {wanted} on disk, and {os.fspath(where)}"
                    f" has {free / 1e9:.1f} GB free: free some space, or build where there is more")


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
