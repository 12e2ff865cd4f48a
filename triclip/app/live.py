"""The live index and its file guard: what one version of an index folder serves, and following ``CURRENT``.

    live = LiveIndex("INDEX", IndexView.of(searcher, "INDEX"), interval=1.0)
    view = live.view()        # one version, used by a request from start to end
    view.files.read(row)      # (bytes, media type) only while the file is the one indexed

A new version behind ``CURRENT`` (``index build --add``, a rebuild, a rollback) is loaded in
the background and swapped in; each request uses one version from start to end. Result
images are served only while the file is the regular file the index recorded
(:class:`ImageFiles`).
"""

from __future__ import annotations

import logging
import mimetypes
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

log = logging.getLogger("triclip.app")

KEPT_VERSIONS = 4  # image tables of this many recent versions answer their own URLs after a swap


@dataclass(frozen=True)
class ImageFiles:
    """The image files of one index version, served only while they are what was indexed.

    A row's file is opened without following a link in its last component (``O_NOFOLLOW``),
    from its folder as resolved when the version was loaded, and served only when the
    opened file is regular and its identity (device, inode, size, mtime_ns) is the one
    the index recorded at build time (meta ``"file"``; for indexes built before that was
    recorded, the identity found when the app loaded the version).
    """

    paths: list[str]  # row -> the path opened (folder resolved at load + file name)
    identity: list[tuple | None]  # row -> (dev, ino, size, mtime_ns); None: never served
    taken_at_load: int = 0  # rows whose identity was taken at load (an index without the build-time record)

    @classmethod
    def of(cls, meta: list[dict]) -> "ImageFiles":
        from triclip.index.manifest import file_identity
        from triclip.index.metafile import LazyMeta

        if isinstance(meta, LazyMeta):  # rows read when asked: no list of N paths either
            return cls(_MetaField(meta, "image"), _MetaField(meta, "file"))

        folders: dict[str, str] = {}
        paths, identity, at_load = [], [], 0
        for row in meta:
            path, recorded = _served_path(row, folders), row.get("file")
            if path and "file" not in row:  # built before identities were recorded: take it now
                recorded, at_load = file_identity(row["image"]), at_load + 1
            paths.append(path)
            identity.append(_identity(recorded) if path else None)
        return cls(paths, identity, at_load)

    def read(self, row: int) -> tuple[bytes | None, str]:
        """``(content, media type)`` of a row's file, or ``(None, why it is refused)``."""
        return self._open(row, read=True)

    def refused(self, row: int) -> str | None:
        """Why the image route would refuse ``row`` now (None: it serves it); opens the file, reads nothing."""
        content, why = self._open(row, read=False)
        return None if content is not None else why

    def _open(self, row: int, read: bool) -> tuple[bytes | None, str]:
        """The checks of ``read`` (and the content when ``read``; else ``b""`` for a servable file)."""
        if not 0 <= row < len(self.paths):
            return None, "no such row"
        path, want = self.paths[row], self.identity[row]
        if want is None:
            return None, "not a regular file when it was indexed"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:  # ELOOP: the last component is a link
            return None, f"cannot open {path} without following links ({err.strerror})"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, f"{path} is not a regular file"
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != want:
                return None, f"{path} is not the file that was indexed (device, inode, size or mtime changed)"
            chunks, left = [], st.st_size if read else 0
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    return None, f"{path} shrank while it was read"
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as err:
            return None, f"cannot read {path} ({err.strerror})"
        finally:
            os.close(fd)
        return b"".join(chunks), mimetypes.guess_type(path)[0] or "application/octet-stream"


class _MetaField(Sequence):
    """Row -> its servable path (``which="image"``: the folder resolved when first asked) or its recorded file
    identity (``"file"``; None where the row records none: such a row is not served), read from the row."""

    def __init__(self, meta, which: str):
        self.meta, self.which = meta, which  # a triclip.index.metafile.LazyMeta; "image" or "file"
        self._folders: dict[str, str] = {}  # folder -> its realpath

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, row: int):
        meta = self.meta[row]
        path = _served_path(meta, self._folders)
        if self.which == "image":
            return path
        return _identity(meta.get("file")) if path else None


def _served_path(row: dict, folders: dict[str, str]) -> str:
    """The path a row's image is opened at: its folder as first resolved (``folders``: folder -> realpath), its
    file name; "" for a row without an absolute image path (never served)."""
    path = row.get("image")
    if not isinstance(path, str) or not os.path.isabs(path):
        return ""
    folder, name = os.path.split(path)
    if folder not in folders:
        folders[folder] = os.path.realpath(folder)
    return os.path.join(folders[folder], name)


def _identity(recorded) -> tuple | None:
    """A recorded file identity (device, inode, size, mtime_ns) as a tuple; None when it is not one."""
    ok = isinstance(recorded, list) and len(recorded) == 4 and all(isinstance(x, int) for x in recorded)
    return tuple(recorded) if ok else None


