"""What the precision of a re-rank's rows (``index build --vectors``) keeps of the exact top 10 in a haystack.

    PYTHONPATH=. python scripts/rows_precision.py HAYSTACK [HAYSTACK ...]

HAYSTACK: a folder of ``benchmarks.haystack build`` (as ``benchmarks.haystack_peers`` writes one per seed:
``embeddings/``, ``queries.npy``, ``truth.npy``). Every image row is searched exactly, as float32 (the truth), and as
float16 and sq8 keep it (sq8 as a build keeps it, after its fixed rotation; "sq8 unrotated": without it,
``benchmarks.vectors_dtype.kept_precisions``); prints per folder the share of
the exact float top 10 each keeps: the most any re-rank by such rows can hold, and (from ``queries.jsonl``) each
one's recall@10 of the real test targets. Reads the rows a shard at a time
(10M rows: ~14 min on 2 cores, 1.15 GB RSS). Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from benchmarks.vectors_dtype import precisions
from triclip.core.progress import progress
from triclip.index.budgets import overlap, recall_at_k
from triclip.index.vectors import SQ8_SAMPLE, ShardVectors, exact_topk_of


def kept_by_precision(base: ShardVectors | np.ndarray, queries: np.ndarray, truth: np.ndarray,
                      positives: list[set[int]] | None = None) -> dict[str, float]:
    """Share of ``truth`` (Q, k), the exact top k of ``queries`` (Q, D) over ``base`` (N, D: shards or an array),
    that exact search over each precision's rows keeps; a part at a time (N x D is never held whole). With
    ``positives`` (per query its target rows), also each precision's recall@k ("recall@10 sq8")."""
    base = base if isinstance(base, ShardVectors) else ShardVectors.of([np.asarray(base, np.float32)])
    k = truth.shape[1]
    keeps = {"float32": lambda x: np.asarray(x, np.float32), **precisions(base.head(SQ8_SAMPLE).full())}
    out = {}
    for name, keep in keeps.items():
        parts = ((np.arange(lo, lo + len(part)), keep(np.asarray(part, np.float32)))  # (n, D) as kept
                 for part, lo in zip(base.parts, base.offsets[:-1].tolist()))
        got = exact_topk_of(progress(parts, total=len(base.parts), desc=name, unit="part", disable=None), queries, k)
        out[name] = round(overlap(got, truth), 4)
        if positives is not None:
            out[f"recall@{k} {name}"] = round(recall_at_k(got, positives, k), 4)
    return out


def measure(folder: str) -> dict:
    shards = len([d for d in os.listdir(os.path.join(folder, "embeddings")) if d.startswith("shard-")])
    base = ShardVectors.open(os.path.join(folder, "embeddings"), shards, "image")
    queries, truth = np.load(os.path.join(folder, "queries.npy")), np.load(os.path.join(folder, "truth.npy"))
    lines = os.path.join(folder, "queries.jsonl")  # the real test targets, where the haystack has them
    positives = ([set(json.loads(line)["targets"]) for line in open(lines, encoding="utf-8")]
                 if os.path.isfile(lines) else None)
    return {"haystack": folder, "rows": base.count, **kept_by_precision(base, queries, truth, positives)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("haystacks", nargs="+")
    for folder in p.parse_args(argv).haystacks:
        print(json.dumps(measure(folder)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
