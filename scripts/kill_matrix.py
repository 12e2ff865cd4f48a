"""The kill matrix: every command that writes, SIGKILLed at three points, then run again.

    python scripts/kill_matrix.py [--only train,solve] [--work DIR] [--no-disk] [--demo]

For each command (``data prepare``, ``data split``, ``train``, ``solve``, ``solve --run``, ``embed``,
``index build``; ``demo`` with ``--demo``, which needs Debian's openclipart-png and takes minutes):

1. a reference run into a new folder, timed (T);
2. at each of three points (0.2, 0.5 and 0.8 of T after the interpreter's start-up) a run into a new folder is killed
   with SIGKILL, then run again as it was (a run that says ``--resume`` is run again with it), and
   another is killed and run again with ``--overwrite``; and an ``--overwrite`` of a finished folder is
   killed, after which the old folder must still be whole (its mark says done), then run again;
3. on a 5 MB tmpfs (``mount -t tmpfs``, root; where mount is not permitted, RLIMIT_FSIZE of 5 MB,
   said in the output): exit 0, or exit 2 with one ``triclip: error:`` line (printed: it should say
   the disk is full, or that the data would not fit), never a traceback; and a rerun behaves the same.

A rerun passes when it exits 0, prints no traceback and leaves a folder whose mark
(``triclip.core.io.MARK``) says done. A kill that came after the command's last file (or after it
exited) is a SKIP, counted apart. One line per case; exit status 1 when any case failed.
The slow test ``tests/hostile/test_kill_matrix.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POINTS = (0.2, 0.5, 0.8)
DISK_BYTES = 5 << 20
TINY = ["--model", "tiny", "--batch-size", "16"]


def commands(work: Path) -> dict[str, dict]:
    """Each writing command: its arguments with ``{out}``, what it writes, the option that continues it."""
    data, base = work / "shapes", work / "base"
    train, val = str(data / "train.jsonl"), str(data / "val.jsonl")
    return {
        "data prepare": {"args": ["data", "prepare", "shapes", "--out", "{out}", "--num", "3000"], "kind": "data"},
        "data split": {"args": ["data", "split", train, "--out", "{out}"], "kind": "data"},
        "train": {"args": ["train", "--train-data", train, "--val-data", val, *TINY, "--loss", "infonce", "--embed-dim",
                           "16", "--epochs", "3", "--save-every", "1", "--out", "{out}"], "kind": "run",
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


def start(args: list[str], work: Path, fsize: int | None = None) -> subprocess.Popen:
    def limit():  # the fallback full disk: writes past fsize fail with EFBIG (SIGXFSZ ignored)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen([sys.executable, "-m", "triclip", *args], env=env(work), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit if fsize else None)  # fmt: skip


def triclip(args: list[str], work: Path, fsize: int | None = None) -> tuple[int, str]:
    proc = start(args, work, fsize)
    _, err = proc.communicate(timeout=1800)
    return proc.returncode, err


def killed_at(args: list[str], work: Path, seconds: float) -> bool:
    """Start ``triclip ARGS`` and SIGKILL it ``seconds`` later; False when it had finished before."""
    proc = start(args, work)
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    finished = proc.poll() is not None
    if not finished:
        proc.kill()
    proc.communicate()
    return not finished


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


def rerun(spec: dict, out: Path, work: Path, overwrite: bool) -> str | None:
    """Run the command again over ``out``; None when it passed, else why not."""
    args = [a.replace("{out}", str(out)) for a in spec["args"]] + (["--overwrite"] if overwrite else [])
    status, err = triclip(args, work)
    if status == 2 and spec.get("resume") and spec["resume"] in err and "Traceback" not in err:
        status, err = triclip(args + [spec["resume"]], work)  # the one line said how to continue it
    if status != 0 or "Traceback" in err:
        return f"exit {status}: {err.strip().splitlines()[-1] if err.strip() else ''}"[:300]
    return None if done(out, spec["kind"]) else "exit 0 but the folder's mark does not say done"


def kill_cases(name: str, spec: dict, work: Path, seconds: float, reference: Path) -> list[tuple[str, str | None]]:
    """The kills at :data:`POINTS` of the command's own work (after the interpreter's start-up)."""
    results = []
    started = time.monotonic()
    check(triclip(["--help"], work), "start-up")
    startup = min(time.monotonic() - started, 0.9 * seconds)
    for point in POINTS:
        at = startup + point * (seconds - startup)
        for overwrite in (False, True):
            if overwrite and spec.get("no_overwrite"):
                continue
            out = work / "cases" / f"{name.replace(' ', '_')}-{point}-{'overwrite' if overwrite else 'plain'}"
            shutil.rmtree(out, ignore_errors=True)
            killed = killed_at([a.replace("{out}", str(out)) for a in spec["args"]], work, at)
            killed = killed and not done(out, spec["kind"])  # killed after its last file: it had finished
            why = rerun(spec, out, work, overwrite) if killed else None
            results.append((f"{name}: killed at {at:.1f} s, run again{' --overwrite' if overwrite else ''}",
                            why if killed else "skip: finished before the kill"))  # fmt: skip
        if spec.get("no_overwrite"):
            continue
        out = work / "cases" / f"{name.replace(' ', '_')}-{point}-replace"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(reference, out, symlinks=True)
        killed = killed_at([a.replace("{out}", str(out)) for a in spec["args"]] + ["--overwrite"], work, at)
        why = None if done(out, spec["kind"]) else "the old folder is not whole after a killed --overwrite"
        why = why or rerun(spec, out, work, overwrite=True)
        results.append((f"{name}: --overwrite killed at {at:.1f} s, old kept, run again", why if killed else
                        "skip: finished before the kill"))  # fmt: skip
    return results


def disk_case(name: str, spec: dict, work: Path) -> tuple[str, str | None, str]:
    """The command on a 5 MB disk: exit 0, or one line saying so; ``(case, why not, how the disk was made)``."""
    mount = Path(tempfile.mkdtemp(prefix="disk-", dir=work))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0  # fmt: skip
    how = "tmpfs of 5 MB" if mounted else "RLIMIT_FSIZE of 5 MB (mount not permitted)"
    try:
        out = mount / "out"
        args = [a.replace("{out}", str(out)) for a in spec["args"]]
        why = None
        for attempt in ("first", "again"):
            status, err = triclip(args, work, None if mounted else DISK_BYTES)
            lines = [line for line in err.splitlines() if line.startswith("triclip: error:")]
            if "Traceback" in err or (status != 0 and (status != 2 or len(lines) != 1)):
                why = f"{attempt}: exit {status}: {err.strip().splitlines()[-1] if err.strip() else ''}"[:300]
            if why or status == 0:
                break
        if why is None:  # what it did, for the record
            why = f"exit {status} ok: {lines[0][:160] if status else 'it fits'}"
        return f"{name}: on a 5 MB disk", why, how
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], check=False)
        shutil.rmtree(mount, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated command names (default: all)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a new temporary one, removed)")
    parser.add_argument("--no-disk", action="store_true", help="leave out the 5 MB disk cases")
    parser.add_argument("--demo", action="store_true", help="include the demo (openclipart-png; minutes)")
    ns = parser.parse_args(argv)
    work = Path(ns.work or tempfile.mkdtemp(prefix="kill-matrix-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    setup(work)
    chosen = [n for n in commands(work) if (n in ns.only.split(",") if ns.only else n != "demo" or ns.demo)]
    failed = 0
    for name in chosen:
        spec = commands(work)[name]
        reference = work / "reference" / name.replace(" ", "_")
        shutil.rmtree(reference, ignore_errors=True)
        started = time.monotonic()
        check(triclip([a.replace("{out}", str(reference)) for a in spec["args"]], work), f"{name} (reference)")
        first = time.monotonic() - started
        started = time.monotonic()  # timed again with the caches the first run filled (what the kills meet)
        again = [a.replace("{out}", str(reference)) for a in spec["args"]]
        check(triclip(again + ([] if spec.get("no_overwrite") else ["--overwrite"]), work), f"{name} (reference, again)")
        seconds = first if spec.get("no_overwrite") else time.monotonic() - started  # the demo's second run: a no-op
        cases = kill_cases(name, spec, work, seconds, reference)
        if not ns.no_disk:
            case, why, how = disk_case(name, spec, work)
            cases.append((f"{case} ({how})", why))
        for case, why in cases:
            verdict = "PASS" if why is None or why.startswith("exit ") and "ok:" in why else "FAIL"
            verdict = "SKIP" if why and why.startswith("skip") else verdict
            failed += verdict == "FAIL"
            print(f"{verdict} {case}{'' if why is None else ': ' + why}", flush=True)
    print(f"{failed} failed", flush=True)
    if not ns.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
