"""What reading a search's hits from a large version's meta costs cold, three ways side by side.

    python -m benchmarks.meta_cold INDEX [--rows 10] [--reps 30]

A hit's id, image and caption are its row of ``meta.jsonl``, found through the memory-mapped offsets
(``triclip.index.metafile``). Each draw picks ``--rows`` random rows and evicts the version's meta files from the
page cache first (``triclip.index.diskrows.evict``; the maps' pages dropped too), then reads the rows:

- ``one by one, read-ahead``: ``meta[i]`` each, the arrays mapped with the kernel's default advice (a fault reads
  a window around the page);
- ``one by one, random``: ``meta[i]`` each, the arrays mapped ``MADV_RANDOM`` (a fault reads its page), as loaded;
- ``together``: ``meta.rows(ids)``, every row's offsets and line asked for before any is read (what a search does).

Prints the median and p90 milliseconds of each and its ratio to the first. Torch-free.
"""

from __future__ import annotations

import argparse
import mmap
import time
from pathlib import Path

import numpy as np

from triclip.index.diskrows import evict
from triclip.index.metafile import LazyMeta
from triclip.index.store import load_contents


def measure(index: str, rows: int = 10, reps: int = 30, seed: int = 0) -> dict[str, list[float]]:
    meta = load_contents(index, indexes="codes").meta
    if not isinstance(meta, LazyMeta):
        raise SystemExit(f"{index}: its live version is read whole (no meta.offsets.npy): nothing is read cold")
    arrays = (meta.offsets, meta.hashes, meta.order)
    files = [meta.file, *(Path(a.filename) for a in arrays)]
    ways = {"one by one, read-ahead": (mmap.MADV_NORMAL, lambda ids: [meta[i] for i in ids]),
            "one by one, random": (mmap.MADV_RANDOM, lambda ids: [meta[i] for i in ids]),
            "together": (mmap.MADV_RANDOM, meta.rows)}
    rng, out = np.random.default_rng(seed), {way: [] for way in ways}
    for _ in range(reps):
        ids = rng.choice(len(meta), rows, replace=False).tolist()
        for way, (advice, read) in ways.items():  # the same rows each way, in turn
            for a in arrays:
                a._mmap.madvise(mmap.MADV_DONTNEED)  # a mapped page stays cached: unmapped first
                a._mmap.madvise(advice)
            for file in files:
                evict(file)
            started = time.perf_counter()
            read(ids)
            out[way].append(1000 * (time.perf_counter() - started))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("index")
    parser.add_argument("--rows", type=int, default=10, help="rows read per draw (a search's hits)")
    parser.add_argument("--reps", type=int, default=30, help="draws, each way")
    args = parser.parse_args(argv)
    times = measure(args.index, args.rows, args.reps)
    first = float(np.median(next(iter(times.values()))))
    print(f"{args.rows} random rows of {args.index}'s meta, cold, {args.reps} draws")
    print(f"{'way':<24} {'p50 ms':>8} {'p90 ms':>8} {'x first':>8}")
    for way, t in times.items():
        p50, p90 = np.percentile(t, [50, 90])
        print(f"{way:<24} {p50:8.3f} {p90:8.3f} {p50 / first:8.3f}")


if __name__ == "__main__":
    main()
