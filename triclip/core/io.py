"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Temporary files and folders come from :mod:`tempfile`, which makes them private
(0600 / 0700) whatever the user's umask says; every helper here gives them the
mode a plain ``open`` / ``mkdir`` would have (0666 / 0777 less the umask) before
they are renamed into place, so runs and indexes are as readable as any other
file the user writes. Use :func:`temp_dir` instead of ``tempfile.mkdtemp`` for
folders that will be renamed into place.

:func:`claim_output_dir` is the one rule for every command's ``--out``: a folder
that is not empty and not the command's own kind (:func:`folder_kind`) is refused,
its own kind needs ``--overwrite`` (or the command's resume: ``--resume``, ``--add``,
an ``embed`` re-run), and the place must be writable, all before any work is done.

:func:`writing` is the one way every command writes its folder: the claim, then the folder's
lock (:func:`folder_lock`: two writers of one folder exclude each other), then the mark
(:data:`MARK`, ``{"kind": ..., "done": false}``) written FIRST, so that a killed command's folder
is recognised as its own and can be run again; the mark's ``"done": true`` is the LAST file the
command writes. A finished folder that is written again without ``--resume`` / ``--add`` (an
``--overwrite``, or a rerun over an unfinished one) is built beside it (``.NAME.new-*``) and
swapped in by rename at the end, so a kill leaves the old folder whole.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import re
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from triclip.core.errors import UserError, first_line


def current_umask() -> int:
    """The process umask, read without changing it (Linux: /proc), else by setting it back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # not thread-safe, hence only where /proc is missing
    os.umask(mask)
    return mask


def fix_mode(path: str | os.PathLike) -> None:
    """Give a file made by ``tempfile`` the mode a plain ``open`` (or ``mkdir``) would have."""
    full = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, full & ~current_umask())


def temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """``tempfile.mkdtemp`` in ``parent`` with the umask's mode (see the module docstring)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fix_mode(tmp)
    return tmp


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path``.

    Write whatever you like to the yielded path (any library that takes a file
    name); if the block raises, the temporary file is removed and ``path`` is
    left as it was. The file ends with the umask's mode.
    """
    path = Path(path)
    with write_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    try:
        with write_errors(path):
            yield Path(tmp)
            fix_mode(tmp)
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def write_errors(path: str | os.PathLike) -> Iterator[None]:
    """A write of ``path`` that fails for want of space or permission: one true line (UserError).

    Libraries report these in their own ways (safetensors' ``SafetensorError ... No space left on
    device``, faiss' ``RuntimeError ... write error``, numpy's ``OSError: 51200 requested and 19424
    written``): the error's errno, its text, or the disk itself (no space left) tells; anything
    else is raised as it was.
    """
    try:
        yield
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001  any library's error type
        why = _why_write_failed(err, Path(path))
        if why is None:
            raise
        raise UserError(f"{why} while writing {path}") from None


_WRITE_ERRNO = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file too large",
                errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EROFS: "read-only filesystem"}  # fmt: skip


def _why_write_failed(err: Exception, path: Path) -> str | None:
    code = getattr(err, "errno", None)
    if code in _WRITE_ERRNO:
        return _WRITE_ERRNO[code]
    text = str(err)
    for code, why in _WRITE_ERRNO.items():
        if os.strerror(code) in text:
            return why
    return "disk full" if _disk_full(path) else None


def _disk_full(path: Path) -> bool:
    """Whether the filesystem of ``path`` has (about) no space left for this process."""
    folder = path if path.is_dir() else path.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (256 << 10)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_json(path: str | os.PathLike):
    """The JSON value in ``path``; UserError (one line) when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from None


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def swap_dir(new: str | os.PathLike, final: str | os.PathLike) -> None:
    """Put the finished folder ``new`` at ``final`` (replacing what is there).

    Two renames: ``final`` -> ``.NAME.old``, ``new`` -> ``final``. A crash between them
    leaves ``.NAME.old`` whole; :func:`recover_dir` finds it.
    """
    new, final = Path(new), Path(final)
    old = final.parent / f".{final.name}.old"
    if final.exists():
        if old.exists():
            _rmtree(old)
        os.replace(final, old)
    os.replace(new, final)
    if old.exists():
        _rmtree(old)


