"""The parts folder of an index build: what a build has finished, kept so that a killed build resumes.

A build of ``OUT`` from embedding shards keeps its work in ``.{OUT name}.build-{key}.shard-parts`` beside
``OUT`` (same filesystem: the lists and vectors files are renamed into the version, not copied). ``key``
(:func:`build_key`) is a hash of the embeddings (their manifest and the size and modification time of every
shard file) and of every option that changes the result (dims, factories, codes, seed, tuning...), so the
same command finds the same folder and a different one does not. ``plan.json`` in it records what the key
was made of. Everything in it is written atomically (a temporary file, then ``os.replace``): a file there
under its own name is finished. The build holds an ``fcntl.flock`` on ``owner.lock`` in the folder (its pid
and host written inside) while it runs; the kernel drops it when the process dies, however it dies.

- The same build run again (after ``kill -9``, a full disk, a crash) takes the folder back and reuses the
  trained indexes, every finished shard part, merged indexes, the chosen codes and the vectors file
  (:func:`open_parts`); one line says so.
- A second build of the same ``OUT`` with the same key while the first runs is refused in one line.
- A build with other inputs removes the folders of dead builds of ``OUT`` (:func:`remove_stale_parts`) and
  keeps those of live ones.
- A build from vectors held in memory (``--run --data``) has no key: a fresh folder of its own
  (``.{OUT name}.{random}.shard-parts``), removed however the build ends.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from triclip.core.errors import UserError
from triclip.core.io import write_json_atomic

PARTS_SUFFIX = ".shard-parts"  # the parts folder of a build of OUT: .{OUT name}.*.shard-parts beside OUT
OWNER = "owner.lock"  # in a parts folder: flock-ed by the build that owns it while it runs
PLAN = "plan.json"  # in a resumable parts folder: what its key was made of
# IndexBuildConfig fields that do not change what a build from embeddings writes (where, how to wait, and
# the --run --data source's own settings); every other field is part of the key
NOT_IN_KEY = ("out", "overwrite", "lock_timeout", "workers", "batch_size", "device", "add", "run", "data",
              "val_data", "weights", "data_config", "ordering")


def build_key(cfg, files: list[Path], decided: dict) -> tuple[str, dict]:
    """The key of a build from embedding shards and the plan it is the hash of.

    ``files``: the embeddings' manifest and every shard file read (identified by path, size and modification
    time: a rewritten shard changes the key). ``decided``: what the build chose before any work (factories per
    m, on disk or not), which depends on the memory available when no budget is given.
    """
    stats = []
    for f in files:
        st = os.stat(f)
        stats.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    options = {k: v for k, v in asdict(cfg).items() if k not in NOT_IN_KEY}
    text = json.dumps({"options": options, "decided": decided, "files": stats}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], json.loads(text)  # the plan: JSON values only


def parts_folder(out: str | os.PathLike, key: str) -> Path:
    out = Path(out).absolute()
    return out.parent / f".{out.name}.build-{key}{PARTS_SUFFIX}"


def open_parts(out: str | os.PathLike, key: str, plan: dict) -> tuple[Path, int, bool]:
    """The parts folder of the build ``key`` of ``out``, claimed (flock): ``(folder, owner fd, resumed)``.

    Removes the folders dead builds of ``out`` left (other keys), then takes this key's folder: a fresh one, or
    a dead build's with the same plan (resumed: its finished files are kept, temporary files of the write it
    was killed in are removed). UserError when a live build holds it.
    """
    work = parts_folder(out, key)
    remove_stale_parts(out, keep=work)
    work.mkdir(parents=True, exist_ok=True)
    fd = claim_parts(work, what=str(out))
    resumed = (work / PLAN).exists()
    try:
        if resumed and json.loads((work / PLAN).read_text()) != plan:
            resumed = False  # the same key, another plan: nothing in it is ours
        if not resumed:
            for path in work.iterdir():
                if path.name != OWNER:
                    _remove(path)
            write_json_atomic(work / PLAN, plan)
        else:
            for path in work.glob(".*"):  # writes the dead build did not finish (temporary files are hidden)
                _remove(path)
    except BaseException:
        os.close(fd)
        raise
    return work, fd, resumed


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fresh_parts(out: str | os.PathLike) -> tuple[Path, int]:
    """A new parts folder of its own for a build that cannot resume, claimed: ``(folder, owner fd)``."""
    out = Path(out).absolute()
    remove_stale_parts(out)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=PARTS_SUFFIX, dir=out.parent))
    return work, claim_parts(work)


def claim_parts(work: Path, what: str | None = None) -> int:
    """Mark the parts folder ``work`` as this build's: an flock on ``work/owner.lock``; returns its fd (keep open).

    UserError when another live process holds it (``what``: the output named in the message).
    """
    fd = os.open(work / OWNER, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"another build of {what or work} is running (its parts are in {work}); wait for it") from None
    except OSError:  # a filesystem without flock: nobody can take it either, so the folder is never removed
        pass
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode())
    return fd


def remove_stale_parts(out: str | os.PathLike, keep: Path | None = None) -> list[Path]:
    """Remove the parts folders that dead builds of ``out`` left beside it (but ``keep``); returns them.

    A folder goes only when its ``owner.lock`` exists and nobody holds its flock (the
    build that made it is dead); a live build's folder, one without an owner file (an
    older triclip's, or a build in its first instant: one line says so) and one we may
    not open are kept. Each removal is one line on stderr.
    """
    out = Path(out).absolute()
    prefix = f".{out.name}."
    try:
        names = [p for p in out.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(PARTS_SUFFIX)]
    except OSError:
        return []
    removed = []
    for folder in names:
        if keep is not None and folder.name == keep.name:
            continue
        try:
            fd = os.open(folder / OWNER, os.O_RDONLY)
        except FileNotFoundError:
            if _age(folder) > 60:  # not a build in its first instant
                print(f"kept {folder}: it has no owner record (an older triclip made it); remove it by hand"
                      f" if no build of {out} is running", file=sys.stderr, flush=True)
            continue
        except OSError:  # not a folder, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live build holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
        if not folder.exists():
            removed.append(folder)
            print(f"removed {folder}: parts of a killed index build", file=sys.stderr, flush=True)
    return removed


def _age(path: Path) -> float:
    """Seconds since ``path`` was last modified (0 when it is gone)."""
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def resuming_line(done: int, total: int, what: str) -> None:
    """The one line a resumed stage prints (nothing when nothing was done)."""
    if done:
        print(f"resuming: {done} of {total} shards of {what} done", file=sys.stderr, flush=True)
