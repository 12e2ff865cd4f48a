"""What a version's manifest vouches for: one record per file, checked when the file is read.

The manifest's ``files`` maps each file of the version (all but the manifest itself) to
``{"size", "sampled_sha256"}``, and for the codes of a byte budget also what the codec is:
``{"codec": CodecSpec.to_json(), "count", "dim"}``. :func:`records_for` writes them once the
staged files are complete; :func:`open_checked` and :func:`verdict` check a file before it
is read (``triclip.index.store``).

The fingerprint, ``sampled_sha256``: the sha256 of the scheme's name, the file's size and
some of its bytes: the whole file up to :data:`WHOLE_MAX`, else its first and last
:data:`EDGE` bytes and :data:`BLOCKS` blocks of :data:`BLOCK` bytes evenly spaced between
(about 256 KiB read, whatever the size). A full sha256 of a 100M-vector file (~100 GB at
D = 256) would read it all at every open; this reads a fixed amount, from the page cache
for a file just used. It catches what was seen served in place of a version's own files:

- two files swapped within a version, or a file of another index copied in (same codec,
  same count and width): different sizes, or different codebooks / vectors in the sampled
  head, middle and tail;
- truncation or growth: the size is hashed, and compared first;
- a version's file replaced by a rebuild of the same index with another seed or data.

It does not catch a change confined to bytes between the samples (a flipped bit in the
middle of a large codes array, a row of vectors rewritten in place): the file keeps its
size and sampled bytes. It is a check that the files are the ones written, not a defence
against someone who forges files to match (the sampled offsets are fixed). The records
are checked when a file is opened; a file changed while it is read is not seen.

A version written before these records (no ``files`` in its manifest) is still read,
with the checks the rest of the manifest allows: the codes' spec as read from the file
against the manifest's ``budgets[B]["spec"]``, their count and width; a FAISS index's
count and dimension; the vectors' shape; and the kind of each file (a directory, a
FIFO, an unreadable file are named as such). Swapped files of the same spec, count and
width go unseen there: rebuild such an index to have it vouched for.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

from triclip.core.errors import UserError

SCHEME = "sampled-sha256-1"  # the fingerprint's definition; hashed first, so another scheme never matches
WHOLE_MAX = 1 << 20  # files up to this size are hashed whole
EDGE = 64 << 10  # bytes hashed at each end of a larger file
BLOCKS = 32  # blocks hashed between the two ends, evenly spaced
BLOCK = 4 << 10  # bytes per block
FILES = "files"  # the manifest's key
KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket",
         stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}  # fmt: skip


class Unreadable(UserError):
    """A file the process may not read (permissions): the index is not damaged, it is closed to this user."""


# ---------------------------------------------------------------------------- the fingerprint


def sampled_sha256(fd: int, size: int) -> str:
    """The fingerprint of the open file ``fd`` of ``size`` bytes (see the module docstring)."""
    digest = hashlib.sha256(f"{SCHEME} {size}\n".encode())
    for offset, length in spans(size):
        digest.update(_read_at(fd, offset, length))
    return digest.hexdigest()


def spans(size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the bytes hashed in a file of ``size`` bytes, in order."""
    if size <= WHOLE_MAX:
        return [(0, size)]
    step = (size - 2 * EDGE - BLOCK) / (BLOCKS - 1)
    middle = [(EDGE + int(i * step), BLOCK) for i in range(BLOCKS)]
    return [(0, EDGE), *middle, (size - EDGE, EDGE)]


def _read_at(fd: int, offset: int, length: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = os.pread(fd, min(length, 1 << 20), offset)
        if not chunk:
            raise OSError(errno.EIO, "the file shrank while it was read")
        chunks.append(chunk)
        offset, length = offset + len(chunk), length - len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------- writing the records


def record(path: str | os.PathLike, **what) -> dict:
    """The record of one written file: its size, its fingerprint and ``what`` it is (codes: codec, count, dim)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        return {"size": size, "sampled_sha256": sampled_sha256(fd, size), **what}
    finally:
        os.close(fd)


def records_for(folder: Path, skip: str, codecs: dict) -> dict:
    """The manifest's ``files``: a record for every file in ``folder`` but ``skip`` (the manifest);
    ``codecs``: file name -> the codec written there (its spec, count and width are recorded too)."""
    out = {}
    for path in sorted(folder.iterdir()):
        if path.name == skip:
            continue
        codec = codecs.get(path.name)
        what = {} if codec is None else {"codec": codec.spec.to_json(), "count": len(codec), "dim": int(codec.dim)}
        out[path.name] = record(path, **what)
    return out


# ---------------------------------------------------------------------------- checking


def check_records(records, folder: Path, damaged) -> dict | None:
    """The manifest's ``files`` checked for shape (None: a version written before them); ``damaged(what)``
    makes the error for a garbled table."""
    if records is None:
        return None
    fine = isinstance(records, dict) and all(
        isinstance(name, str) and isinstance(r, dict) and isinstance(r.get("size"), int)
        and isinstance(r.get("sampled_sha256"), str) for name, r in records.items()
    )  # fmt: skip
    if not fine:
        raise damaged(f"the manifest garbles {FILES} (each file's size and sampled sha256)")
    return records


def open_checked(path: Path, folder: Path) -> int:
    """A read-only descriptor of the regular file ``path``.

    Raises:
        FileNotFoundError: there is nothing at ``path``.
        Unreadable: it may not be read (permissions).
        UserError: it is a directory, a FIFO, a device or a socket, named as such.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, unread
    except FileNotFoundError:
        raise
    except PermissionError:
        raise Unreadable(f"index {folder}: cannot read {path.name}: permission denied ({_mode(path)});"
                         " give this user read access to it") from None
    except OSError as err:
        raise UserError(f"index {folder}: cannot open {path.name}: {err.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise UserError(f"index {folder}: {path.name} is {kind}, not the file the index wrote;"
                        " put that file back or rebuild the index with triclip index build")
    return fd


def verdict(fd: int, name: str, records: dict | None) -> str | None:
    """Why the open file ``name`` is not the one the manifest records (None: it is, or no records to check)."""
    if records is None:
        return None
    want = records.get(name)
    if want is None:
        return f"the manifest has no record of {name}"
    size = os.fstat(fd).st_size
    if size != want["size"]:
        return f"{name} is {size:,} bytes, the manifest records {want['size']:,} (truncated, grown or another file)"
    if sampled_sha256(fd, size) != want["sampled_sha256"]:
        return f"{name} is not the file this version wrote (same size, its sampled sha256 differs from the manifest's)"
    return None


def check_file(path: Path, folder: Path, records: dict | None) -> str | None:
    """:func:`open_checked` then :func:`verdict` on ``path``; the descriptor is closed again."""
    fd = open_checked(path, folder)
    try:
        return verdict(fd, path.name, records)
    except OSError as err:
        raise UserError(f"index {folder}: cannot read {path.name}: {err.strerror}") from None
    finally:
        os.close(fd)


def refused(folder: Path, why: str) -> UserError:
    """The one line for a file that is not what the manifest records."""
    return UserError(f"index {folder}: {why}: rebuild the index with triclip index build")


def _mode(path: Path) -> str:
    try:
        return f"mode {stat.S_IMODE(os.stat(path).st_mode):03o}"
    except OSError:
        return "mode unknown"