def recover_dir(final: str | os.PathLike) -> Path:
    """``final``, or the ``.NAME.old`` that :func:`swap_dir` left when a crash came between its renames."""
    final = Path(final)
    old = final.parent / f".{final.name}.old"
    return old if not final.exists() and old.exists() else final


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- output folders

KINDS = ("run", "index", "data", "embeddings", "demo")  # what triclip commands write (train / solve, index build,
# data prepare / split, embed, demo)
_WHAT = {"run": "a run", "index": "an index", "data": "a data set", "embeddings": "embedding shards",
         "demo": "a demo's work folder"}  # fmt: skip
MARK = ".triclip.json"  # {"kind": KIND, "done": bool}: the first file a writer writes, and (done) its last
LOCK = ".lock"  # writers hold an exclusive fcntl.flock on it (triclip/index/store.py's lock too)
_VERSION = re.compile(r"^v\d{6,}$")  # triclip/index/store.py's version folders
_LEFTOVER = re.compile(r"^\.(lock$|tmp-|.*\.tmp(-|$)|.*\.old$|.*\.tmp\.|.*\.new-)")  # what a killed writer leaves


def folder_kind(path: str | os.PathLike) -> str | None:
    """Which triclip command wrote the folder ``path`` (one of :data:`KINDS`), or None.

    Its mark (:data:`MARK`) says so; a folder from a triclip before the mark is recognised
    by what each writes: ``embed`` a manifest of format ``triclip-embeddings/*``;
    ``index build`` a ``CURRENT`` pointer or ``vNNNNNN/manifest.json`` (format 1: ``index.faiss``
    beside a manifest); ``train`` a ``config.json`` whose ``model`` section names a preset (or, damaged, beside
    ``checkpoint/state.json``);
    ``data prepare`` ``train.jsonl`` / ``val.jsonl``.
    """
    root = Path(path)
    mark = read_mark(root)
    if mark is not None:
        return mark["kind"]
    manifest = _json_or_none(root / "manifest.json")
    if isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("triclip-embeddings/"):
        return "embeddings"
    if (root / "CURRENT").is_file() or (manifest is not None and (root / "index.faiss").is_file()):
        return "index"
    with contextlib.suppress(OSError):
        if any(_VERSION.match(p.name) and (p / "manifest.json").is_file() for p in root.iterdir()):
            return "index"
    config = _json_or_none(root / "config.json")
    if isinstance(config, dict) and isinstance(config.get("model"), dict) and "preset" in config["model"]:
        return "run"
    if (root / "config.json").is_file() and (root / "checkpoint" / "state.json").is_file():
        return "run"  # one whose config.json is damaged: --resume says so
    if (root / "train.jsonl").is_file() or (root / "val.jsonl").is_file():
        return "data"
    return None


