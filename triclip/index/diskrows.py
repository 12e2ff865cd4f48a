"""Float vectors read from disk by a re-rank: the shortlist's rows fetched in parallel, and what that costs cold.

When the full-D vectors file does not fit the build's memory budget, a re-rank's rows come from disk, not from
the page cache. Two things make that fast enough to be worth choosing:

- **one page per row**: the kernel's default read-ahead on a memory map fetches a window around every fault
  (8 MB on this machine); :class:`DiskRows` maps the file with ``MADV_RANDOM``, so a missing row costs one
  page. Measured on the 2-core VM's disk, 1M x 256 float32 (1 GB), the file evicted first: 100 random rows
  300 ms with read-ahead, 8 ms without;
- **many reads in flight**: the rows are gathered by :data:`GATHER_THREADS` threads (a page fault releases the
  GIL), so the disk serves them concurrently: 1,000 cold rows 120 ms from one thread; from 8 / 16 / 32 / 64
  threads 22 / 16 / 14 / 13 ms, and 10,000 rows 206 / 138 / 106 / 94 ms (the same VM, quiet).

:func:`cold_read_ms` times it (the choice charges it to every re-rank that reads from disk:
``triclip.index.latency.LatencyModel.cold_rows``); :func:`evict` drops a file from the page cache (what the
timing and the benchmarks' cold measurements start from), all but the pages a process still maps
(:meth:`DiskRows.drop_pages` unmaps a DiskRows's). Linux calls; elsewhere a plain gather, and eviction
does nothing.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

GATHER_THREADS = 32  # reads in flight per gather (threads waiting on page faults, not computing)
GATHER_MIN = 64  # fewer rows are gathered by the calling thread
COLD_REPS = 7  # draws of rows timed cold; the median is kept (of 3, at 10M rows: 7.2, 7.2 and 12.4 ms)

_POOL: ThreadPoolExecutor | None = None


def evict(file: str | os.PathLike) -> None:
    """Drop ``file``'s pages from the page cache (written back first), so the next reads come from the disk."""
    fd = os.open(file, os.O_RDONLY)
    try:
        getattr(os, "fdatasync", os.fsync)(fd)  # dirty pages are not dropped: written back first
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class DiskRows:
    """The rows of a ``.npy`` float32 file (N, D), mapped for random access and gathered in parallel.

    ``rows[ids]`` with ids of any shape (..., ) gives (..., D) float32, like indexing the array itself."""

    def __init__(self, file: str | os.PathLike):
        arr = np.load(file, mmap_mode="r", allow_pickle=False)
        self.file, self.shape, self.dtype = str(file), arr.shape, arr.dtype
        self._rows = np.memmap(file, arr.dtype, "r", offset=arr.offset, shape=arr.shape)  # (N, D)
        if hasattr(mmap, "MADV_RANDOM") and self._rows._mmap is not None:
            self._rows._mmap.madvise(mmap.MADV_RANDOM)

    @classmethod
    def of(cls, vectors) -> "DiskRows | None":
        """A DiskRows of the file behind a memory-mapped array, None for an array in memory."""
        name = getattr(vectors, "filename", None)
        return cls(name) if isinstance(vectors, np.memmap) and name else None

    def __len__(self) -> int:
        return int(self.shape[0])

    def drop_pages(self) -> None:
        """Unmap the pages this map has touched (``MADV_DONTNEED``): the page cache keeps a mapped page, so
        :func:`evict` can drop them only after this."""
        if hasattr(mmap, "MADV_DONTNEED") and self._rows._mmap is not None:
            self._rows._mmap.madvise(mmap.MADV_DONTNEED)

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        flat = ids.reshape(-1)  # (R,)
        if len(flat) < GATHER_MIN:
            return np.asarray(self._rows[flat]).reshape(*ids.shape, self.shape[1])
        out = np.empty((len(flat), self.shape[1]), self.dtype)  # (R, D)
        bounds = np.linspace(0, len(flat), GATHER_THREADS + 1).astype(int)

        def copy(i: int) -> None:
            out[bounds[i] : bounds[i + 1]] = self._rows[flat[bounds[i] : bounds[i + 1]]]
        list(_pool().map(copy, range(GATHER_THREADS)))
        return out.reshape(*ids.shape, self.shape[1])


def cold_read_ms(file: str | os.PathLike, count: int, reps: int = COLD_REPS) -> float:
    """Median milliseconds to gather ``count`` random rows of ``file`` (:class:`DiskRows`), the file evicted from
    the page cache before each of ``reps`` seeded draws."""
    rows = DiskRows(file)
    count = min(count, len(rows))
    rng, times = np.random.default_rng(0), []
    for _ in range(reps):
        ids = np.sort(rng.choice(len(rows), count, replace=False))
        rows.drop_pages()
        evict(file)
        started = time.perf_counter()
        rows[ids]
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1000)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="triclip-rows")
    return _POOL
