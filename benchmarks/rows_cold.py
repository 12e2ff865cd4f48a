"""What gathering a re-rank's rows from a float vectors file costs, cold and warm, three ways side by side.

    python -m benchmarks.rows_cold VECTORS.npy [--rows 300,500,1000] [--reps 25]

A budget whose float vectors do not fit its memory reads its shortlist's rows from disk
(``triclip.index.diskrows.DiskRows``). Each draw evicts the file from the page cache (the map's pages dropped
too), then gathers random rows:

- ``32 threads``: :data:`~triclip.index.diskrows.GATHER_THREADS` threads, each waiting on its rows' faults;
- ``asked, 1 thread``: every row's read requested first (``DiskRows.ask``), then gathered by the calling thread;
- ``asked, 32 threads``: requested first, then gathered by the threads.

Each way draws rows of its own, new at every run (``--seed`` repeats a run's): a VM's host caches what it read,
so a row read once comes back fast. Each draw is gathered three times: ``never read`` (the first time), ``cold``
(evicted again: what the build charges, ``triclip.index.diskrows.settle``) and ``warm`` (every page cached).
Prints the median milliseconds of each. Torch-free.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from triclip.index.diskrows import GATHER_THREADS, DiskRows, evict


def ways(rows: DiskRows) -> dict:
    def asked(threads: int):
        return lambda ids: (rows.ask(ids), rows.gather(ids, threads))
    return {"32 threads": lambda ids: rows.gather(ids, GATHER_THREADS), "asked, 1 thread": asked(1),
            f"asked, {GATHER_THREADS} threads": asked(GATHER_THREADS)}


def measure(file: str, count: int, reps: int = 25, seed: int | None = None) -> dict[str, tuple[list[float], ...]]:
    """Way -> (never read, cold, warm) milliseconds of gathering ``count`` random rows, ``reps`` draws each."""
    rows = DiskRows(file)
    rng, out = np.random.default_rng(seed), {}
    for _ in range(reps):
        for way, gather in ways(rows).items():  # in turn, each its own rows
            ids = rng.choice(len(rows), count, replace=False)
            times = []
            for evicted in (True, True, False):  # never read, cold, warm
                if evicted:
                    rows.drop_pages()  # a mapped page stays cached: unmapped first
                    evict(file)
                started = time.perf_counter()
                gather(ids)
                times.append(1000 * (time.perf_counter() - started))
            for kept, ms in zip(out.setdefault(way, ([], [], [])), times):
                kept.append(ms)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("vectors", help="a float vectors .npy file (N, D), e.g. a version's vectors.npy")
    parser.add_argument("--rows", default="300,500,1000", help="rows gathered per draw (a shortlist), comma-separated")
    parser.add_argument("--reps", type=int, default=25, help="draws, each way")
    parser.add_argument("--seed", type=int, default=None, help="the rows' seed (default: new rows at every run)")
    args = parser.parse_args(argv)
    print(f"random rows of {args.vectors}, {args.reps} draws each way; median ms")
    print(f"{'rows':>6} {'way':<20} {'never read':>10} {'cold':>8} {'warm':>8}")
    for count in (int(c) for c in args.rows.split(",")):
        for way, (never, cold, warm) in measure(args.vectors, count, args.reps, args.seed).items():
            print(f"{count:6d} {way:<20} {np.median(never):10.2f} {np.median(cold):8.2f} {np.median(warm):8.3f}")


if __name__ == "__main__":
    main()
