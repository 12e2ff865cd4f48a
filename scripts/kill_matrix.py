"""The kill matrix: every command that writes, SIGKILLed at each step it takes, then run again.

    python scripts/kill_matrix.py [--only train,solve] [--parts kill,replace,disk] [--steps 1,5-9] [--work DIR]
                                  [--no-disk] [--demo] [--list] [--at GLOB] [--jobs 2]

For each command (``data prepare``, ``data split``, ``train``, ``solve``, ``solve --run``, ``embed``,
``index build``; ``demo`` with ``--demo``, which needs Debian's openclipart-png and takes minutes):

1. a reference run into a new folder, watched (:class:`Watcher`: inotify on the folder the output
   goes in, every sub-folder included): the files and folders it creates or renames into place,
   in order, make its steps (:class:`Steps`: one per kind of file or folder, where its first one
   appears: ``out/images/#.png`` for every image, ``out/.checkpoint.tmp/state.json`` for every
   epoch's; temporary names are one kind each); then a watched ``--overwrite`` of that finished
   folder, for the steps of a replacement;
2. at each step, a run into a new folder is SIGKILLed the moment that step's first file
   appears, then run again as it was (a run that says ``--resume`` is run again with it), and
   another is killed there and run again with ``--overwrite``; and at each step of the
   replacement, an ``--overwrite`` of a finished folder is killed, after which the old folder
   must still be whole (its mark says done), then run again;
3. on a 5 MB tmpfs (``mount -t tmpfs``, root; where mount is not permitted, RLIMIT_FSIZE of 5 MB,
   said in the output): exit 0 with its folder done, or exit 2 with one ``triclip: error:`` line
   (printed: it should say the disk is full, or that the data would not fit), never a traceback;
   and a rerun behaves the same. A command whose output fits in 5 MB is run again on a disk of
   half the bytes it wrote there, so that every command meets a disk that fills on the way.

A rerun passes when it exits 0, prints no traceback and leaves a folder whose mark
(``triclip.core.io.MARK``) says done. Kills follow the files, not the clock: a command that
finishes in a second is killed at each of its steps as one that takes minutes, so ``--jobs 2`` runs
two cases at once (each in its own folder, killed at its own command's files) in about half the time. A SKIP is a
case whose step never came (the command exited first: its last file, or a kind of file the
reference wrote and this run did not), counted apart. One line per case; exit status 1 when
any case failed. ``--list`` prints each command's steps without killing anything. The slow
test ``tests/hostile/test_kill_matrix.py`` runs it.

Step numbers follow the reference run's order, which can differ from run to run (two files
written at once are seen in either order). ``--at GLOB`` kills instead at the first file or
folder whose path under the case folder matches GLOB (``fnmatch``; e.g.
``'out/data/images/*/*/.*.tmp'``), a fixed point whatever the numbering, and needs no reference
run. Each killed case's folder, as the kill left it, is listed in ``CASE/killed.txt`` before the
rerun; a failed case's folder is kept (printed) until a run of the same case.
"""

from __future__ import annotations

import argparse
import ctypes
import fnmatch
import functools
import json
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

ROOT = Path(__file__).resolve().parents[1]
OUT = "out"  # the output folder's name inside each case's own folder (the watched one)
DISK_BYTES = 5 << 20
KILL_TRIES = 3  # runs of a case before its step counts as never come (a SKIP)
TINY = ["--model", "tiny", "--batch-size", "16"]
PARTS = ("kill", "replace", "disk")  # killed in a new folder; --overwrite of a finished one killed; the 5 MB disk