def _json_or_none(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def read_mark(root: str | os.PathLike) -> dict | None:
    """The folder's mark ``{"kind", "done"}``, or None (none, or not one of ours)."""
    mark = _json_or_none(Path(root) / MARK)
    ok = isinstance(mark, dict) and mark.get("kind") in KINDS and isinstance(mark.get("done"), bool)
    return mark if ok else None


def write_mark(root: str | os.PathLike, kind: str, done: bool) -> None:
    write_json_atomic(Path(root) / MARK, {"kind": kind, "done": done})


def folder_done(path: str | os.PathLike, kind: str) -> bool:
    """True when ``path`` holds a finished ``kind``: its mark says done (a folder from before the
    mark: it holds ``kind`` at all)."""
    mark = read_mark(path)
    if mark is not None:
        return mark["kind"] == kind and mark["done"]
    return Path(path).is_dir() and folder_kind(path) == kind


def is_empty_output(path: str | os.PathLike) -> bool:
    """True when the folder holds nothing, or only what killed triclip writers leave (temp files, a lock)."""
    return all(_LEFTOVER.match(p.name) for p in Path(path).iterdir())


def claim_output_dir(
    path: str | os.PathLike, kind: str, overwrite: bool = False, reuse: bool = False, option: str = "--out",
    hint: str | None = None,
) -> str | None:
    """Check, before any work, that the command writing ``kind`` may write into ``path``.

    Rules: ``path`` is a folder or can be made (no file, device or FIFO there or on the way)
    in a place this process can write (a real write is tried: ``access`` says yes to root
    on read-only mounts); an existing folder that is not empty must hold ``kind`` already
    (anything else, the user's own files included, is refused), and replacing it needs
    ``overwrite``, or ``reuse`` for commands that continue their own output (``train
    --resume``, ``index build --add``, an ``embed`` re-run); an unfinished one (its mark says
    not done: a killed writer's) needs neither. Nothing is written or removed.

    Args:
        path: the output folder.
        kind: one of :data:`KINDS`.
        overwrite: the user passed ``--overwrite``.
        reuse: the command continues what is there (its own kind only).
        option: the option's name in messages.
        hint: what to do about an existing ``kind`` (None: the kind's usual advice, ``_HINT``), for a
            command without the usual way to continue (``solve`` has no ``--resume``).

    Returns:
        The kind found in ``path`` (``kind``), or None for a new or empty folder.

    Raises:
        UserError: one line saying what is there and what to do.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    root = Path(path)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        if os.path.islink(root):
            raise UserError(f"{option} {root} is a symbolic link to {os.readlink(root)}, which does not exist") from None
        st = None
    except NotADirectoryError as err:  # a file on the way
        raise UserError(f"{option} {root}: {_existing_parent(root)} is a file, not a folder ({err.strerror})") from None
    except OSError as err:
        raise UserError(f"{option} {root}: {err.strerror or err}") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        what = "a file" if stat.S_ISREG(st.st_mode) else "not a folder (a device, FIFO or socket)"
        raise UserError(f"{option} {root} is {what}; give a folder")
    parent = _existing_parent(root)
    if st is None and not parent.is_dir():
        raise UserError(f"{option} {root}: {parent} is a file, not a folder")
    check_writable(root if st is not None else parent, option, root)
    if st is None:
        return None
    try:
        empty = is_empty_output(root)
    except OSError as err:
        raise UserError(f"{option} {root}: cannot list it ({err.strerror or err})") from None
    if empty:
        return None
    found = folder_kind(root)
    if found != kind:
        holds = f"it holds {_WHAT[found]}" if found else "it holds files triclip did not write"
        raise UserError(
            f"{option} {root} is not empty and not a triclip {kind} folder ({holds}); refusing to overwrite it"
            f" (choose another {option})"
        )
    if not (overwrite or reuse) and folder_done(root, kind):  # an unfinished one (a killed writer's) is run again
        raise UserError(f"{option} {root} already holds {_WHAT[kind]}; {hint or _HINT[kind]}")
    return found


_HINT = {
    "run": "pass --resume to continue it, or --overwrite to replace it",
    "index": "pass --add to extend it, or --overwrite to replace it (the replaced version is kept for one"
    " `triclip index rollback`)",
    "data": "pass --overwrite to replace it (runs and indexes built on it would no longer match it)",
    "embeddings": "pass --overwrite to start it over",
    "demo": "it resumes where it stopped",
}


def _existing_parent(root: Path) -> Path:
    """The nearest ancestor of ``root`` that exists (a folder, or the file in the way)."""
    parent = root.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def check_writable(folder: str | os.PathLike, option: str = "--out", shown: str | os.PathLike | None = None) -> None:
    """UserError unless a file can be created in ``folder`` (tried for real, then removed)."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise UserError(f"{option} {shown or folder}: cannot write in {folder} ({err.strerror or err})") from None


# ---------------------------------------------------------------------------- one writer per folder


@contextlib.contextmanager
def folder_lock(root: str | os.PathLike, timeout: float = 0.0) -> Iterator[None]:
    """Hold the exclusive writer lock of the folder ``root`` (made if needed): an flock on ``root/.lock``.

    Waits up to ``timeout`` seconds for another writer (0: not at all), then raises UserError.
    """
    root = Path(root)
    while True:
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise UserError(f"cannot write in {root}: {err.strerror or err}") from None
        try:
            _acquire(fd, root, timeout)
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == os.stat(root / LOCK).st_ino:
                    break  # else the folder was swapped (writing) while we waited: lock the new one
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, root: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                held = f" for over {timeout:.0f} s" if timeout else ""
                raise UserError(
                    f"another triclip process is writing {root} (lock {root / LOCK} held{held}); try again when it"
                    " has finished"
                ) from None
            if not told:
                print(f"waiting for another writer of {root} to finish ...", file=sys.stderr, flush=True)
                told = True
            time.sleep(0.05)


@contextlib.contextmanager
def writing(
    path: str | os.PathLike, kind: str, overwrite: bool = False, reuse: bool = False, option: str = "--out",
    timeout: float = 0.0, stage: bool = True, hint: str | None = None,
) -> Iterator[Path]:  # fmt: skip
    """Claim, lock and mark the folder ``path`` for the command writing ``kind``; yield where to write.

    The rule of :func:`claim_output_dir` (checked again once the lock is held), the lock of
    :func:`folder_lock` for the whole block, and the mark (:data:`MARK`) written first. Where it
    writes: in ``path`` itself when it is new or empty, or with ``reuse`` (the command
    continues it); otherwise (``--overwrite`` of a finished folder, or a rerun over an unfinished
    one) in a new folder beside it that replaces it by rename when the block ends (``stage``
    False: in place, for writers that keep versions of their own, like the index). When the
    block ends without an error the mark says done; after an error or a kill it does not, and the
    next run of the command takes the folder as its own. ``hint``: as for :func:`claim_output_dir`.
    """
    root = Path(path)
    _swap_back(root)
    claim_output_dir(root, kind, overwrite, reuse, option, hint)
    made = not root.exists()
    with folder_lock(root, timeout), _unmade_on_error(root, made):
        found = claim_output_dir(root, kind, overwrite, reuse, option, hint)  # what the writer before us left
        for leftover in root.parent.glob(f".{glob.escape(root.name)}.new-*"):  # killed replacements
            if read_mark(leftover) is not None or not any(leftover.iterdir()):
                _rmtree(leftover)
        target = temp_dir(root.parent, f".{root.name}.new-") if stage and found and not reuse else root
        try:
            if not (reuse and found):  # a folder being continued keeps its mark until it is done again
                write_mark(target, kind, done=False)
            yield target
            if read_mark(target) != {"kind": kind, "done": True}:
                write_mark(target, kind, done=True)
            if target != root:
                swap_dir(target, root)
        finally:
            if target != root and target.exists():
                _rmtree(target)


@contextlib.contextmanager
def _unmade_on_error(root: Path, made: bool) -> Iterator[None]:
    """A command that fails before it wrote anything but its mark leaves the folder as it found it."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if {p.name for p in root.iterdir()} <= {MARK, LOCK}:
                (root / MARK).unlink(missing_ok=True)
                if made:
                    (root / LOCK).unlink(missing_ok=True)
                    root.rmdir()
        raise


def _swap_back(root: Path) -> None:
    """A kill between :func:`swap_dir`'s two renames left ``.NAME.old`` and no ``NAME``: put it back."""
    old = recover_dir(root)
    if old != root and read_mark(old) is not None:
        with contextlib.suppress(OSError):
            os.replace(old, root)


# ---------------------------------------------------------------------------- weights files with a checksum

WEIGHTS_SHA256 = "triclip.sha256"  # safetensors metadata: sha256 of the tensors (names, dtypes, shapes, bytes)


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (hex)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tensors_sha256(tensors: dict) -> str:
    """sha256 over ``tensors`` in name order: each name, dtype, shape and the raw bytes."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for key in sorted(tensors):
        tensor = tensors[key].detach().cpu().contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write ``tensors`` atomically as safetensors, their sha256 recorded in the file's metadata."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:  # safetensors itself writes 0600 files: atomic_path applies the umask
        save_file(tensors, str(tmp), metadata={**(metadata or {}), WEIGHTS_SHA256: tensors_sha256(tensors)})


def check_readable(path: str | os.PathLike) -> None:
    """UserError with the OS's own reason unless ``path`` can be opened for reading (safetensors
    says "No such file or directory" for a file it may not read)."""
    try:
        open(path, "rb").close()
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None


def load_safetensors(path: str | os.PathLike) -> dict:
    """The tensors of a safetensors file, checked against the sha256 recorded when it was saved.

    A file without the record (written by an older triclip, or by anything else) loads unchecked.

    Raises:
        UserError: a file that cannot be read, or whose tensors differ from what was saved.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    check_readable(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            recorded = (fh.metadata() or {}).get(WEIGHTS_SHA256)
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for truncated / foreign files
        raise UserError(f"cannot load {path}: {first_line(err)}") from None
    if recorded is not None and tensors_sha256(tensors) != recorded:
        raise UserError(f"{path} is damaged: its tensors do not match the sha256 recorded when it was saved")
    return tensors
