"""Inner codes of inverted lists: what each holds of the exact top 10, on a seeded subset of a haystack.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/ivf_inner_codes.py HAYSTACK CODE_FILE b8 [--rows 200000]

HAYSTACK: a ``benchmarks.haystack build`` folder (``npy/`` shards, ``val_queries.npy``, ``queries.npy``); CODE_FILE:
an ``ivf`` code of a build on it (``v*/image.b8.codec``), whose coarse centroids (turned back from its OPQ rotation
to the served space) every row's lists share, projected by each row's own transform. One seeded draw of rows; the
exact top 10 of the val and test captions among them by brute force; each row a FAISS ``IndexIVF*`` over them,
its inner code trained on ``fit`` seeded rows (OPQ: on the rows; the codebooks: on their residuals), searched at
each nprobe of :data:`LADDER`. Prints one JSON line per row: the share of the exact top 10 per nprobe, ``ms16``
(ms a query at nprobe 16, batch search, one thread) and ``fit_s`` (fit + fill seconds).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import faiss
import numpy as np

LADDER = (1, 2, 4, 8, 16, 64, 4096)  # nprobe of each column (4096: every list)
SHARD = 200_000  # rows per haystack shard
# name, transform (opq: OPQ{M}_{d} on all 256; popq: OPQ on the prefix d; prefix: the prefix d; none), d, inner, M,
# nbits, fit rows
SETS = {
    "b8": [("opq8x8 m=256 fit5k", "opq", 256, "pq", 8, 8, 5000), ("opq8x8 m=256 fit50k", "opq", 256, "pq", 8, 8, 50000),
           ("OPQ8_128,PQ8", "opq", 128, "pq", 8, 8, 50000), ("OPQ8_64,PQ8", "opq", 64, "pq", 8, 8, 50000),
           ("OPQ8_56,PQ8", "opq", 56, "pq", 8, 8, 50000), ("OPQ8_32,PQ8", "opq", 32, "pq", 8, 8, 50000),
           ("OPQ8_56,PQ8 fit5k", "opq", 56, "pq", 8, 8, 5000), ("prefix32 PQ8", "prefix", 32, "pq", 8, 8, 50000),
           ("prefix64 PQ8", "prefix", 64, "pq", 8, 8, 50000), ("prefix128 PQ8", "prefix", 128, "pq", 8, 8, 50000),
           ("prefix32 OPQ8", "popq", 32, "pq", 8, 8, 50000), ("prefix64 OPQ8", "popq", 64, "pq", 8, 8, 50000),
           ("prefix128 OPQ8", "popq", 128, "pq", 8, 8, 50000), ("PQ16x4fs m=256", "none", 256, "pqfs", 16, 4, 50000),
           ("OPQ16_64,PQ16x4fs", "opq", 64, "pqfs", 16, 4, 50000),
           ("RQ8x8 m=256 fit10k", "none", 256, "rq", 8, 8, 10000)],
    "b16": [("opq16x8 m=256 fit5k", "opq", 256, "pq", 16, 8, 5000),
            ("opq16x8 m=256 fit50k", "opq", 256, "pq", 16, 8, 50000), ("OPQ16_64,PQ16", "opq", 64, "pq", 16, 8, 50000),
            ("prefix128 OPQ16", "popq", 128, "pq", 16, 8, 50000), ("PQ32x4fs m=256", "none", 256, "pqfs", 32, 4, 50000),
            ("RQ16x8 m=256 fit10k", "none", 256, "rq", 16, 8, 10000),
            ("OPQ16_128,PQ16", "opq", 128, "pq", 16, 8, 50000)],
    "extra": [("RQ8x8 m=256 fit10k", "none", 256, "rq", 8, 8, 10000),
              ("prefix64 PQ8 fit5k", "prefix", 64, "pq", 8, 8, 5000)],
    "rows": [("opq8x8 m=256 fit20k", "opq", 256, "pq", 8, 8, 20000),
             ("opq8x8 m=256 fit100k", "opq", 256, "pq", 8, 8, 100000)],
}


@dataclass
class InnerConfig:
    haystack: str  # a benchmarks.haystack build folder
    code_file: str  # an ivf code built on it: its coarse centroids are shared
    rows_set: str  # a key of SETS
    rows: int = 200_000  # haystack rows drawn (seed 0)
    only: tuple = ()  # name substrings of the rows run (empty: all)


def load(cfg: InnerConfig, rng) -> tuple[np.ndarray, np.ndarray]:
    """(rows drawn from the shards (n, D), val + test captions (Q, D)), float32."""
    total = json.load(open(f"{cfg.haystack}/haystack.json"))["config"]["n"]
    rows = np.sort(rng.choice(total, cfg.rows, replace=False))
    parts = []
    for s in range(-(-total // SHARD)):
        shard = np.load(f"{cfg.haystack}/npy/{s:04d}.npy", mmap_mode="r")
        parts.append(np.asarray(shard[rows[(rows >= s * SHARD) & (rows < (s + 1) * SHARD)] - s * SHARD], np.float32))
    q = np.vstack([np.load(f"{cfg.haystack}/val_queries.npy"), np.load(f"{cfg.haystack}/queries.npy")])
    return np.ascontiguousarray(np.vstack(parts)), np.ascontiguousarray(q, np.float32)


def centroids(code_file: str) -> np.ndarray:
    """The code's coarse centroids in the served space (nlist, D): its last linear transform is OPQ's rotation."""
    index = faiss.read_index(code_file)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    chain = [faiss.downcast_VectorTransform(index.chain.at(i)) for i in range(index.chain.size())]
    turn = [t for t in chain if isinstance(t, faiss.LinearTransform)][-1]
    a = faiss.vector_to_array(turn.A).reshape(turn.d_out, turn.d_in)  # rotated = A x
    return np.ascontiguousarray(ivf.quantizer.reconstruct_n(0, ivf.nlist) @ a)


def unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.where(n == 0, 1, n), np.float32)


def transform(kind: str, d: int, sub: int, train: np.ndarray):
    """(map of vectors, map of centroids): none, the prefix d (vectors re-normalised), or an OPQ rotation to d."""
    if kind == "none":
        return (lambda v: v), (lambda c: c)
    if kind == "prefix":
        return (lambda v: unit(v[:, :d])), (lambda c: np.ascontiguousarray(c[:, :d]))
    opq = faiss.OPQMatrix(256 if kind == "opq" else d, sub, d)
    opq.niter, opq.pq = 20, faiss.ProductQuantizer(d, sub, 8)
    opq.referenced_objects = [opq.pq]
    if kind == "opq":
        opq.train(train)
        return opq.apply, opq.apply
    opq.train(unit(train[:, :d]))
    return (lambda v: opq.apply(unit(v[:, :d]))), (lambda c: opq.apply(np.ascontiguousarray(c[:, :d])))


def lists(inner: str, d: int, sub: int, nbits: int, coarse: np.ndarray):
    """An IndexIVF* over ``coarse``'s centroids (trained): its codes not yet."""
    quantiser = faiss.IndexFlatIP(d)
    quantiser.add(np.ascontiguousarray(coarse, np.float32))
    ip = faiss.METRIC_INNER_PRODUCT
    if inner == "rq":
        ivf = faiss.IndexIVFResidualQuantizer(quantiser, d, len(coarse), sub, nbits, ip)
        ivf.rq.search_type = faiss.AdditiveQuantizer.ST_LUT_nonorm
    elif inner == "pqfs":
        ivf = faiss.IndexIVFPQFastScan(quantiser, d, len(coarse), sub, 4, ip)
    else:
        ivf = faiss.IndexIVFPQ(quantiser, d, len(coarse), sub, nbits, ip)
        ivf.do_polysemous_training = False
    if hasattr(ivf, "pq"):
        ivf.pq.cp.min_points_per_centroid = 1
    ivf.referenced_objects = [quantiser]
    return ivf


