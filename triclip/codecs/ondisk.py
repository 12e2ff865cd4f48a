"""FAISS's on-disk inverted lists (``faiss.OnDiskInvertedLists``, as in ``faiss.contrib.ondisk``) and atomic
writes of an index: what the codes with inverted lists (``triclip.codecs.ivf``) and the per-m float indexes
(``triclip.index.faiss_index``) share. The lists live in a ``.ivfdata`` file, memory-mapped read-only; FAISS
prints a line (C ``printf``) when it resizes or relocates one, which :func:`quiet_stdout` silences (``--json``
output goes to stdout)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from pathlib import Path

import faiss


def save(index: faiss.Index, path: str | os.PathLike) -> None:
    """Write a CPU index atomically: a temporary file in the same folder, then ``os.replace``."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".faiss", dir=folder)
    os.close(fd)
    try:
        write_index(index, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_index(index, path: str | os.PathLike, binary: bool = False) -> None:
    """``faiss.write_index`` (``write_index_binary``) through a Python file, so that a write that fails (a full
    disk) raises OSError: FAISS's own file writer ignores a failed final flush and leaves a truncated file."""
    with open(path, "wb") as f:
        writer = faiss.PyCallbackIOWriter(f.write)
        (faiss.write_index_binary if binary else faiss.write_index)(index, writer)
        del writer


def ivf_or_none(index: faiss.Index):
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def on_disk_lists(index: faiss.Index):
    """The ``faiss.OnDiskInvertedLists`` of an IVF index whose lists are on disk, else None."""
    ivf = ivf_or_none(index)
    if ivf is None:
        return None
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    return lists if isinstance(lists, faiss.OnDiskInvertedLists) else None


def is_on_disk(index: faiss.Index) -> bool:
    return on_disk_lists(index) is not None


def ivf_list_bytes(index: faiss.Index, n: int) -> int | None:
    """Bytes the inverted lists of IVF ``index`` take with ``n`` vectors (codes + int64 ids); None: not IVF."""
    ivf = ivf_or_none(index)
    return None if ivf is None else int(n) * (int(ivf.code_size) + 8)


def merge_on_disk(trained: faiss.Index, part_files: list, counts: list[int], ivfdata: str | os.PathLike) -> faiss.Index:
    """One index whose lists are the concatenation of the parts' lists, written to ``ivfdata``.

    ``faiss.contrib.ondisk.merge_ondisk``, with checks: each part (a copy of ``trained``
    holding ``counts[s]`` vectors, saved with :func:`save`) is memory-mapped
    (``IO_FLAG_MMAP``), not loaded, and its ids are kept as they are (``shift_ids`` off):
    the parts must already carry their global ids (``add_with_ids``), so merging in
    any order gives the same rows. Within each list the parts' entries follow in part
    order, as successive ``IndexIVF.merge_from`` calls would put them.

    Returns:
        A copy of ``trained`` whose lists are a ``faiss.OnDiskInvertedLists`` on ``ivfdata``.
    """
    merged = faiss.clone_index(trained)
    target = faiss.extract_index_ivf(merged)
    if merged.ntotal:
        raise ValueError("merge_on_disk needs an empty trained index")
    parts, vector = [], faiss.InvertedListsPtrVector()
    for file, count in zip(part_files, counts, strict=True):
        part = faiss.read_index(os.fspath(file), faiss.IO_FLAG_MMAP)
        if part.ntotal != count:
            raise ValueError(f"part {file} holds {part.ntotal} vectors, expected {count}")
        ivf = faiss.extract_index_ivf(part)
        if ivf.nlist != target.nlist or ivf.code_size != target.code_size:
            raise ValueError(f"part {file} is not a copy of the trained index")
        parts.append(part)  # keeps its lists alive until the merge is done
        vector.push_back(ivf.invlists)
    lists = faiss.OnDiskInvertedLists(target.nlist, target.code_size, os.fspath(ivfdata))
    with quiet_stdout():
        ntotal = lists.merge_from_multiple(vector.data(), vector.size(), False)
    if ntotal != sum(counts):
        raise ValueError(f"the on-disk merge holds {ntotal} vectors, expected {sum(counts)}")
    target.replace_invlists(lists, True)  # the index owns the lists now
    lists.this.disown()
    target.ntotal = merged.ntotal = ntotal  # a wrapper (e.g. a pre-transform) counts its inner index's vectors
    return merged


def relocate_lists(index: faiss.Index, name: str) -> None:
    """Record ``name`` (a bare file name) as the lists file of an on-disk index before :func:`save`.

    The mapping stays open; only what is written changes, so no absolute path of a
    temporary folder ends up in the file (reading looks beside the ``.faiss`` file anyway).
    """
    lists = on_disk_lists(index)
    if lists is None:
        raise ValueError("not an on-disk index")
    lists.filename = Path(name).name


_STDOUT_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet_stdout():
    """Send what C code prints to file descriptor 1 meanwhile to /dev/null (one thread at a time)."""
    libc = ctypes.CDLL(None)
    with _STDOUT_LOCK:
        sys.stdout.flush()
        libc.fflush(None)
        saved = os.dup(1)
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 1)
            yield
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            os.close(null)
