"""The meta rows of a build from embedding shards, read from the shards' ``meta.jsonl`` files, never held whole.

A :class:`MetaRows` is the sequence ``unique_ids(every shard's rows, in shard order)``
(``triclip.index.manifest.unique_ids``) without the list: its length comes from the shards' ``shard.json``
counts, iteration reads one line at a time, ``rows[i]`` reads shard ``i`` falls in up to row ``i`` (one shard's
rows read so far are cached: the evaluation set reads the first rows in order). A list of N dicts costs about
690 MiB per million rows; this costs the shards' counts.

Ids are made unique without a set of N strings (:func:`unique_renames`): an 8-byte hash of every id
(8 bytes a row, sorted once: 16 bytes a row while it runs); only when two hashes are equal are the strings of
those rows read, and the renaming of ``unique_ids`` replayed on them exactly (a renamed ``key#2`` is checked
against every other id by its hash, then by its string). The renames (row -> new id; none when the ids are
unique) can be kept in a file (a build's parts folder), so a resumed build does not read every id again.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from triclip.core.errors import UserError
from triclip.core.io import write_text_atomic

_ID_FIRST = '{"id": '  # how a meta line of triclip embed begins
_DECODER = json.JSONDecoder()
RENAMES = "meta.renames.json"  # in a build's parts folder: the renames of the unique ids, [[row, id], ...]


class MetaRows:
    """The rows of ``files`` (one ``meta.jsonl`` per shard, ``counts[s]`` rows each) with unique ids."""

    def __init__(self, files: list[Path], counts, kept: Path | None = None):
        self.files = [Path(f) for f in files]  # each shard's meta.jsonl, in shard order
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))])  # (S + 1,) first row of each
        self.kept = kept  # a file the renames are kept in (read back when it exists), or None
        self._renames: dict[int, str] | None = None
        self._cache: tuple[int, list[dict], Iterator[dict]] | None = None  # (shard, its rows read so far, the rest)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __iter__(self) -> Iterator[dict]:
        renames = self.renames
        for i, row in enumerate(self.raw()):
            if i in renames:
                row["id"] = renames[i]
            yield row

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = row_index(i, len(self))
        row = dict(self.raw_at(i))
        if i in self.renames:
            row["id"] = self.renames[i]
        return row

    @property
    def renames(self) -> dict[int, str]:
        """Row -> its unique id, for the rows whose id ``unique_ids`` changes (usually none)."""
        if self._renames is None:
            self._renames = _read_renames(self.kept) if self.kept is not None and self.kept.exists() else None
        if self._renames is None:
            self._renames = unique_renames(self)
            if self.kept is not None:
                write_text_atomic(self.kept, json.dumps(sorted(self._renames.items())) + "\n")
        return self._renames

    def raw(self, shards: range | None = None, parse=json.loads) -> Iterator:
        """Every row as its shard wrote it (ids not made unique), shard by shard; ``parse``: of each line."""
        for s in shards if shards is not None else range(len(self.files)):
            n = 0
            for row in _lines(self.files[s], parse):
                n += 1
                yield row
            if n != self.offsets[s + 1] - self.offsets[s]:
                raise UserError(f"{self.files[s]} holds {n} rows, its shard.json says"
                                f" {self.offsets[s + 1] - self.offsets[s]}; run `triclip embed` again to recompute it")

    def ids_of(self, rows: np.ndarray) -> dict[int, object]:
        """``{row: its id as written}`` of the (sorted) ``rows``, in one pass over the shards that hold them."""
        want = np.zeros(len(self), bool)
        want[rows] = True
        shards = np.unique(np.searchsorted(self.offsets, rows, side="right") - 1)
        out = {}
        for s in shards.tolist():
            first = int(self.offsets[s])
            for j, rid in enumerate(self.raw(range(s, s + 1), parse=line_id)):
                if want[first + j]:
                    out[first + j] = rid
        return out

    def raw_at(self, i: int) -> dict:
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        if self._cache is None or self._cache[0] != s:
            self._cache = (s, [], self.raw(range(s, s + 1)))
        _, rows, rest = self._cache
        local = i - int(self.offsets[s])
        while len(rows) <= local:
            rows.append(next(rest))
        return rows[local]


def row_index(i, n: int) -> int:
    """Row ``i`` of ``n`` as a list indexes it (negative from the end); IndexError outside."""
    i = int(i) + (n if int(i) < 0 else 0)
    if not 0 <= i < n:
        raise IndexError(f"row {i} of {n}")
    return i


def _lines(file: Path, parse) -> Iterator:
    try:
        with open(file, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    yield parse(line)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"cannot read {file} ({str(err).splitlines()[0]}); run `triclip embed` again to recompute"
                        " its shard") from None


def _read_renames(file: Path) -> dict[int, str] | None:
    """The renames kept in ``file``; None when it does not read as them (then they are found again)."""
    try:
        pairs = json.loads(file.read_text(encoding="utf-8"))
        return {int(r): str(rid) for r, rid in pairs}
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        return None


# ---------------------------------------------------------------------------- unique ids


def line_id(line: str):
    """The id of a meta line: read alone when the line begins with it (as ``triclip embed`` writes them: a
    third of the time of the whole line), else from the whole line."""
    if line.startswith(_ID_FIRST):
        return _DECODER.raw_decode(line, len(_ID_FIRST))[0]
    return json.loads(line)["id"]


def id_hash(rid) -> int:
    """64 bits of blake2b of an id (a string as its UTF-8 bytes, anything else as its JSON)."""
    data = rid.encode("utf-8", "surrogatepass") if isinstance(rid, str) else json.dumps(rid).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def unique_renames(rows: MetaRows) -> dict[int, str]:
    """``{row: new id}``: what ``unique_ids`` (``key#2``, ``key#3``... for an id an earlier row holds) changes.

    The ids are read once for their hashes (N x 8 bytes); with no two hashes equal no id repeats, and nothing
    else is read. Otherwise the rows of the repeated hashes are replayed in row order with their strings.
    """
    h = np.fromiter((id_hash(rid) for rid in rows.raw(parse=line_id)), np.uint64, count=len(rows))  # (N,)
    s = np.sort(h)  # (N,)
    if not len(s) or not (s[1:] == s[:-1]).any():
        return {}
    del s
    return _replay(rows, h)


def _replay(rows: MetaRows, h: np.ndarray) -> dict[int, str]:
    """``unique_ids`` on the rows whose id hash repeats, and on any row a new ``key#n`` lands on; the other rows
    keep their ids (no other row has their hash), so only their hashes are consulted."""
    order = np.argsort(h, kind="stable")  # (N,) rows by hash
    s = h[order]  # (N,)
    repeated = np.flatnonzero(np.concatenate([[False], s[1:] == s[:-1]]) | np.concatenate([s[:-1] == s[1:], [False]]))
    suspects = np.sort(order[repeated])
    ids = rows.ids_of(suspects)  # row -> id as written, for the rows replayed (and any read later)
    replayed = set(suspects.tolist())

    def original(r: int):
        if r not in ids:
            ids[r] = rows.raw_at(r)["id"]
        return ids[r]

    def holders(rid) -> list[int]:  # rows whose id hashes like rid
        x = np.uint64(id_hash(rid))
        lo, hi = np.searchsorted(s, x, side="left"), np.searchsorted(s, x, side="right")
        return order[lo:hi].tolist()

    def held_before(rid, j: int) -> bool:  # a row before j that keeps its id holds rid
        return any(r < j and r not in replayed and original(r) == rid for r in holders(rid))

    heap, taken, renames = suspects.tolist(), set(), {}
    heapq.heapify(heap)
    while heap:
        j = heapq.heappop(heap)
        base = original(j)
        rid, n = base, 1
        while rid in taken or held_before(rid, j):
            n += 1
            rid = f"{base}#{n}"
        taken.add(rid)
        if rid != base:
            renames[j] = rid
            for r in holders(rid):  # a later row holding the new id is renamed in its turn
                if r > j and r not in replayed and original(r) == rid:
                    replayed.add(r)
                    heapq.heappush(heap, r)
    return renames


def shard_meta_files(emb: str | os.PathLike, num_shards: int) -> list[Path]:
    """The ``meta.jsonl`` of every shard of the embeddings folder ``emb``."""
    from triclip.model.shards import META, shard_name

    return [Path(emb) / shard_name(s) / META for s in range(num_shards)]
