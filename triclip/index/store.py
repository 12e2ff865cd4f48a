"""The index folder: versions behind an atomic pointer, one writer at a time, checked reads.

    INDEX/CURRENT                 name of the live version, e.g. "v000003" (replaced atomically)
    INDEX/.lock                   writers hold an exclusive ``fcntl.flock`` on it
    INDEX/v000003/manifest.json   run, fingerprint, transform, dims, counts, ... (written last)
    INDEX/v000003/meta.jsonl      one line per image row: {"id", "image", "captions", "label"}
    INDEX/v000003/meta.offsets.npy, meta.idhash.npy, meta.idrow.npy  each line's byte offset, the ids' hashes and
                                  their rows: the rows are read when asked (``triclip.index.metafile``)
    INDEX/v000003/vectors.npy     (N, D) float32 (or float16, or uint8 sq8 codes whose ranges the manifest's
                                  ``vectors_sq8`` holds: its ``vectors_dtype``): the full-D compact vectors (unit rows)
    INDEX/v000003/image.m16.faiss one FAISS index per m over the re-normalised first m dims
    INDEX/v000003/text_vectors.npy, text_rows.npy, text.m16.faiss ...   captions, optional
    INDEX/v000003/image.m64.ivfdata  the inverted lists of an IVF index kept on disk (optional)
    INDEX/v000003/image.b16.codec the image codes of 16 bytes per vector (``index build --bytes``; ``triclip.codecs``),
                                  named by the manifest's ``budgets`` (a budget keeping a smaller one's very code
                                  names that file: one file per code); with codes the float vectors are memory-mapped
    INDEX/v000003/text.b16.codec  the caption codes of the same budget (``budgets[B]["text"]``), with captions
    INDEX/v000003/image.b16.codec.ivfdata  the inverted lists of a budget's codes kept on disk (``budgets[B]["lists"]``)

An index on disk (``triclip.index.build`` beyond the memory budget) is an IVF index
whose lists are in ``{kind}.m{m}.ivfdata`` beside its ``.faiss`` file; the manifest names
them (``on_disk``: {"image": {"64": "image.m64.ivfdata"}, "text": {...}}). They are read
memory-mapped (``triclip.index.faiss_index.load(on_disk=True)``: looked up beside the ``.faiss``
file, so the folder can be moved), and so are the vectors of such a version. Such a
version cannot be extended in place (``--add``): it is rebuilt from the embeddings.

Every file of a version is vouched for by its manifest (``files``: size, a sampled sha256, and for
codes the codec, count and width; :mod:`triclip.index.filecheck`) and checked before it is read: a
file swapped in from another budget, version or index, truncated, a directory, a FIFO or closed to
this user is refused in one line naming it. The codes of the byte budgets are opened with the
version and read on first use (:mod:`triclip.index.lazy_codes`), so a bad codes file refuses its
own budget only.

A writer (:func:`writer_lock`) stages a complete version in ``INDEX/.tmp-*``, renames it
to the next ``vNNNNNN``, then points ``CURRENT`` at it (temporary file + ``os.replace``)
and removes the other versions; a replacing build (``--overwrite``) keeps the version it
replaced, so :func:`rollback` (``triclip index rollback INDEX``) can point back at it. A reader reads ``CURRENT`` once and loads that folder,
so it sees one consistent version; if a writer removed it meanwhile, it reads again.

Recovery after a crash: a reader never writes or removes anything; a ``CURRENT`` that is
missing or names a missing or incomplete folder reads the newest complete version (one with a
manifest). The next writer, holding the lock, removes staging folders and incomplete versions
and re-points such a ``CURRENT``; a complete version is removed only when a writer's new
version replaces it (of the older versions only the newest, the rollback, is kept). The first layout (format 1: ``manifest.json`` at the top, one m) is refused
with a "rebuild" message.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import faiss
import numpy as np

from triclip.codecs import ondisk
from triclip.index import faiss_index as fi
from triclip.index import filecheck, metafile
from triclip.index.lazy_codes import CodeFile, LazyCodes
from triclip.index.vectors import STORED_AS, VECTOR_BYTES, SQ8Rows, sq8_ranges, stored_name
from triclip.core.errors import UserError
from triclip.core.io import LOCK, MARK, current_umask, fix_mode, folder_lock, read_mark, write_errors, write_mark
from triclip.index.versions import (  # noqa: F401 (re-exported: where the live version is)
    CURRENT,
    MANIFEST,
    TMP_PREFIX,
    _complete,
    _read_pointer,
    _versions,
    current_version,
    is_index_dir,
)

META = "meta.jsonl"
VECTORS = "vectors.npy"
TEXT_VECTORS = "text_vectors.npy"
TEXT_ROWS = "text_rows.npy"
FORMAT = 2  # manifest["format"]; 1 was one m per folder, manifest at the top
OLD_FILES = ("manifest.json", "index.faiss", "text.faiss", "text_rows.npy", "meta.jsonl")  # format 1
T = TypeVar("T")  # what a read of the live version returns
_NPY_LOCK = threading.Lock()  # np.load parses a header with ast.literal_eval, which CPython 3.11.7 breaks when
# two threads run it at once ("AST constructor recursion depth mismatch"): readers of versions take turns
READ_TRIES = 5  # a reader re-reads CURRENT this often when a writer removed its version meanwhile


def code_name(budget: int, kind: str = "image") -> str:
    """The file of the ``kind`` ("image" / "text") codes of ``budget`` bytes per vector (``index build --bytes``)."""
    return f"{kind}.b{budget}.codec"


def image_index_name(m: int) -> str:
    return f"image.m{m}.faiss"


def text_index_name(m: int) -> str:
    return f"text.m{m}.faiss"


def ivfdata_name(kind: str, m: int) -> str:
    """The lists file of the on-disk ``kind`` ("image" / "text") index at m."""
    return f"{kind}.m{m}.ivfdata"


@dataclass
class IndexContents:
    """One version of an index folder, in memory."""

    manifest: dict  # see triclip/index/sources.py for the keys
    meta: Sequence[dict]  # {"id", "image", "captions", "label"} per image row (a build may stream them: MetaRows)
    vectors: np.ndarray  # (N, D) float32 full-D compact vectors, unit rows
    image_indexes: dict[int, faiss.Index]  # m -> index over normalize(vectors[:, :m]), row i = meta[i]
    text_vectors: np.ndarray | None = None  # (T, D) caption vectors, or None without a caption index
    text_rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # (T, 2) image row, caption no.
    text_indexes: dict[int, faiss.Index] = field(default_factory=dict)  # m -> caption index (empty: none)
    codes: dict = field(default_factory=dict)  # budget (bytes per vector) -> triclip.codecs.Codec over the image rows
    text_codes: dict = field(default_factory=dict)  # budget -> triclip.codecs.Codec over the caption rows
    version: str | None = None  # the folder it was read from, e.g. "v000003"
    files: dict[str, Path] = field(default_factory=dict)  # name in the version -> a file written elsewhere (same
    # filesystem) that the writer moves in: the .ivfdata lists of on-disk indexes, vectors written in pieces

    @property
    def dims(self) -> list[int]:
        return sorted(self.image_indexes)


# ---------------------------------------------------------------------------- locating versions


def is_empty_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds nothing but what a failed writer may leave (the lock, its mark, staging folders)."""
    return all(p.name in (LOCK, MARK) or p.name.startswith(TMP_PREFIX) for p in Path(path).iterdir())


