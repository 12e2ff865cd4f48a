"""The codes of a version's byte budgets, each read and checked on the first search of its budget.

    codes = LazyCodes({8: CodeFile(folder / "image.b8.codec", spec, count, dim, folder, records)})
    codes[8]          # the checked codec (read now, once), or UserError naming the file and what it holds
    8 in codes        # no read: the budgets the manifest names
    codes.load_all()  # read every budget now (the app, before it serves a new version)

A bad, foreign or unreadable codes file blocks its own budget only (or the budgets that
keep one code in one file): the float indexes and the other budgets still answer. Each
file is opened when the version is opened (its descriptor keeps the version's file
readable after a writer replaced the version), and read through that descriptor on first
use. A file is read by one thread while others wait for it; the other budgets are not
held up. A refusal is kept (the version does not change), except a permission error,
tried again on the next use.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from triclip.core.errors import UserError
from triclip.index import filecheck


@dataclass
class CodeFile:
    """One budget's codes file and what the manifest says it holds."""

    path: Path  # the file in the version folder
    spec: dict  # the manifest's budgets[B]["spec"] (or ["text"]["spec"]): CodecSpec.to_json()
    count: int  # vectors it must hold (the version's images, or captions)
    dim: int  # their width D
    folder: Path  # the version folder (for messages)
    records: dict | None  # the manifest's files (None: a version written before them)
    fd: int | None = None  # opened with the version; None when opening failed (error) or once read
    error: BaseException | None = None  # why it could not be opened (raised on first use)

    def open(self) -> None:
        """Take a descriptor now; a missing, unreadable or non-regular file is kept as the error of first use
        (FileNotFoundError when the whole version folder is gone)."""
        try:
            self.fd = filecheck.open_checked(self.path, self.folder)
        except FileNotFoundError:
            if not self.folder.is_dir():
                raise  # a writer removed the version meanwhile: the reader reads the new one
            self.error = UserError(f"index {self.folder}: {self.path.name} is missing:"
                                   " rebuild the index with triclip index build")
        except UserError as err:
            self.error = err

    def read(self):
        """The codec, checked against the manifest; UserError (one line) otherwise."""
        from triclip import codecs

        if isinstance(self.error, filecheck.Unreadable):  # its permissions may have been fixed since
            self.error = None
            self.open()
        if self.error is not None:
            raise type(self.error)(str(self.error))
        lists = self.folder / f"{self.path.name}.ivfdata"  # an inverted-lists code's lists on disk, if any
        try:
            why = filecheck.verdict(self.fd, self.path.name, self.records)
            if lists.exists():  # FAISS reads the lists beside the file it opens: open it by its own path
                why = why or filecheck.check_file(lists, self.folder, self.records)
                codec = codecs.load(self.path, self.dim)
                why = why or _lists_short(codec, lists)
            else:  # the very file checked above (a swap meanwhile changes nothing)
                codec = codecs.load(f"/proc/self/fd/{self.fd}" if os.path.exists("/proc/self/fd") else self.path, self.dim)
        except OSError as err:
            raise UserError(f"index {self.folder}: cannot read {self.path.name}: {err.strerror}") from None
        except UserError:
            raise filecheck.refused(self.folder, why or f"{self.path.name} is not a readable codes file") from None
        held, said = (codec.spec.to_json(), len(codec), codec.dim), (self.spec, self.count, self.dim)
        if _key(*held) != _key(*said):
            raise UserError(f"index {self.folder}: {self.path.name} holds {_describe(*held, other=said)}, the manifest"
                            f" says {_describe(*said, other=held)}: rebuild the index with triclip index build")
        if why is None and self.records is not None:
            why = _record_disagrees(self.records.get(self.path.name) or {}, codec, self.path.name)
        if why is not None:
            raise filecheck.refused(self.folder, f"{why}; it holds {_describe(*held)}")
        return codec

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class LazyCodes(MutableMapping):
    """Budget -> codec, each read on first access (:class:`CodeFile`); thread-safe. Budgets given the same
    :class:`CodeFile` (a code kept by several budgets, in one file) share its one read and its codec. Setting a
    key stores a codec as it is (a build's own codes)."""

    def __init__(self, files: dict[int, CodeFile]):
        self._files = dict(files)
        self._loaded: dict = {}  # budget -> codec
        self._read: dict[int, object] = {}  # id(CodeFile) -> its codec, for every budget that names it
        self._failed: dict[int, str] = {}  # id(CodeFile) -> why it was refused
        self._locks = {id(file): threading.Lock() for file in files.values()}
        for file in self._unique():
            file.open()
        self._closer = weakref.finalize(self, _close_all, self._unique())

    def _unique(self) -> list[CodeFile]:
        return distinct(f for f in self._files.values() if f is not None)

    def __getitem__(self, key):
        try:
            return self._loaded[key]
        except KeyError:
            pass
        file = self._files.get(key)
        if file is None:
            raise KeyError(key)
        with self._locks[id(file)]:
            if id(file) not in self._read:
                if id(file) in self._failed:
                    raise UserError(self._failed[id(file)])
                try:
                    self._read[id(file)] = file.read()
                except filecheck.Unreadable:
                    raise  # permissions may be fixed: read again next time
                except UserError as err:
                    self._failed[id(file)] = str(err)
                    file.close()
                    raise
                file.close()
            self._loaded[key] = self._read[id(file)]
            return self._loaded[key]

    def __setitem__(self, key, codec) -> None:
        self._loaded[key] = codec
        self._files.setdefault(key, None)

    def __delitem__(self, key) -> None:
        file = self._files.pop(key)
        if file is not None and all(f is not file for f in self._files.values()):  # no other budget names it
            file.close()
        self._loaded.pop(key, None)

    def __iter__(self):
        return iter(sorted(self._files))

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key) -> bool:
        return key in self._files

    def load_all(self) -> None:
        """Read every budget now; raises the first refusal."""
        for key in self:
            self[key]


