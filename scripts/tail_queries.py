"""Which queries make a triclip index's cold p99, and why: the lists they scan, or the reads.

    python scripts/tail_queries.py INDEX --queries Q.npy --times query_ms.npz --bytes B [--top 8]

INDEX: a folder ``benchmarks.haystack_peers`` built and measured (its ``query_ms.npz``: each query's cold ms with
the hits' meta rows, "cold", and for the row ids alone, "cold_rows", timed in a second pass). For the image codes
of budget B (inverted lists), each query's codes scanned at the kept nprobe (the sizes of the lists it probes).
Prints the slowest queries of each pass with their codes scanned and their ms in the other pass, and the rank
correlation of each pass's ms with the codes scanned. A query slow in one pass only was slowed by that moment's
reads; one slow in both, by what it scans or reads each time.
"""

from __future__ import annotations

import argparse

import numpy as np


def codes_scanned(codec, queries: np.ndarray) -> np.ndarray:
    """(Q,) how many codes each query's probed lists hold, at the codec's own nprobe."""
    lists = codec.ivf.quantizer.search(codec.coarse_input(queries), codec.ivf.nprobe)[1]  # (Q, nprobe)
    return codec.list_sizes()[lists].sum(axis=1)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation of ``a`` and ``b`` (Q,) (ties broken by position)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("index")
    p.add_argument("--queries", required=True)
    p.add_argument("--times", required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args(argv)
    from triclip.index.store import load_contents
    codec = load_contents(a.index, indexes="codes").codes[a.bytes]
    times = np.load(a.times)
    scanned = codes_scanned(codec, np.load(a.queries))  # (Q,)
    print(f"{codec.spec.label()}: nprobe {codec.ivf.nprobe}, codes scanned per query median {np.median(scanned):,.0f}"
          f", p99 {np.percentile(scanned, 99):,.0f}, max {scanned.max():,}")
    for name in times.files:
        ms, other = times[name], [o for o in times.files if o != name]
        print(f"\n{name}: p50 {np.median(ms):.2f} ms, p99 {np.percentile(ms, 99):.2f}; rank correlation with codes"
              f" scanned {spearman(ms, scanned):+.2f}" + "".join(f"; with {o} {spearman(ms, times[o]):+.2f}" for o in other))
        for q in np.argsort(ms)[::-1][: a.top]:
            print(f"  query {q}: {ms[q]:.2f} ms, {scanned[q]:,} codes scanned"
                  + "".join(f", {o} {times[o][q]:.2f} ms" for o in other))


if __name__ == "__main__":
    main()
