"""A version's meta rows read one at a time: ``meta.jsonl`` with a row -> byte offset table and an id lookup.

    INDEX/v000003/meta.jsonl        one line per image row: {"id", "image", "captions", "label", "file"}
    INDEX/v000003/meta.offsets.npy  (N + 1,) int64: the byte where row i's line begins; the last is the file's size
    INDEX/v000003/meta.idhash.npy   (N,) uint64: the 8-byte hash of every id (``metarows.id_hash``), ascending
    INDEX/v000003/meta.idrow.npy    (N,) int64: the row of each hash above (ties by row)

:func:`write_meta` writes the four files in one pass over the rows (8 + 8 bytes a row held while it runs, 24
while the hashes are sorted). A reader memory-maps the three arrays: :class:`LazyMeta` is the sequence of rows
whose ``[i]`` reads and parses line i alone (``os.pread``, safe from many threads), and :class:`IdRows` the
mapping id -> row, found by binary search of the hashes and then checked against the row's own id. Neither
holds a Python object per row (a list of N dicts and an id dict cost ~690 MiB per million rows).

Read cold (nothing in the page cache), a row costs a read of the offsets and one of its line. Two things keep
that small (measured at 10M rows, 10 random rows, every file evicted: ``benchmarks/meta_cold.py``):

- the arrays are mapped for random access (``MADV_RANDOM``): a fault reads one page, not the kernel's read-ahead
  window around it (8 MB on this machine): 38 ms -> 1.4 ms;
- :meth:`LazyMeta.rows` (a search's k hits) asks the kernel for every row's offsets, then every line, at once
  (``POSIX_FADV_WILLNEED``) before reading them, so the disk serves them together: 1.4 ms -> 0.3 ms.

The arrays are files of the version like any other, vouched for by its manifest (``triclip.index.filecheck``);
a version written without them is read whole into a list, as before (``triclip.index.store``).
"""

from __future__ import annotations

import json
import os
import weakref
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from triclip.core.errors import UserError
from triclip.index.diskrows import random_access, will_need
from triclip.index.metarows import id_hash, row_index

OFFSETS = "meta.offsets.npy"  # (N + 1,) int64 byte offsets of the lines of meta.jsonl
ID_HASHES = "meta.idhash.npy"  # (N,) uint64 id hashes, ascending
ID_ROWS = "meta.idrow.npy"  # (N,) int64 the row of each id hash
FILES = (OFFSETS, ID_HASHES, ID_ROWS)
ITER_ROWS = 4096  # rows read at once when iterating


def write_meta(folder: Path, meta_name: str, rows: Iterable[dict]) -> int:
    """Write ``rows`` to ``folder/meta_name`` (one JSON line each) and the offset and id files beside it;
    returns how many rows."""
    offsets, hashes = array("q", [0]), array("Q")
    with open(folder / meta_name, "wb") as fh:
        for row in rows:
            line = (json.dumps(row, ensure_ascii=False, default=str) + "\n").encode("utf-8")
            fh.write(line)
            offsets.append(offsets[-1] + len(line))
            hashes.append(id_hash(row["id"]))
    h = np.frombuffer(hashes, np.uint64) if len(hashes) else np.zeros(0, np.uint64)  # (N,)
    order = np.argsort(h, kind="stable")  # (N,) rows by hash, ties by row
    np.save(folder / OFFSETS, np.frombuffer(offsets, np.int64))
    np.save(folder / ID_HASHES, h[order])
    np.save(folder / ID_ROWS, order.astype(np.int64))
    return len(hashes)


def is_row(row) -> bool:
    """A meta line's shape: an object with a string id and a list of captions."""
    return isinstance(row, dict) and isinstance(row.get("id"), str) and isinstance(row.get("captions"), list)