def _lists_short(codec, lists: Path) -> str | None:
    """Why the memory-mapped lists file cannot serve ``codec`` (shorter than FAISS maps: a read past its end is
    a SIGBUS), or None."""
    from triclip.codecs import ondisk

    mapped = ondisk.on_disk_lists(codec.index)
    if mapped is not None and lists.stat().st_size < mapped.totsize:
        return f"{lists.name} is truncated"
    return None


def distinct(objects) -> list:
    """Each object once, by identity, in order (budgets that keep one code hold one CodeFile, one codec)."""
    return list({id(o): o for o in objects}.values())


def _close_all(files: list) -> None:
    for file in files:
        if file is not None:
            file.close()


def _key(spec, count, dim) -> str:
    """What a codes file holds, comparable: its spec (normalised), count and width."""
    return json.dumps([spec, count, dim], sort_keys=True, default=str)


def _describe(spec, count, dim, other=None) -> str:
    """What a codes file holds in words, e.g. ``int8 m=8 (8 B)``; with its count and width (``40 vectors of width
    32``) unless ``other`` (what it is compared with) has the same; two mixed codes of one label differ in their
    bit widths: said so."""
    from triclip.codecs import CodecSpec

    try:
        parsed = CodecSpec.from_json(spec)
        label = parsed.label() + ("" if parsed.codec == "mixed" else f" ({parsed.bytes_per_vector} B)")
    except (UserError, AttributeError, KeyError, TypeError):  # a garbled spec in the manifest
        return f"an unknown code {json.dumps(spec, sort_keys=True, default=str)[:80]}"
    theirs = other[0] if other is not None and isinstance(other[0], dict) else {}
    if parsed.codec == "mixed" and other is not None and theirs.get("params") != spec.get("params"):
        label += " (its own bit widths)"
    if other is None or (count, dim) != tuple(other[1:]):
        label += f", {count} vectors of width {dim}"
    return label


def _record_disagrees(want: dict, codec, name: str) -> str | None:
    """A codes file whose bytes match its record, yet whose record says another code (a hand-edited manifest)."""
    if "codec" not in want:
        return None
    if _key(want["codec"], want.get("count"), want.get("dim")) != _key(codec.spec.to_json(), len(codec), codec.dim):
        return f"{name} does not hold the code its record names"
    return None