def commands(work: Path) -> dict[str, dict]:
    """Each writing command: its arguments with ``{out}``, what it writes, the option that continues it."""
    data, base = work / "shapes", work / "base"
    train, val = str(data / "train.jsonl"), str(data / "val.jsonl")
    return {
        "data prepare": {"args": ["data", "prepare", "shapes", "--out", "{out}", "--num", "300"], "kind": "data",
                         "disk_args": ["data", "prepare", "shapes", "--out", "{out}", "--num", "3000"]},  # 6 MB: over 5
        "data split": {"args": ["data", "split", train, "--out", "{out}"], "kind": "data"},
        "train": {"args": ["train", "--train-data", train, "--val-data", val, *TINY, "--loss", "infonce", "--embed-dim",
                           "16", "--epochs", "2", "--save-every", "1", "--out", "{out}"], "kind": "run",
                  "resume": "--resume"},  # fmt: skip
        "solve": {"args": ["solve", "--train-data", train, "--val-data", val, "--model", "tiny", "--embed-dim", "8",
                           "--out", "{out}"], "kind": "run"},  # fmt: skip
        "solve --run": {"args": ["solve", "--run", str(base), "--train-data", train, "--val-data", val, "--out", "{out}"],
                        "kind": "run"},  # fmt: skip
        "embed": {"args": ["embed", "--run", str(base), "--data", train, "--shard-size", "8", "--out", "{out}"],
                  "kind": "embeddings"},  # fmt: skip
        "index build": {"args": ["index", "build", "--run", str(base), "--data", train, "--val-data", val, "--dims",
                                 "4,8", "--out", "{out}"], "kind": "index"},  # fmt: skip
        "demo": {"args": ["demo", "--workdir", "{out}", "--no-serve", "--num", "60", "--epochs", "1"], "kind": "demo",
                 "no_overwrite": True},  # fmt: skip
    }


def setup(work: Path) -> None:
    """The shapes data and a tiny run on locked towers (what solve --run, embed and index build read)."""
    if not (work / "shapes" / "val.jsonl").exists():
        check(triclip(["data", "prepare", "shapes", "--out", str(work / "shapes"), "--num", "60"], work), "setup data")
    if not (work / "base" / "config.json").exists():
        args = ["train", "--train-data", str(work / "shapes" / "train.jsonl"), *TINY, "--loss", "infonce", "--embed-dim",
                "16", "--epochs", "1", "--lock-image", "--lock-text", "--out", str(work / "base")]  # fmt: skip
        check(triclip(args, work), "setup run")


# ---------------------------------------------------------------------------- running triclip


def env(work: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
            "TRICLIP_CACHE": str(work / "cache")}  # fmt: skip


def start(args: list[str], work: Path, fsize: int | None = None, output=subprocess.PIPE) -> subprocess.Popen:
    """``triclip ARGS`` started; its stdout and stderr go to ``output`` (pipes by default).

    ``fsize``, the fallback full disk: util-linux's ``prlimit`` sets RLIMIT_FSIZE and execs triclip, whose Python
    ignores SIGXFSZ from its start, so writes past fsize fail with EFBIG. Not ``preexec_fn``: it makes subprocess
    fork() the caller, and a caller with gRPC's threads (the suite, after its Milvus tests) then starts children
    that abort before exec (tests/app/test_demo.py, ``ctrl_c_reaches_children``).
    """
    limit = ["prlimit", f"--fsize={fsize}", "--"] if fsize else []
    return subprocess.Popen([*limit, sys.executable, "-m", "triclip", *args], env=env(work), cwd=ROOT, text=True,
                            stdout=output, stderr=output)  # fmt: skip


def triclip(args: list[str], work: Path, fsize: int | None = None) -> tuple[int, str]:
    proc = start(args, work, fsize)
    _, err = proc.communicate(timeout=1800)
    return proc.returncode, err


# ---------------------------------------------------------------------------- watching what a command writes

IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_Q_OVERFLOW, IN_ISDIR = 0x40, 0x80, 0x100, 0x4000, 0x40000000
MASK = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
RANDOM_NAMES = [  # parts of temporary names that differ from run to run, as the libraries writing them make them
    (re.compile(r"\.[a-z0-9_]{8}(?=\.[a-z-]+$)"), ".*"),  # tempfile: .name.XXXXXXXX.tmp, .out.XXXXXXXX.shard-parts
    (re.compile(r"^(\..*[.-])[a-z0-9_]{8}$"), r"\1*"),  # tempfile with a prefix: .tmp-XXXXXXXX, .out.new-XXXXXXXX
    (re.compile(r"^\.tmp[A-Za-z0-9]{6}$"), ".tmp*"),  # the Rust tempfile crate (safetensors): .tmpXXXXXX
]


class Watcher:
    """What appears under ``root`` (created, or renamed into place), in order, through Linux inotify.

    Each folder gets its own watch as it appears (and is scanned then, for what came before its
    watch); folders renamed within the tree keep theirs. :meth:`read` returns the new
    ``(kind, path relative to root)`` pairs, kind ``create`` / ``moved``, or ``found`` for what a new
    folder held when its watch began (created or renamed there: which is not known), ``/`` added for a folder.
    """

    def __init__(self, root: Path):
        self.root = root
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.paths: dict[int, Path] = {}
        self.moved_from: dict[int, Path] = {}
        self.overflowed = False
        self._watch_tree(root, report=False)

    def _watch_tree(self, folder: Path, report: bool) -> list[tuple[str, str]]:
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), MASK)
        if wd < 0:
            return []  # gone again already
        self.paths[wd] = folder
        found = []
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return found
        for entry in entries:
            folder_too = entry.is_dir(follow_symlinks=False)
            if report:
                found.append(("found/" if folder_too else "found", self._rel(Path(entry.path))))
            if folder_too:
                found += self._watch_tree(Path(entry.path), report)
        return found

    def _rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def read(self, timeout: float) -> list[tuple[str, str]]:
        """The events of up to ``timeout`` seconds (returns as soon as some came)."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return []
        try:
            data = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return []
        out, i = [], 0
        while i < len(data):
            wd, mask, cookie, size = EVENT.unpack_from(data, i)
            name = os.fsdecode(data[i + EVENT.size : i + EVENT.size + size].rstrip(b"\0"))
            i += EVENT.size + size
            out += self._event(wd, mask, cookie, name)
        return out

    def _event(self, wd: int, mask: int, cookie: int, name: str) -> list[tuple[str, str]]:
        if mask & IN_Q_OVERFLOW:
            self.overflowed = True
            return []
        if wd not in self.paths or not name:
            return []
        path, folder = self.paths[wd] / name, bool(mask & IN_ISDIR)
        if mask & IN_MOVED_FROM:
            self.moved_from[cookie] = path
            return []
        kind = ("moved" if mask & IN_MOVED_TO else "create") + ("/" if folder else "")
        out = [(kind, self._rel(path))]
        if folder and mask & IN_MOVED_TO and cookie in self.moved_from:  # renamed within the tree: same watches
            old = self.moved_from.pop(cookie)
            for w, p in list(self.paths.items()):
                if p == old or old in p.parents:
                    self.paths[w] = path / p.relative_to(old)
        elif folder:
            out += self._watch_tree(path, report=True)
        return out

    def close(self) -> None:
        os.close(self.fd)


def normalise(path: str) -> str:
    """A path with what differs between runs replaced: random temporary names by ``*``, numbers by ``#``."""
    parts = []
    for part in path.split("/"):
        for pattern, replacement in RANDOM_NAMES:
            part = pattern.sub(replacement, part)
        parts.append(re.sub(r"\d+", "#", part))
    return "/".join(parts)


@dataclass
class Steps:
    """The steps of a run so far: each kind of file or folder (event kind + normalised path) is a step where
    it first appears; its later ones (the next image, the next epoch's checkpoint) belong to that step."""

    order: list[tuple[str, str]] = field(default_factory=list)  # (kind, pattern), in order of first appearance
    _seen: set = field(default_factory=set)

    def add(self, kind: str, path: str) -> tuple[str, str] | None:
        """The step this event starts, or None (a kind already seen)."""
        key = (kind, normalise(path))
        if key in self._seen:
            return None
        self._seen.add(key)
        self.order.append(key)
        return key