@dataclass(frozen=True)
class IndexView:
    """One loaded index version and what the app derives from it; never changed once made."""

    searcher: Any  # triclip.index.search.Searcher over this version
    version: str  # its folder name, e.g. "v000003"
    files: ImageFiles  # row -> servable image file
    rows: Mapping  # id -> row (triclip.index.metafile.id_rows)
    recall: dict  # m -> t2i recall@10 measured at m (or None)
    curves: dict | None  # the version's curves.json (triclip.index.sources._curves), None when it has none

    @classmethod
    def of(cls, searcher, index_dir) -> "IndexView":
        from triclip.index.manifest import read_curves
        from triclip.index.metafile import id_rows

        manifest, meta = searcher.manifest, searcher.contents.meta
        version = searcher.contents.version or "?"
        recall = {int(m): v for m, v in (manifest.get("recall") or {}).items()}
        if getattr(searcher, "remote", False):  # a Milvus collection: rows looked up when asked (milvus_search)
            paths, identity, rows, curves = searcher.view_parts()
            return cls(searcher, version, ImageFiles(paths, identity), rows, recall, curves)
        files = ImageFiles.of(meta)
        if "files" not in manifest:
            log.warning(
                "index %s %s records no size or fingerprint of its files (built before they were recorded): they are"
                " checked by kind, shape, count and codec only; rebuild the index to have every file vouched for",
                index_dir, version,
            )
        if files.taken_at_load:
            log.warning(
                "index %s %s records no file identities for %d images (built before they were recorded): using the"
                " identity found now (device, inode, size, mtime); rebuild the index to record it at build time",
                index_dir, version, files.taken_at_load,
            )
        return cls(searcher, version, files, id_rows(meta), recall,
                   read_curves(index_dir, searcher.contents.version, manifest.get("files")))

    @property
    def dims(self) -> list[int]:
        return list(self.searcher.dims)

    @property
    def budgets(self) -> dict[int, dict]:
        """Byte budget -> the manifest's entry for its codes (``index build --bytes``): spec, recall, index_bytes."""
        return {int(b): e for b, e in (self.searcher.manifest.get("budgets") or {}).items()}

    @property
    def dim(self) -> int:
        """The largest m searched (D for an index folder; a Milvus collection's m, which a budget may make smaller)."""
        return int(self.searcher.dims[-1])


class LiveIndex:
    """The version an app serves, following the index folder's ``CURRENT``.

    :meth:`view` returns the current :class:`IndexView` (a request keeps the one it got
    until it ends); at most every ``interval`` seconds it stats ``CURRENT`` and, when it
    changed, loads the new version in a background thread (the same run: the loaded
    model is reused, :meth:`triclip.index.search.Searcher.with_contents`), then swaps the
    reference. Requests keep being answered by the old version meanwhile; it is freed
    when the last request holding it ends.

    A new version is served only once every file of it passed its checks, the codes of
    every byte budget included (read now, in the background: a search reads them only
    on first use); otherwise the loaded version stays, and the failure is logged.
    ``listeners`` are called with each view swapped in (the page's API choices follow it).
    """

    def __init__(self, index_dir, view: IndexView, interval: float = 1.0, run=None, device=None):
        self.root = Path(index_dir)
        self.interval = interval  # seconds between checks (0: never)
        self.run, self.device = run, device  # for a version built with another run
        self._view = view
        self._stamp = self._current_stamp()
        self._checked = time.monotonic()
        self._lock = threading.Lock()  # one check / reload at a time
        self._loading = False
        self.files_of: OrderedDict[str, ImageFiles] = OrderedDict([(view.version, view.files)])  # recent versions
        self.swaps = 0  # versions swapped in since start
        self.listeners: list = []  # called with each new IndexView once it is served (from the loading thread)

    def view(self) -> IndexView:
        if self.interval > 0 and time.monotonic() - self._checked >= self.interval and not self._loading:
            with self._lock:
                if time.monotonic() - self._checked >= self.interval and not self._loading:
                    self._checked = time.monotonic()
                    stamp = self._current_stamp()
                    if stamp != self._stamp:
                        self._loading = True
                        threading.Thread(target=self._reload, args=(stamp,), name="triclip-reload", daemon=True).start()
        return self._view

    def _current_stamp(self):
        try:
            st = os.stat(self.root / "CURRENT")
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size  # CURRENT is replaced (a new inode) by every writer

    def reload(self) -> bool:
        """Load the live version now if it is not the one served; True when a new one was swapped in."""
        from triclip.index.search import Searcher
        from triclip.index.store import load_contents

        old = self._view
        contents = load_contents(self.root)
        if contents.version == old.version:
            return False
        contents.codes.load_all()  # every budget's codes checked before the version is served (UserError)
        contents.text_codes.load_all()
        if contents.manifest.get("fingerprint") == old.searcher.manifest.get("fingerprint"):
            searcher = old.searcher.with_contents(contents, self.root)  # the same run: keep the loaded model
        else:
            searcher = Searcher.load(self.root, run=self.run, device=self.device)
            searcher.use_text_export()  # as serve() does for the first version
        view = IndexView.of(searcher, self.root)
        self.files_of[view.version] = view.files
        while len(self.files_of) > KEPT_VERSIONS:
            self.files_of.popitem(last=False)
        self._view = view  # one reference swap: a request has the old view or the new one, never a mix
        self.swaps += 1
        log.warning(
            "now serving %s version %s: %d images (was %s)", self.root, view.version, len(searcher), old.version
        )
        for listener in self.listeners:
            try:
                listener(view)
            except Exception:  # noqa: BLE001 (the version is served; a listener's failure is logged only)
                log.exception("after swapping in %s", view.version)
        return True

    def _reload(self, stamp) -> None:
        try:
            self.reload()
        except Exception as err:  # noqa: BLE001 (keep serving the loaded version)
            log.warning("keeping version %s of %s: the new one did not load (%s)", self._view.version, self.root, err)
        finally:
            self._stamp = stamp  # a version that failed is not retried until CURRENT changes again
            self._loading = False