# ---------------------------------------------------------------------------- the writer lock


@contextlib.contextmanager
def writer_lock(root: str | os.PathLike, timeout: float = 600.0) -> Iterator[None]:
    """Hold the exclusive writer lock of the index folder ``root`` (``triclip.core.io.folder_lock``).

    Waits up to ``timeout`` seconds for another writer, then raises UserError. On entry
    the folder is marked an index (``triclip.core.io.MARK``) and recovered (:func:`recover`).
    """
    with folder_lock(root, timeout):
        if read_mark(root) is None:
            write_mark(root, "index", done=is_index_dir(root))
        recover(Path(root))
        yield


def recover(root: Path) -> None:
    """Clean up after crashed writers; call only while holding the lock.

    Staging leftovers and version folders without a manifest go, and a ``CURRENT`` that names
    no complete version is pointed at the newest complete one. A complete version (one a
    manifest describes) is never removed here, whatever ``CURRENT`` says: only a writer's new
    version replaces it (:func:`write_version`).
    """
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for name in _versions(root):
        if not _complete(root, name):
            shutil.rmtree(root / name, ignore_errors=True)
    try:
        live = current_version(root)
    except UserError:
        return  # nothing complete yet (or the old format)
    if _read_pointer(root) != live:
        _point_at(root, live)