def watched(args: list[str], parent: Path, work: Path, kill_at: tuple | str | None = None) -> tuple[bool, Steps, int, str]:
    """Run ``triclip ARGS`` while watching ``parent``; with ``kill_at``, SIGKILL it when that step starts (the
    first file or folder of its kind appears; a glob: the first path under ``parent`` that matches it). Returns (whether it was killed, the steps seen, the exit
    status, stderr and stdout)."""
    watcher = Watcher(parent)
    steps = Steps()
    with tempfile.TemporaryFile("w+") as log:  # not a pipe: a chatty command never blocks on a full one
        proc = start(args, work, output=log)
        killed = False
        try:
            while not killed and proc.poll() is None:
                for kind, path in watcher.read(0.05):
                    step = steps.add(kind, path)
                    if kill_at and reached(kill_at, step, kind, path) and proc.poll() is None:
                        proc.kill()
                        killed = True
                        break
            for kind, path in [] if killed else watcher.read(0.2):  # what came just before the exit
                steps.add(kind, path)
        finally:
            watcher.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        log.seek(0)
        return killed, steps, proc.returncode, log.read()


def reached(kill_at: tuple | str, step: tuple | None, kind: str, path: str) -> bool:
    """Whether an event is the step to kill at: its first of its kind, or, where the step or the event is
    ``found`` (written before its folder's watch began: created or renamed there), the first at that path;
    ``kill_at`` a glob: any event whose path matches it."""
    if isinstance(kill_at, str):
        return fnmatch.fnmatchcase(path, kill_at)
    if step == kill_at:
        return True
    kinds = {kill_at[0].rstrip("/"), kind.rstrip("/")}
    same = kill_at[1] == normalise(path) and kill_at[0].endswith("/") == kind.endswith("/")
    return same and "found" in kinds


def check(result: tuple[int, str], what: str) -> None:
    if result[0] != 0:
        raise SystemExit(f"{what} failed ({result[0]}): {result[1][-2000:]}")


# ---------------------------------------------------------------------------- the cases


def done(folder: Path, kind: str) -> bool:
    try:
        mark = json.loads((folder / ".triclip.json").read_text())
    except (OSError, ValueError):
        return False
    return mark == {"kind": kind, "done": True}


def kept(out: Path) -> Path:
    """Where the old folder is after a killed ``--overwrite``: ``out``, or ``.out.old`` when the kill came
    between the swap's two renames (whole there; the next command writing ``out`` puts it back first,
    ``triclip.core.io.writing``)."""
    old = out.parent / f".{out.name}.old"
    return old if not out.exists() and old.exists() else out


def rerun(spec: dict, out: Path, work: Path, overwrite: bool) -> str | None:
    """Run the command again over ``out``; None when it passed, else why not.

    A folder whose mark already says done (the kill came after its last file) may also be refused
    in one line without ``--overwrite``: that is what a finished folder gets.
    """
    args = [a.replace("{out}", str(out)) for a in spec["args"]] + (["--overwrite"] if overwrite else [])
    finished = done(out, spec["kind"])
    status, err = triclip(args, work)
    if status == 2 and spec.get("resume") and spec["resume"] in err and "Traceback" not in err:
        status, err = triclip(args + [spec["resume"]], work)  # the one line said how to continue it
    lines = [line for line in err.splitlines() if line.startswith("triclip: error:")]
    if finished and not overwrite and status == 2 and len(lines) == 1 and "Traceback" not in err:
        return None
    if status != 0 or "Traceback" in err:
        return f"exit {status}: {err.strip().splitlines()[-1] if err.strip() else ''}"[:300]
    return None if done(out, spec["kind"]) else "exit 0 but the folder's mark does not say done"


