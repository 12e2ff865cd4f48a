"""What the precision of a re-rank's rows (``index build --vectors``) keeps of the exact top 10 in a haystack.

    PYTHONPATH=. python scripts/rows_precision.py HAYSTACK [HAYSTACK ...]

HAYSTACK: a folder of ``benchmarks.haystack build`` (as ``benchmarks.haystack_peers`` writes one per seed:
``embeddings/``, ``queries.npy``, ``truth.npy``). Every image row is searched exactly, as float32 (the truth), and as
float16 and sq8 keep it (sq8 as a build keeps it, after its fixed rotation; "sq8 unrotated": without it,
``benchmarks.vectors_dtype.kept_precisions``); prints per folder the share of
the exact float top 10 each keeps: the most any re-rank by such rows can hold. Reads the rows whole (N x D float32
in memory: 1 GB at 1M). Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from benchmarks.vectors_dtype import kept_precisions
from triclip.index.vectors import ShardVectors, exact_topk


def kept_by_precision(full: np.ndarray, queries: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """Share of ``truth`` (Q, k), the exact top k of ``queries`` (Q, D) over ``full`` (N, D), that exact search
    over each precision's rows keeps."""
    k = truth.shape[1]
    out = {}
    for name, rows in {"float32": full, **kept_precisions(full)}.items():
        got = exact_topk(rows, queries, k)  # (Q, k)
        out[name] = round(float(np.mean([len(set(t) & set(g)) / k for t, g in zip(truth, got)])), 4)
    return out


def measure(folder: str) -> dict:
    shards = len([d for d in os.listdir(os.path.join(folder, "embeddings")) if d.startswith("shard-")])
    full = ShardVectors.open(os.path.join(folder, "embeddings"), shards, "image").full()  # (N, D)
    queries, truth = np.load(os.path.join(folder, "queries.npy")), np.load(os.path.join(folder, "truth.npy"))
    return {"haystack": folder, "rows": len(full), **kept_by_precision(full, queries, truth)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("haystacks", nargs="+")
    for folder in p.parse_args(argv).haystacks:
        print(json.dumps(measure(folder)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
