"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Temporary files and folders come from :mod:`tempfile`, which makes them private
(0600 / 0700) whatever the user's umask says; every helper here gives them the
mode a plain ``open`` / ``mkdir`` would have (0666 / 0777 less the umask) before
they are renamed into place, so runs and indexes are as readable as any other
file the user writes. Use :func:`temp_dir` instead of ``tempfile.mkdtemp`` for
folders that will be renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

from retrieval.errors import UserError


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        fix_mode(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
