"""Streaming index build from embedding shards: time, peak memory, a kill -9 half-way, OpenMP threads.

    python -m benchmarks.bench_stream build EMB --out INDEX [--option VALUE ...]
        ``triclip index build --embeddings EMB --out INDEX ...`` in a child process: wall seconds and its peak
        resident memory (``ru_maxrss`` of the child from ``wait4``: what ``/usr/bin/time -v`` reports as
        "Maximum resident set size").
    python -m benchmarks.bench_stream killed EMB --out INDEX [--reference REF] [--at 0.5] [--option VALUE ...]
        The same build SIGKILL-ed when ``--at`` of its image shard parts exist, then run again (it resumes):
        both runs' wall and peak memory, their sum, and with REF (an uninterrupted build of the same command)
        which files of the version equal REF's byte for byte; without, the files of the version written.
    python -m benchmarks.bench_stream subset EMB --shards S --out EMB2
        An embeddings folder of EMB's first S shards (linked, not copied): a smaller collection of the same rows.
    python -m benchmarks.bench_stream threads EMB --rows N [--factory IVF1024,PQ64]
        FAISS adds per second into a trained index at m = D with 1 and with 2 OpenMP threads, one run, the
        rows read into memory first (the adds alone are timed).

Build options after the positional arguments go to ``triclip index build`` as they are (e.g.
``--bytes 16 --memory-budget 100M``). Every command prints one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SKIP = ("manifest.json", "curves.json")  # they record timings


def run_build(emb: str, out: str, options: list[str], kill_when=None) -> dict:
    """One ``triclip index build`` child: wall seconds, peak RSS (MiB), exit status; ``kill_when()`` true: SIGKILL."""
    cmd = [sys.executable, "-m", "triclip", "index", "build", "--embeddings", emb, "--out", out, *options]
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would stop the build
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
        while kill_when is not None and not _ended(proc.pid) and not kill_when():
            time.sleep(0.05)
        if kill_when is not None:
            os.kill(proc.pid, signal.SIGKILL)  # a zombie (ended, not reaped) ignores it; Popen.send_signal would reap
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = 0  # reaped here (wait4 gives its rusage); Popen must not wait for it again
        log.seek(0)
        err = log.read()
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    lines = [line for line in err.splitlines() if line.startswith(("resuming", "kept the", "triclip: error"))]
    return {"seconds": round(seconds, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "exit": code,
            "lines": lines}


def _ended(pid: int) -> bool:
    """Whether the child ``pid`` has ended, without reaping it (its rusage is read by ``wait4``)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def digests(index: str) -> dict[str, str]:
    live = Path(index) / (Path(index) / "CURRENT").read_text().strip()
    out = {}
    for f in sorted(live.iterdir()):
        if f.name not in SKIP:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
            out[f.name] = h.hexdigest()
    return out


def killed(emb: str, out: str, reference: str | None, at: float, options: list[str]) -> dict:
    """The build killed when ``at`` of the image parts of its first m exist, then resumed; compared to ``reference``
    (None: not compared, the version's files listed with their sizes)."""
    shards = json.loads((Path(emb) / "manifest.json").read_text())["num_shards"]
    want = max(1, int(round(at * shards)))
    pattern = str(Path(out).absolute().parent / f".{Path(out).name}.build-*.shard-parts" / "image.m*.part*.faiss")
    first = run_build(emb, out, options, kill_when=lambda: len(glob.glob(pattern)) >= want)
    parts = len(glob.glob(pattern))
    second = run_build(emb, out, options)
    done = {"shards": shards, "killed_with_parts": parts, "killed": first, "resumed": second,
            "total_seconds": round(first["seconds"] + second["seconds"], 1),
            "peak_rss_mib": max(first["peak_rss_mib"], second["peak_rss_mib"])}
    if reference is None:
        current = Path(out) / "CURRENT"  # absent when the second run failed too
        live = Path(out) / current.read_text().strip() if current.is_file() else None
        return {**done, "files": {} if live is None else {f.name: f.stat().st_size for f in sorted(live.iterdir())}}
    mine, ref = digests(out), digests(reference)
    return {**done, "equal_files": sorted(f for f in ref if mine.get(f) == ref[f]),
            "different_files": sorted(f for f in ref if mine.get(f) != ref[f])}


def subset(emb: str, shards: int, out: str) -> dict:
    """EMB's first ``shards`` shards as an embeddings folder of its own (shard folders linked)."""
    from triclip.model.shards import shard_name

    src, dst = Path(emb).absolute(), Path(out)
    manifest = json.loads((src / "manifest.json").read_text())
    dst.mkdir(parents=True)
    rows = 0
    for s in range(shards):
        (dst / shard_name(s)).symlink_to(src / shard_name(s))
        rows += json.loads((src / shard_name(s) / "shard.json").read_text())["count"]
    for name in os.listdir(src):
        if not name.startswith("shard-") and name != "manifest.json":
            (dst / name).symlink_to(src / name)
    manifest.update(num_shards=shards, records=rows)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return {"embeddings": str(dst), "shards": shards, "rows": rows}


def threads(emb: str, rows: int, factory: str) -> dict:
    """Adds per second with 1 and 2 OpenMP threads into one trained index (the same rows, in memory)."""
    import faiss

    from triclip.index import faiss_index as fi
    from triclip.index.build import train_once
    from triclip.index.vectors import ShardVectors

    manifest = json.loads((Path(emb) / "manifest.json").read_text())
    vectors = ShardVectors.open(emb, manifest["num_shards"], "image")
    dim = vectors.dim
    trained = train_once(vectors, dim, fi.new_index(dim, factory), seed=0)
    x, s = [], 0
    while sum(len(p) for p in x) < rows:
        x.append(vectors.shard(s, dim))
        s += 1
    x = np.concatenate(x)[:rows]  # (rows, D) float32
    rates = {}
    for t in (1, 2, 1, 2):  # twice each, interleaved: the machine is shared
        faiss.omp_set_num_threads(t)
        part = faiss.clone_index(trained)
        started = time.perf_counter()
        part.add(x)
        rates.setdefault(str(t), []).append(round(rows / (time.perf_counter() - started)))
    best = {t: max(r) for t, r in rates.items()}
    return {"factory": factory, "rows": rows, "dim": dim, "adds_per_s": rates, "ratio_2_over_1": round(best["2"] / best["1"], 2)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_stream", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", allow_abbrev=False)
    k = sub.add_parser("killed", allow_abbrev=False)
    for p in (b, k):
        p.add_argument("emb")
        p.add_argument("--out", required=True)
    k.add_argument("--reference")
    k.add_argument("--at", type=float, default=0.5)
    s = sub.add_parser("subset", allow_abbrev=False)
    s.add_argument("emb")
    s.add_argument("--shards", type=int, required=True)
    s.add_argument("--out", required=True)
    t = sub.add_parser("threads", allow_abbrev=False)
    t.add_argument("emb")
    t.add_argument("--rows", type=int, default=1_000_000)
    t.add_argument("--factory", default="IVF1024,PQ64")
    args, options = parser.parse_known_args(argv)
    if args.command == "build":
        result = run_build(args.emb, args.out, options)
    elif args.command == "killed":
        result = killed(args.emb, args.out, args.reference, args.at, options)
    elif args.command == "subset":
        result = subset(args.emb, args.shards, args.out)
    else:
        result = threads(args.emb, args.rows, args.factory)
    print(json.dumps({"command": args.command, **result}), flush=True)


if __name__ == "__main__":
    main()
