"""The coarse quantiser at many lists: what a build spends training the lists and assigning each row to one.

Usage::

    .venv/bin/python -m benchmarks.bench_coarse WORK/n1000000-seed0 --lists 16384,32768 [--flat-train]

A haystack folder (``benchmarks.haystack build``: its shards' rows) and the val captions of
``benchmarks.haystack_peers`` (``--queries``, default: the folder's ``val_queries.npy``), their exact top 10 over
the rows found here.
Per nlist: centroids trained on 64 rows a list by two-level k-means (``triclip.codecs.ivf.two_level_centroids``,
what a build uses from ``LARGE_LISTS`` lists on) and, with ``--flat-train``, by FAISS's flat k-means (below it).
Per set of centroids and assigner (the flat scan; triclip's ``ivf.assigner``, an IVF over the centroids scanning
``--probes`` of its groups; FAISS's HNSW over them): microseconds a row to assign 200,000 rows (both threads),
the share of rows put in the list the flat scan picks, and what the nprobe lists nearest each val caption (ranked
by the flat scan, as queries are) hold of its exact top 10.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from triclip.codecs import ivf
from triclip.codecs.base import METRIC

NPROBES = (8, 16, 32, 64)


@dataclass
class CoarseConfig:
    haystack: str  # a haystack folder (benchmarks.haystack build): embeddings/shard-*/image.npy
    queries: str = ""  # (Q, D) val captions (benchmarks.haystack_peers' val_queries.npy; "": the folder's)
    lists: list[int] = field(default_factory=lambda: [16384])  # nlist values measured
    probes: list[int] = field(default_factory=lambda: [4, 8, 16])  # groups the IVF assigner scans
    flat_train: bool = False  # also train FAISS's flat k-means (minutes at 16,384 lists)
    seed: int = 0


def assigners(centroids: np.ndarray, probes: list[int]) -> dict[str, faiss.Index]:
    """name -> an index over ``centroids`` whose nearest neighbour is a row's list."""
    flat = faiss.IndexFlatIP(centroids.shape[1])
    flat.add(centroids)
    out = {"flat": flat}
    grouped = ivf.assigner(centroids)  # trained once; a clone per number of groups scanned
    for p in probes:
        out[f"ivf{ivf.groups_for(len(centroids))} p{p}"] = clone = faiss.clone_index(grouped)
        clone.nprobe = p
    for ef in (16, 32):
        graph = faiss.IndexHNSWFlat(centroids.shape[1], 32, METRIC)
        graph.add(centroids)
        graph.hnsw.efSearch = ef
        out[f"hnsw32 ef{ef}"] = graph
    return out


def measure(centroids: np.ndarray, rows: np.ndarray, timed: np.ndarray, queries: np.ndarray, truth: np.ndarray,
            probes: list[int]) -> list[dict]:
    """One row per assigner over ``centroids`` (nlist, D): us a row, agreement with flat, lists' hold per nprobe."""
    found = assigners(centroids, probes)
    ranked = found["flat"].search(queries, max(NPROBES))[1]  # (Q, 64) lists nearest each query, exactly
    out, exact = [], None
    for name, index in found.items():
        start = time.perf_counter()
        index.search(timed, 1)
        us = 1e6 * (time.perf_counter() - start) / len(timed)
        lists = index.search(rows, 1)[1][:, 0]  # (N,) each row's list
        exact = lists if exact is None else exact
        held = {p: float(np.mean([np.isin(lists[t], r[:p]).mean() for t, r in zip(truth, ranked)])) for p in NPROBES}
        out.append({"assigner": name, "us_per_row": round(us, 1), "same_list": round(float(np.mean(lists == exact)), 4),
                    **{f"held_p{p}": round(h, 3) for p, h in held.items()}})
    return out


def run(cfg: CoarseConfig) -> list[dict]:
    root = Path(cfg.haystack)
    rows = np.concatenate([np.load(p) for p in sorted(root.glob("embeddings/shard-*/image.npy"))]).astype(np.float32)
    queries = np.load(cfg.queries or root / "val_queries.npy").astype(np.float32)
    truth = faiss.knn(queries, rows, 10, metric=METRIC)[1]  # (Q, 10) exact float top 10 over every row
    rng = np.random.default_rng(cfg.seed)
    timed = rows[rng.choice(len(rows), min(len(rows), 200_000), replace=False)]
    records = []
    for nlist in cfg.lists:
        train = rows[np.sort(rng.choice(len(rows), min(len(rows), 64 * nlist), replace=False))]
        trained = {"two-level": lambda: ivf.two_level_centroids(train, nlist, 10, cfg.seed)}
        if cfg.flat_train:
            trained["flat"] = lambda: _flat_centroids(train, nlist, cfg.seed)
        for how, fit in trained.items():
            start = time.perf_counter()
            centroids = fit()
            train_s = round(time.perf_counter() - start, 1)
            for rec in measure(centroids, rows, timed, queries, truth, cfg.probes):
                records.append({"nlist": nlist, "kmeans": how, "train_s": train_s, **rec})
                print(records[-1], flush=True)
    return records


def _flat_centroids(train: np.ndarray, nlist: int, seed: int) -> np.ndarray:
    """FAISS IVF's own coarse training (flat k-means, 10 iterations), as a build below LARGE_LISTS lists does."""
    index = faiss.index_factory(train.shape[1], f"IVF{nlist},Flat", METRIC)
    index.cp.seed, index.cp.min_points_per_centroid = seed, 1
    index.train(train)
    return faiss.downcast_index(index.quantizer).reconstruct_n(0, nlist)


def main(argv: list[str] | None = None) -> None:
    ints = lambda t: [int(v) for v in t.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("haystack")
    parser.add_argument("--queries", default="")
    parser.add_argument("--lists", type=ints, default=CoarseConfig("").lists)
    parser.add_argument("--probes", type=ints, default=CoarseConfig("").probes)
    parser.add_argument("--flat-train", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    records = run(CoarseConfig(args.haystack, args.queries, args.lists, args.probes, args.flat_train, args.seed))
    print("| nlist | k-means | train s | assigner | us a row | same list as flat | "
          + " | ".join(f"held, nprobe {p}" for p in NPROBES) + " |")
    for r in records:
        print(f"| {r['nlist']} | {r['kmeans']} | {r['train_s']} | {r['assigner']} | {r['us_per_row']} | "
              f"{r['same_list']:.4f} | " + " | ".join(f"{r[f'held_p{p}']:.3f}" for p in NPROBES) + " |")


if __name__ == "__main__":
    main()
