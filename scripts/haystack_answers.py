"""What an index built from a haystack answers: its real test captions' hits against the exact float top 10 over
every row of the haystack (streamed), one query at a time on one thread.

    python scripts/haystack_answers.py HAYSTACK INDEX [--queries 100] [--bytes 16]

HAYSTACK is a ``benchmarks.haystack build --out`` folder, INDEX the ``triclip index build --embeddings
HAYSTACK/embeddings`` folder. Prints, for the budget's codes (with the stages its build recorded) and for the float
index at D: the share of the exact top 10 found, t2i recall@10 of the real targets, p50 and p99 milliseconds; then
the exact search's own recall@10 and the process's peak RSS (which counts the pages of memory-mapped files).
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import time

import numpy as np

from benchmarks import haystack as hs
from triclip.codecs.threads import set_search_threads
from triclip.index.search import Searcher
from triclip.index.store import load_contents

K = 10


def exact_top(haystack: str, queries: np.ndarray) -> np.ndarray:
    """(Q, K) rows of the exact float top 10 over every shard of the haystack, streamed."""
    top = hs.TopK(queries, K)
    for shard in sorted(glob.glob(f"{haystack}/embeddings/shard-*/image.npy")):
        top.add(np.asarray(np.load(shard, mmap_mode="r"), np.float32))
    return top.i


def row_of(haystack: str, targets: int):
    """A hit's id -> its haystack row: the real rows first (their ids in the first shard), then ``haystack-{j}``."""
    first = {}
    with open(f"{haystack}/embeddings/shard-00000/meta.jsonl", encoding="utf-8") as f:
        for i, line in zip(range(targets), f):
            first[json.loads(line)["id"]] = i
    return lambda hit: targets + int(hit[len("haystack-"):]) if hit.startswith("haystack-") else first[hit]


def measure(searcher: Searcher, queries: np.ndarray, row, truth, positives, **how) -> str:
    searcher.search_vectors(queries[:5], K, **how)  # warm
    times, ids = [], []
    for q in queries:
        started = time.perf_counter()
        hits = searcher.search_vectors(q[None], K, **how)[0]
        times.append(time.perf_counter() - started)
        ids.append([row(h["id"]) for h in hits])
    held = np.mean([len(set(a) & set(b)) / K for a, b in zip(ids, truth)])
    recall = np.mean([bool(set(a) & p) for a, p in zip(ids, positives)])
    return (f"of exact top 10 {held:.3f}, t2i R@10 {recall:.3f}, p50 {1000 * np.median(times):.2f} ms,"
            f" p99 {1000 * np.percentile(times, 99):.2f} ms")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("haystack")
    parser.add_argument("index")
    parser.add_argument("--queries", type=int, default=100, help="the first N test captions")
    parser.add_argument("--bytes", type=int, default=16, help="the budget whose codes are searched")
    args = parser.parse_args(argv)
    info = json.loads(open(f"{args.haystack}/haystack.json", encoding="utf-8").read())
    queries = np.load(f"{args.haystack}/queries.npy").astype(np.float32)[: args.queries]
    lines = open(f"{args.haystack}/queries.jsonl", encoding="utf-8").read().splitlines()[: args.queries]
    positives = [set(json.loads(line)["targets"]) for line in lines]
    truth = exact_top(args.haystack, queries)
    row = row_of(args.haystack, info["targets"])
    searcher = Searcher(load_contents(args.index), None, None, None)
    set_search_threads(1)
    print(f"{args.bytes} B codes, recorded stages:", measure(searcher, queries, row, truth, positives, bytes=args.bytes))
    print("float index at D:", measure(searcher, queries, row, truth, positives))
    print("exact float t2i R@10", round(float(np.mean([bool(set(a) & p) for a, p in zip(truth, positives)])), 3))
    print("peak RSS MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)


if __name__ == "__main__":
    main()
