"""How close a haystack's exact top 10 are, and how far a code's scores stray: is a code's fall at large N the
haystack crowding its queries?

    python scripts/haystack_gaps.py INDEX --data DATA --vectors ROWS.npy [--sizes 1000000,10000000,100000000]

ROWS.npy: the rows of ``benchmarks.haystack curve --vectors`` (float16, in order; the curve's seed). For each size
(a prefix of the rows), over the distinct test captions: the median score gap between the exact 1st and 10th, and
between the 10th and 11th (what a code must order). Then the spread of a 16 B code's score error (lists of OPQ16x8
sized for the largest size as ``haystack curve`` sizes them): the sd of q.x - q.x_decoded over the first 100,000
rows. A gap far below that spread is one no code of that size can order.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks import haystack as hs
from triclip.core.progress import progress

CHUNK = 1 << 20  # rows read at a time (512 MB of float16 at D = 256)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("index")
    p.add_argument("--data", required=True)
    p.add_argument("--vectors", required=True)
    p.add_argument("--sizes", type=hs.ints, default=[1_000_000, 10_000_000, 100_000_000])
    a = p.parse_args(argv)
    sp = hs.read_split(a.index, a.data)
    queries = hs.t2i_set(sp, sp.rows["test"])[0]  # (Q, D)
    rows = np.load(a.vectors, mmap_mode="r")  # (N, D) float16
    top, done = hs.TopK(queries, 11), 0  # the exact top 11 scores, streamed
    for size in sorted(a.sizes):
        for lo in progress(range(done, size, CHUNK), desc=f"to {size:,} rows", unit="chunk"):
            top.add(np.asarray(rows[lo : min(size, lo + CHUNK)]))
        done, s = size, top.s
        print(json.dumps({"n": size, "gap_1st_10th": float(np.median(s[:, 0] - s[:, 9])),
                          "gap_10th_11th": float(np.median(s[:, 9] - s[:, 10]))}), flush=True)
    sample = np.asarray(rows[:100_000], np.float32)  # (100k, D)
    code = hs.code_of("lists-OPQ16x8", sample.shape[1])[0].fit(sample[:20_000])
    code.size_for(lambda ids: np.asarray(rows[np.sort(ids)], np.float32), done, seed=0)  # as the curve sized it
    code.add(sample)
    error = queries @ (sample - code.index.reconstruct(np.arange(len(sample)))).T  # (Q, 100k)
    print(json.dumps({"code": code.index.spec.label(), "score_error_sd": float(error.std())}))


if __name__ == "__main__":
    main()