class LazyMeta(Sequence):
    """The rows of ``meta.jsonl``, each read and parsed when asked; ``ids`` is the id -> row lookup.

    The file is held open from the load on (read with ``os.pread``): a writer that removes the version meanwhile
    (an ``--add`` swapped in) leaves this reader its rows, as it leaves it the mapped arrays.
    """

    def __init__(self, file: Path, offsets: np.ndarray, hashes: np.ndarray, order: np.ndarray, damaged):
        self.file = Path(file)  # meta.jsonl
        self.offsets = offsets  # (N + 1,) int64, memory-mapped
        self.hashes = hashes  # (N,) uint64 ascending, memory-mapped
        self.order = order  # (N,) int64, memory-mapped
        self.damaged = damaged  # what -> the UserError naming the version
        self.ids = IdRows(self)  # id -> row
        try:
            self._fd = os.open(self.file, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise UserError(f"cannot read {self.file} ({err.strerror})") from None
        weakref.finalize(self, os.close, self._fd)
        self._offsets_fd, self._offsets_at = None, 0  # the offsets' file and where their data begin, when mapped
        if isinstance(offsets, np.memmap) and offsets.filename:
            try:
                self._offsets_fd = os.open(offsets.filename, os.O_RDONLY | os.O_CLOEXEC)
                self._offsets_at = offsets.offset
                weakref.finalize(self, os.close, self._offsets_fd)
            except OSError:  # the version was removed since it was mapped: its rows are read without the hint
                pass

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = row_index(i, len(self))
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self._parse(self._read(start, end), i, end - start)

    def rows(self, rows: Sequence[int]) -> list[dict]:
        """``[self[i] for i in rows]``, the disk reads of every row asked for before any is waited on: first
        their offsets, then their lines (``POSIX_FADV_WILLNEED`` starts a read and returns)."""
        rows = [row_index(i, len(self)) for i in rows]
        if len(rows) > 1:
            will_need(self._offsets_fd, [(self._offsets_at + 8 * i, 16) for i in rows])
            will_need(self._fd, [(int(self.offsets[i]), int(self.offsets[i + 1]) - int(self.offsets[i]))
                                 for i in rows])
        return [self[i] for i in rows]

    def __iter__(self) -> Iterator[dict]:
        for a in range(0, len(self), ITER_ROWS):
            b = min(len(self), a + ITER_ROWS)
            cuts = np.asarray(self.offsets[a : b + 1]).tolist()  # (b - a + 1,)
            block = self._read(cuts[0], cuts[-1])
            for j in range(b - a):
                yield self._parse(block[cuts[j] - cuts[0] : cuts[j + 1] - cuts[0]], a + j, cuts[j + 1] - cuts[j])

    def _read(self, start: int, end: int) -> bytes:
        """The bytes ``start:end`` of the file (fewer where it is shorter)."""
        chunks, at = [], start
        try:
            while at < end:
                chunk = os.pread(self._fd, end - at, at)
                if not chunk:
                    break
                chunks.append(chunk)
                at += len(chunk)
        except OSError as err:
            raise UserError(f"cannot read {self.file} ({err.strerror})") from None
        return b"".join(chunks)

    def __add__(self, other) -> list[dict]:  # an --add appends rows: the extended version is written whole
        return list(self) + list(other)

    def _parse(self, line: bytes, i: int, length: int) -> dict:
        try:
            if len(line) != length:
                raise ValueError(f"{len(line)} bytes where the offsets say {length}")
            row = json.loads(line)
            if not is_row(row):
                raise ValueError("not an image row")
        except (UnicodeDecodeError, ValueError) as err:
            raise self.damaged(f"row {i} of {self.file.name} does not read ({str(err).splitlines()[0]})") from None
        return row


class IdRows(Mapping):
    """Image id -> row of a :class:`LazyMeta` (the last row holding it, as a dict of the rows would say)."""

    def __init__(self, meta: LazyMeta):
        self.meta = meta

    def __getitem__(self, rid) -> int:
        if not isinstance(rid, str):
            raise KeyError(rid)
        x = np.uint64(id_hash(rid))
        lo, hi = np.searchsorted(self.meta.hashes, x, "left"), np.searchsorted(self.meta.hashes, x, "right")
        for row in reversed(self.meta.order[lo:hi].tolist()):  # rows ascending: the last holder first
            if self.meta[row]["id"] == rid:
                return int(row)
        raise KeyError(rid)

    def __iter__(self) -> Iterator[str]:
        seen = set()
        for row in self.meta:
            if row["id"] not in seen:
                seen.add(row["id"])
                yield row["id"]

    def __len__(self) -> int:
        return len(self.meta)


def id_rows(meta: Sequence[dict]) -> Mapping:
    """Id -> row of ``meta``: the lookup of a :class:`LazyMeta`, else a dict (a version read whole)."""
    if isinstance(meta, LazyMeta):
        return meta.ids
    return {row["id"]: i for i, row in enumerate(meta)}


def meta_rows(meta: Sequence[dict], rows: list[int]) -> list[dict]:
    """``[meta[i] for i in rows]``; a :class:`LazyMeta` reads them from disk together (:meth:`LazyMeta.rows`)."""
    return meta.rows(rows) if isinstance(meta, LazyMeta) else [meta[i] for i in rows]


def open_meta(folder: Path, meta_name: str, count: int, arrays: dict, damaged) -> LazyMeta:
    """The lazy rows of a version; ``arrays``: file name -> the array read (memory-mapped) from each of :data:`FILES`."""
    offsets, hashes, order = (arrays[name] for name in FILES)
    fine = (offsets.dtype == np.int64 and offsets.shape == (count + 1,) and hashes.dtype == np.uint64
            and hashes.shape == (count,) and order.dtype == np.int64 and order.shape == (count,))
    if not fine:
        raise damaged(f"{OFFSETS} / {ID_HASHES} / {ID_ROWS} do not match {count} rows")
    size = (folder / meta_name).stat().st_size
    if int(offsets[0]) != 0 or int(offsets[-1]) != size:
        raise damaged(f"{OFFSETS} does not span {meta_name} ({int(offsets[-1]):,} of {size:,} bytes)")
    for mapped in (offsets, hashes, order):
        random_access(mapped)
    return LazyMeta(folder / meta_name, offsets, hashes, order, damaged)

