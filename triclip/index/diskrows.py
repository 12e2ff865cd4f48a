"""Float vectors read from disk by a re-rank: the shortlist's rows fetched in parallel, and what that costs cold.

When the full-D vectors file does not fit the build's memory budget, a re-rank's rows come from disk, not from
the page cache. Two things make that fast enough to be worth choosing:

- **one page per row**: the kernel's default read-ahead on a memory map fetches a window around every fault
  (8 MB on this machine); :class:`DiskRows` maps the file with ``MADV_RANDOM``, so a missing row costs one
  page. Measured on the 2-core VM's disk, 1M x 256 float32 (1 GB), the file evicted first: 100 random rows
  300 ms with read-ahead, 8 ms without;
- **every read in flight at once**: before a row is touched, the kernel is asked for all of them
  (:meth:`DiskRows.ask`: ``POSIX_FADV_WILLNEED`` per row starts its read and returns), so the disk serves them
  together, up to its queue's depth (256 here), not one per waiting thread. They are then gathered by the
  calling thread below :data:`GATHER_MIN` rows, else by :data:`GATHER_THREADS` threads (a fault releases the
  GIL). ``python -m benchmarks.rows_cold VECTORS.npy --rows 300,500,1000,10000`` (1M x 256 float32, fresh rows
  per draw, median of 25; 2026-11-27; "cold" as :func:`settle` leaves them), milliseconds cold / warm:

  | rows | 32 threads | asked, 1 thread | asked, 32 threads |
  |---:|---:|---:|---:|
  | 300 | 7.9 / 1.5 | 3.5 / 0.28 | 4.0 / 1.7 |
  | 500 | 9.9 / 1.4 | 5.8 / 0.50 | 6.2 / 2.0 |
  | 1,000 | 16.9 / 2.6 | 12.4 / 1.2 | 11.8 / 3.0 |
  | 10,000 | 174 / 8 | 157 / 13 | 142 / 13 |

:func:`cold_read_ms` times it, rows as :func:`settle` leaves them (the choice charges it to every re-rank that
reads from disk: ``triclip.index.latency.LatencyModel.cold_rows``); :func:`evict` drops a file from the page
cache (what the timing and the benchmarks' cold measurements start from), all but the pages a process still maps
(:meth:`DiskRows.drop_pages` unmaps a DiskRows's). Linux calls; elsewhere a plain gather, and eviction does
nothing.
"""

from __future__ import annotations

import mmap
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

GATHER_THREADS = 32  # reads in flight per gather (threads waiting on page faults, not computing)
GATHER_MIN = 1_000  # fewer rows (asked for first) are gathered by the calling thread: as fast cold, 1 ms less warm
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
        random_access(self._rows)
        self._at, self._row_bytes = arr.offset, arr.strides[0]  # where row 0 begins in the file, and a row's size
        self._fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)  # for the read requests (the map keeps its own)
        weakref.finalize(self, os.close, self._fd)

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
        if len(flat) > 1:
            self.ask(flat)
        return self.gather(flat).reshape(*ids.shape, self.shape[1])

    def ask(self, ids: np.ndarray) -> None:
        """Start reading the rows ``ids`` (R,) from disk, every one at once, without waiting for any."""
        starts = self._at + np.where(ids < 0, ids + len(self), ids) * self._row_bytes  # (R,) byte offsets
        will_need(self._fd, [(start, self._row_bytes) for start in starts.tolist()])

    def gather(self, ids: np.ndarray, threads: int | None = None) -> np.ndarray:
        """(R, D) the rows ``ids`` (R,), copied by ``threads`` threads (default: the calling thread below
        :data:`GATHER_MIN` rows, else :data:`GATHER_THREADS`), each waiting on its rows' page faults."""
        threads = threads or (1 if len(ids) < GATHER_MIN else GATHER_THREADS)
        if threads == 1:
            return np.asarray(self._rows[ids])
        out = np.empty((len(ids), self.shape[1]), self.dtype)  # (R, D)
        bounds = np.linspace(0, len(ids), threads + 1).astype(int)

        def copy(i: int) -> None:
            out[bounds[i] : bounds[i + 1]] = self._rows[ids[bounds[i] : bounds[i + 1]]]
        list(_pool().map(copy, range(threads)))
        return out


def random_access(array: np.ndarray) -> None:
    """A memory-mapped ``array`` read a page per fault (``MADV_RANDOM``), not a read-ahead window per fault."""
    mapped = getattr(array, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)


def will_need(fd: int | None, spans: list[tuple[int, int]]) -> None:
    """Start reading the byte ``spans`` (start, length) of the file ``fd`` into the page cache, without waiting
    (nothing for None, or where the OS has no such call)."""
    if fd is not None and hasattr(os, "posix_fadvise"):
        for start, length in spans:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)


def cold_read_ms(file: str | os.PathLike, count: int, reps: int = COLD_REPS) -> float:
    """Median milliseconds to gather ``count`` random rows of ``file`` (:class:`DiskRows`) cold: each of ``reps``
    draws is new rows, read once (untimed), then the file evicted from the page cache and the rows gathered again.

    What "cold" is (:func:`settle`): not in this machine's page cache, served by the storage below it."""
    rows = DiskRows(file)
    count = min(count, len(rows))
    rng, times = np.random.default_rng(), []  # new rows at every call: a draw read before is not drawn again
    for _ in range(reps):
        ids = np.sort(rng.choice(len(rows), count, replace=False))
        settle(rows, ids)
        started = time.perf_counter()
        rows[ids]
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1000)


def settle(rows: DiskRows, ids: np.ndarray) -> None:
    """Leave the rows ``ids`` of ``rows``'s file where a cold timing reads them from: read once, then out of the
    page cache (the map's pages dropped, the file evicted).

    A VM's disk has a cache of its own on the host, below the guest's page cache: rows it has served come back in
    1.5-1.9 ms per 100 on the 2-core VM, rows it has not in 12-90 ms (``python -m benchmarks.rows_cold``, its
    ``never read`` column), and whether it holds a row depends on what ran before, even in other processes (a
    file just written is held). Timing rows of either kind made one candidate's charge truly cold and the next
    one's not (10M, 16 B: the first 100-row timing of a file took 12.4 ms, the rest 1.3-2.2). So every timing
    reads rows the storage has just served: the cost of a row not in memory when the storage still holds it. Rows
    it no longer holds cost more, and that is not charged (docs/CONTRACT.md, "A re-rank from disk")."""
    rows[ids]
    rows.drop_pages()  # a mapped page stays cached: unmapped first
    evict(rows.file)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="triclip-rows")
    return _POOL