def run(row, x, q, coarse, truth, rng) -> dict:
    """One row: fit, fill, search at every nprobe of :data:`LADDER`."""
    name, kind, d, inner, sub, nbits, fit = row
    start = time.time()
    train = x[rng.choice(len(x), fit, replace=False)]
    fx, fc = transform(kind, d, sub if inner != "pqfs" else sub // 2, train)
    ivf = lists(inner, d, sub, nbits, fc(coarse))
    ivf.train(np.ascontiguousarray(fx(train)))
    ivf.add(np.ascontiguousarray(fx(x)))
    out, qt = {"name": name, "code_size": int(ivf.code_size), "fit_s": round(time.time() - start, 1)}, fx(q)
    for p in LADDER:
        ivf.nprobe = p
        t = time.time()
        found = ivf.search(np.ascontiguousarray(qt), 10)[1]  # (Q, 10)
        out["ms16" if p == 16 else "_"] = round((time.time() - t) / len(q) * 1e3, 3)
        out[str(p)] = round(float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, truth)])), 4)
    out.pop("_")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("haystack")
    parser.add_argument("code_file")
    parser.add_argument("rows_set", choices=sorted(SETS))
    parser.add_argument("--rows", type=int, default=200_000, help="haystack rows drawn (seed 0)")
    parser.add_argument("--only", nargs="*", default=[], help="name substrings of the rows run")
    args = parser.parse_args(argv)
    cfg = InnerConfig(args.haystack, args.code_file, args.rows_set, args.rows, tuple(args.only))
    rng = np.random.default_rng(0)
    x, q = load(cfg, rng)
    coarse = centroids(cfg.code_file)
    exact = faiss.IndexFlatIP(x.shape[1])
    exact.add(x)
    truth = exact.search(q, 10)[1]  # (Q, 10)
    for row in SETS[cfg.rows_set]:
        if not cfg.only or any(o in row[0] for o in cfg.only):
            print(json.dumps(run(row, x, q, coarse, truth, rng)), flush=True)


if __name__ == "__main__":
    main()