def with_out(spec: dict, out: Path, *extra: str) -> list[str]:
    return [a.replace("{out}", str(out)) for a in spec["args"]] + list(extra)


def case_folder(work: Path, name: str) -> Path:
    """A new empty folder for one case; the command writes ``OUT`` inside it (and may stage beside it)."""
    parent = work / "cases" / name
    shutil.rmtree(parent, ignore_errors=True)
    parent.mkdir(parents=True)
    return parent


def said(step: tuple, n: int) -> str:
    kind, pattern = step
    return f"step {n} ({kind.replace('moved', 'renamed into place')} {pattern})"


def kill_cases(name: str, spec: dict, work: Path, fresh: Steps, replace: Steps | None,
               reference: Path, parts: tuple = PARTS, only: set | None = None) -> Iterator[tuple[str, Callable]]:
    """Killed at each step of a fresh run (run again as it was, and with ``--overwrite``), and at each step of
    an ``--overwrite`` of a finished folder (``replace``: the old folder kept whole, then run again): each case's
    title and what runs it (returns why it failed, or None). ``parts`` says which of the two (``kill``,
    ``replace``); ``only``, at which step numbers (all)."""
    slug = name.replace(" ", "_")
    for n, step in enumerate(fresh.order if "kill" in parts else [], 1):
        if only and n not in only:
            continue
        for overwrite in (False, True) if replace is not None else (False,):
            case = f"{slug}-{n}-{'overwrite' if overwrite else 'plain'}"
            yield (f"{name}: killed at {said(step, n)}, run again{' --overwrite' if overwrite else ''}",
                   functools.partial(killed_case, spec, work, case, step, overwrite))  # fmt: skip
    for n, step in enumerate(replace.order if replace is not None and "replace" in parts else [], 1):
        if only and n not in only:
            continue
        yield (f"{name}: --overwrite killed at {said(step, n)}, old kept, run again",
               functools.partial(killed_case, spec, work, f"{slug}-{n}-replace", step, True, reference))  # fmt: skip


def killed_case(spec: dict, work: Path, case: str, step: tuple, overwrite: bool, reference: Path | None = None) -> str | None:
    """A run into a new folder killed at ``step``, then run again (with ``--overwrite``, where asked); with
    ``reference``, an ``--overwrite`` of a copy of that finished folder is killed instead, and the old folder must
    be whole after it. Returns why the case failed, or None."""
    parent = case_folder(work, case)
    extra = ("--overwrite",) if reference is not None else ()
    if not killed_at(spec, parent, work, step, *extra, copy=reference):
        return "skip: it exited before the step came"
    if reference is not None and not done(kept(parent / OUT), spec["kind"]):
        return "the old folder is not whole after a killed --overwrite"
    return rerun(spec, parent / OUT, work, overwrite)


def in_order(cases: Iterable[tuple[str, Callable]], jobs: int) -> Iterator[tuple[str, str | None]]:
    """Each case's ``(title, why it failed or None)``, in the order given, with up to ``jobs`` cases running at
    once (each in its own folder; a kill follows its own command's files, not the clock)."""
    with ThreadPoolExecutor(jobs) as pool:
        running = [(title, pool.submit(run)) for title, run in cases]
        for title, future in running:
            yield title, future.result()


def killed_at(spec: dict, parent: Path, work: Path, step: tuple | str, *extra: str, copy: Path | None = None) -> bool:
    """Run the command into ``parent``/OUT (a copy of ``copy`` first, where given) and kill it at ``step``; tried
    up to ``KILL_TRIES`` times, since a step can pass unseen (a file written in a folder renamed away before its
    watch was in place). True once killed there."""
    for _ in range(KILL_TRIES):
        shutil.rmtree(parent, ignore_errors=True)
        parent.mkdir(parents=True)
        if copy is not None:
            shutil.copytree(copy, parent / OUT, symlinks=True)
        if watched(with_out(spec, parent / OUT, *extra), parent, work, step)[0]:
            listing = sorted(str(p.relative_to(parent)) + ("/" if p.is_dir() else "") for p in parent.rglob("*"))
            (parent / "killed.txt").write_text("".join(f"{line}\n" for line in listing))  # the folder as the kill left it
            return True
    return False


