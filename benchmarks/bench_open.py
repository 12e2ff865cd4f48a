"""Opening an index folder before and after its files were checked against the manifest, side by side.

Usage::

    .venv/bin/python -m benchmarks.bench_open --index demo/index                 # against OLD_REF
    .venv/bin/python -m benchmarks.bench_open --index demo/index --old main --rounds 9

The index is opened by two interpreters in alternating rounds: one on this tree (every file
checked against its record in the manifest, ``triclip.index.filecheck``; the codes of each byte
budget opened, and read on first use), one on ``--old`` (a git commit, exported to a
temporary folder: the store that read every file unchecked and every budget's codes up
front). Each round times, in a warm interpreter with the files in the page cache:

- ``open``: ``triclip.index.store.load_contents`` (what ``Searcher.load`` spends as ``index_load``);
- ``open + every budget``: that, then each budget's image and caption codes read (what the old
  store read at open; on this tree the first search of each budget reads them).

Each side reports its median over rounds; the ratio new / old is of the medians. Both read
the same folder: a version written before the file records is first re-written by this tree
into ``--work`` (same files, records added), since an unrecorded file is only checked by kind
and shape. The machine may be shared: compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_REF = "538adbb"  # the last commit whose store read every file unchecked and every budget's codes at open

CHILD = """
import json, sys, time
from triclip.index.store import load_contents

index, repeat = sys.argv[1], int(sys.argv[2])
load_contents(index)  # imports and first reads paid here
out = {"open": [], "open + every budget": []}
for _ in range(repeat):
    t0 = time.perf_counter()
    contents = load_contents(index)
    t1 = time.perf_counter()
    for table in (contents.codes, contents.text_codes):
        for budget in list(table):
            table[budget]
    t2 = time.perf_counter()
    out["open"].append(t1 - t0)
    out["open + every budget"].append(t2 - t0)
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--index", required=True, help="an index folder (read only)")
    parser.add_argument("--old", default=OLD_REF, help=f"the git commit to compare with (default {OLD_REF})")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of each side")
    parser.add_argument("--repeat", type=int, default=5, help="opens per round (the round's time is their median)")
    parser.add_argument("--work", default=None, help="where the re-written copy goes (default: a temporary folder)")
    ns = parser.parse_args(argv)
    work = Path(ns.work or tempfile.mkdtemp(prefix="bench-open-"))
    try:
        index = recorded_copy(Path(ns.index), work / "index")
        old = export(ns.old, work / "old")
        times = {"old": {}, "new": {}}
        for _ in range(ns.rounds):
            for side, root in (("old", old), ("new", ROOT)):
                for what, values in child(root, index, ns.repeat).items():
                    times[side].setdefault(what, []).append(statistics.median(values))
        report(times, ns, index)
    finally:
        if ns.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def recorded_copy(index: Path, out: Path) -> Path:
    """``index`` itself when its live version records its files, else a copy re-written by this tree."""
    from triclip.index.store import load_contents, read_manifest, write_version, writer_lock

    if "files" in read_manifest(index):
        return index
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    contents = load_contents(index)
    contents.codes.load_all()
    contents.text_codes.load_all()
    with writer_lock(out):
        write_version(out, contents)
    return out


def export(ref: str, out: Path) -> Path:
    """The tree of commit ``ref`` in ``out`` (``git archive``)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "triclip"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def child(root: Path, index: Path, repeat: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(index), str(repeat)], env=env, cwd=root,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(times: dict, ns, index: Path) -> None:
    print(f"index {index} ({ns.rounds} rounds x {ns.repeat} opens, medians; old = {ns.old}, new = this tree)")
    print(f"{'':24s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s}")
    for what in times["old"]:
        old, new = statistics.median(times["old"][what]), statistics.median(times["new"][what])
        print(f"{what:24s} {old * 1000:9.1f} {new * 1000:9.1f} {new / old:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
