"""Where an index folder's live version is, and its manifest read cheaply; FAISS- and torch-free.

``triclip.index.store`` reads and writes versions (its docstring has the layout and the crash
fallbacks); the command line reads a manifest here (:func:`peek_manifest`) to check options
against the index (its D, m's and byte budgets) before anything loads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from triclip.core.errors import UserError

CURRENT = "CURRENT"
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
VERSION_RE = re.compile(r"^v(\d{6,})$")


def _versions(root: Path) -> list[str]:
    """Version folder names under ``root``, oldest first."""
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if VERSION_RE.match(p.name) and p.is_dir()]
    return sorted(names, key=lambda n: int(n[1:]))


def _complete(root: Path, name: str) -> bool:
    return (root / name / MANIFEST).is_file()


def _read_pointer(root: Path) -> str | None:
    try:
        name = (root / CURRENT).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if VERSION_RE.match(name) else None


def current_version(root: str | os.PathLike) -> str:
    """The live version's folder name (with the crash fallbacks of the module docstring)."""
    root = Path(root)
    name = _read_pointer(root)
    if name is not None and _complete(root, name):
        return name
    complete = [n for n in _versions(root) if _complete(root, n)]
    if complete:
        return complete[-1]
    if (root / MANIFEST).is_file():
        raise UserError(f"{root} is an index in an older format (format 1, one m per folder); rebuild it")
    raise UserError(f"{root} is not a triclip index (no {CURRENT} and no complete version folder)")


def is_index_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a triclip index (any format)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return True
    return _read_pointer(path) is not None or any(_complete(path, n) for n in _versions(path))


def peek_manifest(root: str | os.PathLike) -> dict:
    """The live version's manifest as JSON, unchecked (``triclip.index.store.load_contents`` checks it
    against the files); UserError: no index there, or a manifest that is not a JSON object."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a triclip index (no such folder)")
    file = root / current_version(root) / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"index {file.parent} is damaged: cannot read {MANIFEST} ({str(err).splitlines()[0]})") from None
    if not isinstance(manifest, dict):
        raise UserError(f"index {file.parent} is damaged: {MANIFEST} is not a JSON object")
    return manifest