def at_cases(name: str, spec: dict, work: Path, glob: str) -> Iterator[tuple[str, str | None]]:
    """The one case of ``--at``: killed at the first path matching ``glob``, then run again as it was."""
    parent = case_folder(work, f"{name.replace(' ', '_')}-at")
    why = rerun(spec, parent / OUT, work, False) if killed_at(spec, parent, work, glob) else "skip: no path matched"
    yield f"{name}: killed at the first path matching {glob}, run again", why


def all_cases(name: str, spec: dict, work: Path, refs: tuple, parts: tuple,
              only: set | None = None, jobs: int = 1) -> Iterator[tuple[str, str | None]]:
    """The kill cases (``jobs`` at once), then the disk cases (5 MB; where it fit, half of what it wrote), those of
    ``parts``, each as it ends, in order (printed at once)."""
    if "kill" in parts or "replace" in parts:
        yield from in_order(kill_cases(name, spec, work, *refs, parts=parts, only=only), jobs)
    if "disk" in parts:
        case, why, how, used = disk_case(name, spec, work)
        yield f"{case} ({how})", why
        if used:  # it fit in 5 MB: a disk of half what it wrote fills up on the way
            case, why, how, _ = disk_case(name, spec, work, max(used // 2, 4096))
            yield f"{case}, half of what it writes ({how})", why


def references(name: str, spec: dict, work: Path) -> tuple[Path, Steps, Steps | None]:
    """The reference runs, watched: into a new folder, then ``--overwrite`` of it (not for commands that have
    no ``--overwrite``); returns the finished folder and the steps of each."""
    slug = name.replace(" ", "_")
    parent = case_folder(work, f"reference-{slug}")
    _, fresh, status, err = watched(with_out(spec, parent / OUT), parent, work)
    check((status, err), f"{name} (reference)")
    if spec.get("no_overwrite"):
        return parent / OUT, fresh, None
    again = case_folder(work, f"reference-{slug}-replace")
    shutil.copytree(parent / OUT, again / OUT, symlinks=True)
    _, replace, status, err = watched(with_out(spec, again / OUT, "--overwrite"), again, work)
    check((status, err), f"{name} (reference --overwrite)")
    return parent / OUT, fresh, replace


def disk_case(name: str, spec: dict, work: Path, size: int = DISK_BYTES) -> tuple[str, str | None, str, int]:
    """The command on a disk of ``size`` bytes: exit 0 with its folder done, or exit 2 with one line, run twice;
    ``(case, why not, how the disk was made, bytes it wrote where it fit, else 0)``."""
    mount = Path(tempfile.mkdtemp(prefix="disk-", dir=work))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0  # fmt: skip
    how = f"tmpfs of {size:,} bytes" if mounted else f"RLIMIT_FSIZE of {size:,} bytes (mount not permitted)"
    try:
        out = mount / "out"
        args = [a.replace("{out}", str(out)) for a in spec.get("disk_args", spec["args"])]
        why, used = None, 0
        for attempt in ("first", "again"):
            status, err = triclip(args, work, None if mounted else size)
            lines = [line for line in err.splitlines() if line.startswith("triclip: error:")]
            if "Traceback" in err or (status != 0 and (status != 2 or len(lines) != 1)):
                why = f"{attempt}: exit {status}: {err.strip().splitlines()[-1] if err.strip() else ''}"[:300]
            elif status == 0 and not done(out, spec["kind"]):
                why = f"{attempt}: exit 0 but the folder's mark does not say done"
            if why or status == 0:
                break
        if why is None:  # what it did, for the record
            used = written(mount) if status == 0 else 0
            why = f"exit {status} ok: {lines[0][:160] if status else f'it fits ({used:,} bytes)'}"
        return f"{name}: on a disk of {size:,} bytes", why, how, used
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], check=False)
        shutil.rmtree(mount, ignore_errors=True)