def previous_version(root: str | os.PathLike, live: str) -> str | None:
    """The newest complete version older than ``live`` (what :func:`rollback` returns to), or None."""
    older = [n for n in _versions(Path(root)) if int(n[1:]) < int(live[1:]) and _complete(Path(root), n)]
    return older[-1] if older else None


def rollback(root: str | os.PathLike, timeout: float = 600.0) -> tuple[str, str]:
    """Point ``CURRENT`` back at the version a replacing build kept; the replacing one is removed.

    Returns:
        ``(removed, live)``: the version dropped and the one now live.

    Raises:
        UserError: no index, or no earlier version kept.
    """
    root = Path(root)
    if not root.is_dir() or not is_index_dir(root):
        raise UserError(f"{root} is not a triclip index")
    with writer_lock(root, timeout):
        live = current_version(root)
        previous = previous_version(root, live)
        if previous is None:
            raise UserError(f"{root} keeps no earlier version to roll back to (only a build with --overwrite keeps one)")
        _point_at(root, previous)
        shutil.rmtree(root / live, ignore_errors=True)
    return live, previous


def _point_at(root: Path, name: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + "current-", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, root / CURRENT)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---------------------------------------------------------------------------- writing


def write_version(root: str | os.PathLike, contents: IndexContents, keep_previous: bool = False) -> str:
    """Stage every file, rename to the next version, point CURRENT at it; hold :func:`writer_lock`.

    ``keep_previous``: keep the version being replaced for one :func:`rollback` (older ones go).
    Without it only the version being replaced goes, so the rollback an ``--overwrite`` kept
    survives the ``--add`` builds after it.

    Returns:
        The new version's folder name.
    """
    root = Path(root).absolute()
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=root))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; a version folder follows the umask
        with write_errors(root):  # a full disk or no permission: one line, not faiss' or numpy's own
            _write_files(tmp, contents)
        for file in tmp.iterdir():  # files made by mkstemp elsewhere and moved in (curves.json, lists) are 0600
            fix_mode(file)
        numbers = [int(n[1:]) for n in _versions(root)]
        pointer = _read_pointer(root)
        name = f"v{max(numbers + [int(pointer[1:]) if pointer else 0]) + 1:06d}"
        os.rename(tmp, root / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _point_at(root, name)
    write_mark(root, "index", done=True)
    kept = pointer if keep_previous else (previous_version(root, pointer) if pointer else None)
    keep = {name, kept if kept and _complete(root, kept) else None}
    for old in _versions(root):
        if old not in keep:
            shutil.rmtree(root / old, ignore_errors=True)
    for old in OLD_FILES:  # a fresh build over a format-1 folder replaces it
        (root / old).unlink(missing_ok=True)
    contents.version = name
    return name


def _write_files(folder: Path, c: IndexContents) -> None:
    on_disk = _move_in(folder, c)
    for m, index in c.image_indexes.items():
        ondisk.write_index(fi.to_cpu(index), folder / image_index_name(m))
    if VECTORS not in c.files:
        np.save(folder / VECTORS, _as_stored(c.vectors))
    if c.text_vectors is not None:
        for m, index in c.text_indexes.items():
            ondisk.write_index(fi.to_cpu(index), folder / text_index_name(m))
        if TEXT_VECTORS not in c.files:
            np.save(folder / TEXT_VECTORS, _as_stored(c.text_vectors))
        np.save(folder / TEXT_ROWS, np.asarray(c.text_rows, dtype=np.int64).reshape(-1, 2))
    written = code_files(c)
    for name, codec in written.items():
        codec.save(folder / name)
    metafile.write_meta(folder, META, c.meta)
    if on_disk:
        c.manifest["on_disk"] = on_disk
    else:
        c.manifest.pop("on_disk", None)
    c.manifest[filecheck.FILES] = filecheck.records_for(folder, MANIFEST, written)  # what each file is (filecheck)
    with open(folder / MANIFEST, "w", encoding="utf-8") as fh:  # last: marks the version complete
        fh.write(json.dumps(c.manifest, indent=1, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def code_files(c: IndexContents) -> dict[str, object]:
    """File name -> the codec written there: each budget's codes in the file its manifest entry names
    (``budgets[B]["file"]``, ``["text"]["file"]``; :func:`code_name` where it names none). Budgets that keep the
    very same code (a smaller budget's, ``budgets.no_worse_than_smaller``) name one file: it is written once."""
    entries = c.manifest.get("budgets") or {}

    def named(budget: int, kind: str) -> str:
        entry = entries.get(str(budget)) or {}
        entry = entry if kind == "image" else entry.get("text") or {}
        return entry.get("file") or code_name(budget, kind)

    written = {}
    for kind, codes in (("image", c.codes), ("text", c.text_codes)):
        for budget, codec in codes.items():
            written.setdefault(named(budget, kind), codec)
    return written


def shared_names(codes: dict, kind: str = "image") -> dict[int, str]:
    """Budget -> the file its codes go in: :func:`code_name` of the smallest budget holding the very same codec
    object (``codes``: budget -> codec; a budget that keeps a smaller budget's code shares its file)."""
    first: dict[int, int] = {}
    for budget in sorted(codes):
        first.setdefault(id(codes[budget]), budget)
    return {budget: code_name(first[id(codes[budget])], kind) for budget in codes}


def _as_stored(vectors) -> np.ndarray:
    """What a vectors file holds: the sq8 codes, or the floats in their own precision (float32 for any other)."""
    if isinstance(vectors, SQ8Rows):
        return np.ascontiguousarray(vectors.codes, dtype=np.uint8)
    return np.ascontiguousarray(vectors, dtype=STORED_AS[stored_name(vectors)])


def _move_in(folder: Path, c: IndexContents) -> dict:
    """Move ``c.files`` into the staging folder; returns the manifest's ``on_disk`` entry ({} when none).

    An on-disk index must come with its lists file in ``c.files``: one read from a live
    version (an ``--add``) would otherwise point at the lists of a version about to be
    removed, or be written to in place, so it is refused.
    """
    on_disk: dict = {}
    for kind, table in (("image", c.image_indexes), ("text", c.text_indexes if c.text_vectors is not None else {})):
        for m, index in table.items():
            if not fi.is_on_disk(index):
                continue
            name = ivfdata_name(kind, m)
            if name not in c.files:
                raise UserError(
                    f"the {kind} index at m={m} keeps its lists on disk and cannot be extended or re-written"
                    " (--add); rebuild it with triclip index build --embeddings"
                )
            fi.relocate_lists(index, name)
            on_disk.setdefault(kind, {})[str(m)] = name
    for name, src in c.files.items():
        if Path(name).name != name:
            raise ValueError(f"IndexContents.files: {name!r} is not a bare file name")
        try:
            os.replace(src, folder / name)  # same filesystem: a rename, however large the file
        except OSError as err:
            if err.errno != errno.EXDEV:
                raise
            shutil.copyfile(src, folder / name)
    return on_disk


# ---------------------------------------------------------------------------- reading


def read_manifest(path: str | os.PathLike) -> dict:
    """The live version's manifest; UserError when there is no index or it is damaged."""
    return load_contents(path, indexes=False).manifest


def load_contents(path: str | os.PathLike, indexes: bool | str = True) -> IndexContents:
    """Read the live version of an index folder, checking that its parts agree.

    Args:
        path: the index folder.
        indexes: also read the FAISS indexes and the byte budgets' codes (False: manifest, meta and vectors only;
            "codes": the codes, not the FAISS indexes per m: what ``search --bytes`` holds).

    Raises:
        UserError: no index, the old format, or a damaged part (named in the message).
    """
    name, contents = read_live(path, lambda folder: _load_version(folder, indexes))
    contents.version = name
    return contents


def read_live(path: str | os.PathLike, read: Callable[[Path], T]) -> tuple[str, T]:
    """The live version's name and ``read(its folder)``, read again from the new live version where a writer
    swapped versions meanwhile; UserError (one line) for no index or a damaged or missing part."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"{root} is not a triclip index (no such folder)")
    for attempt in range(READ_TRIES):
        name = current_version(root)
        try:
            return name, read(root / name)
        except (FileNotFoundError, UserError) as err:
            if attempt + 1 < READ_TRIES and (not (root / name).is_dir() or current_version(root) != name):
                continue  # a writer swapped versions while we read: read the new one
            if isinstance(err, FileNotFoundError):
                raise _damaged(root / name, f"{Path(err.filename or str(err)).name} is missing") from None
            raise
    raise AssertionError("unreachable")


def _damaged(folder: Path, what: str) -> UserError:
    return UserError(f"index {folder} is damaged: {what}; rebuild it with triclip index build")


def _load_version(folder: Path, indexes: bool | str) -> IndexContents:
    """One version, each file checked against its record in the manifest (``triclip.index.filecheck``) before
    it is read; the codes of the byte budgets are only opened here, and read on first use (``lazy_codes``)."""
    manifest = _read_json(folder / MANIFEST, folder)
    dim, dims, count, text_count = _check_manifest(manifest, folder)
    records = filecheck.check_records(manifest.get(filecheck.FILES), folder, lambda what: _damaged(folder, what))
    on_disk = _check_on_disk(manifest, dims, text_count is not None, folder)
    meta = _read_rows(folder, count, records)
    budgets, text_budgets = _check_budgets(manifest, text_count is not None, folder)
    mmap = bool(on_disk) or bool(budgets)  # too big for memory, or codes in memory: the float vectors are mapped
    dtype = manifest.get("vectors_dtype", "float32")  # older versions: float32
    if dtype not in VECTOR_BYTES:
        raise _damaged(folder, f"{MANIFEST} gives the vectors' dtype as {dtype!r}, not one of {sorted(VECTOR_BYTES)}")
    ranges = _sq8_ranges(manifest, dim, text_count is not None, folder) if dtype == "sq8" else {}
    vectors = _read_vectors(folder / VECTORS, (count, dim), folder, records, mmap, dtype, ranges.get("image"))
    contents = IndexContents(manifest, meta, vectors, {})
    if text_count is not None:
        contents.text_vectors = _read_vectors(folder / TEXT_VECTORS, (text_count, dim), folder, records, mmap, dtype,
                                              ranges.get("text"))
        contents.text_rows = _read_text_rows(folder / TEXT_ROWS, text_count, count, folder, records)
    for m in dims:
        lists = on_disk.get(("image", m))
        contents.image_indexes[m] = (
            _read_index(folder / image_index_name(m), m, count, folder, records, lists) if indexes is True else None
        )
        if text_count is not None:
            lists = on_disk.get(("text", m))
            contents.text_indexes[m] = (
                _read_index(folder / text_index_name(m), m, text_count, folder, records, lists) if indexes is True
                else None
            )
    if indexes:
        contents.codes = _lazy_codes(manifest, budgets, "image", count, dim, folder, records)
        contents.text_codes = _lazy_codes(manifest, text_budgets, "text", text_count, dim, folder, records)
    return contents


def _lazy_codes(manifest: dict, budgets: list[int], kind: str, count: int, dim: int, folder: Path,
                records: dict | None) -> LazyCodes:
    """The ``kind`` ("image" / "text") codes of ``budgets``, opened now, read and checked on first use."""
    files, opened = {}, {}  # budgets that name one file share its CodeFile: read once, one codec
    for budget in budgets:
        entry = manifest["budgets"][str(budget)]
        entry = entry if kind == "image" else entry["text"]
        key = (entry["file"], json.dumps(entry.get("spec"), sort_keys=True))  # the same file, said to hold the same
        if key not in opened:
            opened[key] = CodeFile(folder / entry["file"], entry.get("spec"), count, dim, folder, records)
        files[budget] = opened[key]
    return LazyCodes(files)


def _check_budgets(manifest: dict, has_text: bool, folder: Path) -> tuple[list[int], list[int]]:
    """The byte budgets the manifest's ``budgets`` names (``index build --bytes``), ascending: those with
    image codes, and those with caption codes too (``budgets[B]["text"]``; an older index has none)."""
    entry = manifest.get("budgets") or {}

    def fine(b, v) -> bool:  # a budget's file: its own, or a smaller budget's whose code it keeps (shared_names)
        text = v.get("text") if isinstance(v, dict) else None
        return (isinstance(b, str) and b.isdigit() and isinstance(v, dict) and v.get("file") in files(b, "image")
                and (text is None or (has_text and isinstance(text, dict) and text.get("file") in files(b, "text"))))

    def files(b: str, kind: str) -> set[str]:
        return {code_name(int(a), kind) for a in entry if str(a).isdigit() and int(a) <= int(b)}

    if not isinstance(entry, dict) or not all(fine(b, v) for b, v in entry.items()):
        raise _damaged(folder, f"{MANIFEST} garbles budgets (the codes of index build --bytes)")
    return sorted(int(b) for b in entry), sorted(int(b) for b, v in entry.items() if v.get("text") is not None)


def _check_on_disk(manifest: dict, dims: list[int], has_text: bool, folder: Path) -> dict[tuple[str, int], Path]:
    """``{(kind, m): lists file}`` from the manifest's ``on_disk`` (each file checked to exist)."""
    entry = manifest.get("on_disk") or {}
    found = {}
    ok = isinstance(entry, dict) and set(entry) <= ({"image", "text"} if has_text else {"image"})
    for kind, table in entry.items() if ok else ():
        ok = ok and isinstance(table, dict)
        for m, name in table.items() if ok else ():
            ok = ok and m.isdigit() and int(m) in dims and name == ivfdata_name(kind, int(m))
            if ok:
                found[kind, int(m)] = folder / name
    if not ok:
        raise _damaged(folder, f"{MANIFEST} garbles on_disk (the lists files of on-disk indexes)")
    for file in found.values():
        if not os.path.lexists(file):  # anything else there is named by _read_index
            raise FileNotFoundError(file)
    return found


def _read_json(file: Path, folder: Path) -> dict:
    if not file.is_file():
        raise FileNotFoundError(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _damaged(folder, f"cannot read {file.name} ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise _damaged(folder, f"{file.name} is not a JSON object")
    return data


def _check_manifest(manifest: dict, folder: Path) -> tuple[int, list[int], int, int | None]:
    if manifest.get("format") != FORMAT:
        raise UserError(f"index {folder} has format {manifest.get('format')!r}, this triclip reads {FORMAT}; rebuild it")
    dim, dims, count, text_count = (manifest.get(k) for k in ("dim", "dims", "count", "text_count"))
    ok = (
        isinstance(dim, int) and dim >= 1
        and isinstance(dims, list) and dims and all(isinstance(m, int) and 1 <= m <= dim for m in dims)
        and dims == sorted(set(dims)) and dims[-1] == dim
        and isinstance(count, int) and count >= 0
        and (text_count is None or isinstance(text_count, int) and text_count >= 0)
        and isinstance(manifest.get("transform"), dict) and isinstance(manifest.get("fingerprint"), str)
    )  # fmt: skip
    if not ok:
        raise _damaged(folder, f"{MANIFEST} lacks or garbles dim / dims / count / text_count / transform / fingerprint")
    return dim, dims, count, text_count


def _read_rows(folder: Path, count: int, records: dict | None) -> Sequence[dict]:
    """The image rows: read when asked (``triclip.index.metafile``) where the version has the offset and id
    files (its manifest records them, or it records no files and they are there), else read whole."""
    lazy = any(name in records for name in metafile.FILES) if records is not None else all(
        os.path.lexists(folder / name) for name in metafile.FILES)
    if lazy:
        why = filecheck.check_file(folder / META, folder, records)
        if why is not None:
            raise filecheck.refused(folder, why)
        arrays = {name: _read_array(folder / name, folder, records, mmap=True) for name in metafile.FILES}
        for _, why in arrays.values():
            if why is not None:
                raise filecheck.refused(folder, why)
        return metafile.open_meta(folder, META, count, {k: a for k, (a, _) in arrays.items()},
                                  lambda what: _damaged(folder, what))
    meta, why = _read_meta(folder / META, folder, records)
    if len(meta) != count:
        raise _damaged(folder, f"{META} has {len(meta)} rows, the manifest says {count}")
    if why is not None:
        raise filecheck.refused(folder, why)
    return meta


def _read_meta(file: Path, folder: Path, records: dict | None) -> tuple[list[dict], str | None]:
    """The image rows, and why the file is not the one recorded (None: it is; the caller checks the count first)."""
    why = filecheck.check_file(file, folder, records)
    rows = []
    try:
        with open(file, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not (isinstance(row, dict) and isinstance(row.get("id"), str) and isinstance(row.get("captions"), list)):
                    raise ValueError(f"line {n} is not an image row")
                rows.append(row)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise _refused_or_damaged(folder, why, f"cannot read {META} ({str(err).splitlines()[0]})") from None
    return rows, why


def _refused_or_damaged(folder: Path, why: str | None, what: str) -> UserError:
    """A file that did not read as it should: not the file the manifest records (``why``), else damaged."""
    return filecheck.refused(folder, why) if why is not None else _damaged(folder, what)


def _read_array(file: Path, folder: Path, records: dict | None, mmap: bool = False) -> tuple[np.ndarray, str | None]:
    """The array and why the file is not the one recorded (None: it is; the caller checks the shape first)."""
    why = filecheck.check_file(file, folder, records)
    try:
        with _NPY_LOCK:
            return np.load(file, allow_pickle=False, mmap_mode="r" if mmap else None), why
    except (OSError, ValueError, EOFError) as err:
        raise _refused_or_damaged(folder, why, f"cannot read {file.name} ({str(err).splitlines()[0]})") from None


def _read_vectors(file: Path, shape: tuple[int, int], folder: Path, records: dict | None, mmap: bool = False,
                  dtype: str = "float32", ranges: np.ndarray | None = None) -> np.ndarray | SQ8Rows:
    """The full-D vectors, of the manifest's ``dtype`` (sq8: its codes, decoded by ``ranges``); ``mmap``:
    memory-mapped read-only, values not scanned (only shape and dtype)."""
    arr, why = _read_array(file, folder, records, mmap)
    if arr.dtype != np.dtype(STORED_AS[dtype]) or arr.shape != shape:
        raise _damaged(folder, f"{file.name} holds {arr.dtype} {arr.shape}, expected {dtype} {shape}")
    if not mmap and arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise _damaged(folder, f"{file.name} holds NaN or infinity")
    if why is not None:
        raise filecheck.refused(folder, why)
    return arr if ranges is None else SQ8Rows(arr, ranges)


def _sq8_ranges(manifest: dict, dim: int, text: bool, folder: Path) -> dict[str, np.ndarray]:
    """The ranges of each sq8 vectors file ("image", and "text" with captions), checked (``vectors.sq8_ranges``)."""
    try:
        kinds = ("image", "text") if text else ("image",)
        return {kind: sq8_ranges(manifest.get("vectors_sq8"), kind, dim) for kind in kinds}
    except ValueError as err:
        raise _damaged(folder, f"{MANIFEST}'s {err}") from None


def _read_text_rows(file: Path, text_count: int, count: int, folder: Path, records: dict | None) -> np.ndarray:
    """(T, 2) image row and caption number of each caption vector."""
    rows, why = _read_array(file, folder, records)
    if rows.shape != (text_count, 2) or rows.dtype.kind not in "iu" or (len(rows) and (
        rows[:, 0].min() < 0 or rows[:, 0].max() >= count)):
        raise _damaged(folder, f"{TEXT_ROWS} does not match {text_count} captions of {count} images")
    if why is not None:
        raise filecheck.refused(folder, why)
    return rows.astype(np.int64)


def _read_index(file: Path, m: int, count: int, folder: Path, records: dict | None,
                lists: Path | None = None) -> faiss.Index:
    """One FAISS index; ``lists``: its on-disk lists file (memory-mapped, checked to be whole)."""
    why = filecheck.check_file(file, folder, records)
    lists_why = None if lists is None else filecheck.check_file(lists, folder, records)
    try:
        index = fi.load(file, on_disk=lists is not None)
    except ValueError:
        raise _refused_or_damaged(folder, why, f"{file.name} is not a readable FAISS index") from None
    if index.d != m or index.ntotal != count:
        raise _damaged(folder, f"{file.name} holds {index.ntotal} vectors of dimension {index.d}, expected {count} of {m}")
    if lists is not None:
        od = fi.on_disk_lists(index)
        if od is None:
            raise _damaged(folder, f"{file.name} is not an on-disk index, yet the manifest names {lists.name}")
        if lists.stat().st_size < od.totsize:  # reading past the end of a mapped file kills the process (SIGBUS)
            raise _damaged(folder, f"{lists.name} is truncated ({lists.stat().st_size} of {od.totsize} bytes)")
    if why is not None or lists_why is not None:
        raise filecheck.refused(folder, why or lists_why)
    return index