def written(folder: Path) -> int:
    """Bytes of the files under ``folder``, each rounded up to whole 4 KiB pages (as tmpfs counts them)."""
    sizes = [f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink()]
    return sum(-(-n // 4096) * 4096 for n in sizes)


def step_numbers(text: str) -> set[int] | None:
    """``1,5-9`` as {1, 5, 6, 7, 8, 9}; None for all (an empty text)."""
    numbers = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        numbers |= set(range(int(first), int(last or first) + 1))
    return numbers or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated command names (default: all)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a new temporary one, removed)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--steps", default="", help="step numbers to kill at, as --list numbers them: 1,5-9 (default: all)")
    parser.add_argument("--no-disk", action="store_true", help="leave out the 5 MB disk cases")
    parser.add_argument("--demo", action="store_true", help="include the demo (openclipart-png; minutes)")
    parser.add_argument("--list", action="store_true", help="print each command's steps; kill nothing")
    parser.add_argument("--jobs", type=int, default=1, help="kill cases run at once, each in its own folder (default: 1)")
    parser.add_argument("--at", default="", help="kill at the first path under the case folder matching this glob (no steps)")
    ns = parser.parse_args(argv)
    work = Path(ns.work or tempfile.mkdtemp(prefix="kill-matrix-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    names = list(commands(work))
    chosen = ns.only.split(",") if ns.only else [n for n in names if n != "demo" or ns.demo]  # in --only's order
    if set(chosen) - set(names):
        parser.error(f"--only: no command {', '.join(sorted(set(chosen) - set(names)))}; choose from {', '.join(names)}")
    parts = tuple(p for p in ns.parts.split(",") if p != "disk" or not ns.no_disk)
    if set(parts) - set(PARTS):
        parser.error(f"--parts: no part {', '.join(sorted(set(parts) - set(PARTS)))}; choose from {', '.join(PARTS)}")
    try:
        only = step_numbers(ns.steps)
    except ValueError:
        parser.error(f"--steps: {ns.steps!r} is not numbers and ranges such as 1,5-9")
    if ns.jobs < 1:
        parser.error(f"--jobs: {ns.jobs} is not a count of cases (1 or more)")
    if ns.at and ns.list:
        parser.error("--at kills at a path, not at numbered steps: leave out --list")
    setup(work)
    counts = {"PASS": 0, "SKIP": 0, "FAIL": 0}
    for name in chosen:
        spec = commands(work)[name]
        needed = not ns.at and (ns.list or "kill" in parts or "replace" in parts)
        reference, fresh, replace = references(name, spec, work) if needed else (None, Steps(), None)
        if ns.list:
            for title, steps in (("", fresh), (" --overwrite of a finished folder", replace)):
                for n, step in enumerate(steps.order if steps else [], 1):
                    print(f"{name}{title}: {said(step, n)}", flush=True)
            continue
        if ns.at:
            cases = at_cases(name, spec, work, ns.at)
        else:
            cases = all_cases(name, spec, work, (fresh, replace, reference), parts, only, ns.jobs)
        for case, why in cases:
            verdict = "PASS" if why is None or why.startswith("exit ") and "ok:" in why else "FAIL"
            verdict = "SKIP" if why and why.startswith("skip") else verdict
            counts[verdict] += 1
            print(f"{verdict} {case}{'' if why is None else ': ' + why}", flush=True)
    print(f"{counts['PASS']} passed, {counts['SKIP']} skipped, {counts['FAIL']} failed", flush=True)
    if not ns.work and not counts["FAIL"]:
        shutil.rmtree(work, ignore_errors=True)
    elif counts["FAIL"]:
        print(f"the failed cases' folders are in {work / 'cases'}", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
