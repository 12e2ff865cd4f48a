"""Funnel search against plain pruned search and exact full-D search: recall@10 and queries/s.

Usage::

    .venv/bin/python -m benchmarks.bench_funnel                        # N = 1M synthetic, D = 256, m = 32
    .venv/bin/python -m benchmarks.bench_funnel --n 200000 --factors 5,10,20
    .venv/bin/python -m benchmarks.bench_funnel --index demo/index     # a real index folder (its own m's)

Funnel search is the adaptive retrieval of Matryoshka Representation Learning
(Kusupati et al. 2022): the index at a small m returns ``k * factor`` candidates,
which are re-ranked exactly on the stored full-D vectors (``triclip.index.search.rerank``,
what ``Searcher(..., funnel=m)`` runs). Three ways to answer the same queries:

- ``full D``: exact search at D (Flat): the reference for recall and speed;
- ``plain m=M``: the index at m alone (Flat: exact at m; HNSW32 with ``--hnsw``);
- ``funnel M->D xF``: shortlist at m (Flat, or HNSW32 with ``--hnsw``), re-rank at D.

The funnel is exactly what the Searcher (and the app) runs: with a Flat index at m of at
most 50,000 vectors, the shortlist is one numpy matmul per chunk of 64 queries +
``argpartition`` (FAISS's heap is 1.7x slower there at 200 candidates; beyond ~100k
vectors FAISS is faster and searches), then the vectorised re-rank. So that both sides are
batched the same way, exact search is also timed as ``full D (blas)`` (off with
``--no-blas``): one matmul per chunk of 64 queries + a top-10 ``argpartition``. The speed
ratios (``x``) are over the faster of the two exact searches.

recall@10 is measured against exact full-D search, by id and with ties (a found row
whose exact score equals the 10th counts: see :func:`recall_with_ties`). Speed is measured two ways: a batch
(``--queries`` queries in one call) and single queries (``--single`` calls of one query,
the app's case). The methods run in alternating rounds and each reports its median
round, so a shared machine's load affects all of them alike; ratios are taken within
the same run.

Synthetic data (as ``benchmarks/bench_index.py``): unit rows around 10,000 cluster
centres with a power-law spectrum ``(d + 1) ** -decay`` (``--decay``, default 0.6: 83% of
the variance in the first D/8 dims, close to the 81% measured on the stored vectors of a
small ``lite`` openclipart demo index), so a prefix carries most of the information, as
in an importance-ordered embedding. Queries are fresh draws from the
same clusters. With ``--index``: the folder's full-D vectors are the base, its caption
vectors the queries (``--query-set``: distinct titles, default, the real query set of a
text->image search; ``val-titles``; or any caption, long descriptions and keyword lists
included), its FAISS index per m the plain and shortlist indexes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

# Idle OpenMP threads sleep instead of spinning (see benchmarks/bench_index.py); set before FAISS loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_index import prune, synthetic  # noqa: E402
from triclip.index import faiss_index as fi  # noqa: E402
from triclip.index.search import matmul_shortlist, rerank, shortlist_flat  # noqa: E402
from triclip.index.vectors import exact_topk  # noqa: E402

K = 10
TIE_TOL = 1e-5  # scores this close to the 10th count as tied (float32 sums differ by ~1e-7)
BLAS_CHUNK = 64  # queries per matmul of full D (blas), as triclip.index.search.SHORTLIST_CHUNK


@dataclass
class Result:
    """One method's numbers."""

    method: str  # full D, plain m, funnel m->D xF
    family: str  # faiss: the FAISS indexes and the Searcher's funnel; blas: exact search as numpy matmuls
    m: int  # dimensions of the index searched first
    candidates: int  # vectors re-ranked per query (0: none)
    recall_at_10: float  # against exact full-D search: share of its top-10 ids found
    recall_ties: float  # the same counting a hit whose full-D score ties the 10th (duplicate vectors)
    batch_qps: float  # queries/s, --queries at once (median round)
    single_qps: float  # queries/s, one query per call (median round)
    batch_speedup: float = 0.0  # batch_qps / the faster exact full D's (FAISS or blas)
    single_speedup: float = 0.0  # single_qps / the faster exact full D's


class Method:
    """A way to answer queries: ``run(queries (Q, D)) -> ids (Q, K)``."""

    def __init__(self, name: str, m: int, candidates: int, run, family: str = "faiss"):
        self.name, self.m, self.candidates, self.run, self.family = name, m, candidates, run, family
        self.batch: list[float] = []
        self.single: list[float] = []


def plain(index: faiss.Index, m: int):
    params = fi.search_parameters(index, K)
    return lambda q: index.search(prune(q, m) if m < q.shape[1] else q, K, params=params)[1]


def funnel(index: faiss.Index, m: int, base: np.ndarray, candidates: int):
    """What ``Searcher.search_vectors(..., funnel=m)`` runs: a small Flat shortlist as a chunked matmul
    (``triclip.index.search.matmul_shortlist``), any other index through FAISS; then ``rerank`` at D."""
    params = fi.search_parameters(index, candidates)
    flat = matmul_shortlist(index)

    def run(q: np.ndarray) -> np.ndarray:
        small = prune(q, m)
        if flat is not None:
            cand = shortlist_flat(flat, small, candidates)  # (Q, C)
        else:
            cand = index.search(small, candidates, params=params)[1]  # (Q, C)
        return rerank(base, q, cand, K)[1]

    return run


def blas_exact(base: np.ndarray, chunk: int = BLAS_CHUNK):
    """Exact full-D search batched like the funnel: one numpy matmul per chunk of queries + top-K ``argpartition``."""

    def run(q: np.ndarray) -> np.ndarray:
        return np.concatenate([exact_topk(base, q[s : s + chunk], K) for s in range(0, len(q), chunk)])  # (Q, K)

    return run


def time_rounds(methods: list[Method], queries: np.ndarray, singles: int, rounds: int) -> None:
    """Alternate the methods round by round; record queries/s of each (batch and single)."""
    for method in methods:
        method.run(queries[:4])  # warm-up
    for r in range(rounds):
        for method in methods if r % 2 == 0 else methods[::-1]:
            t0 = time.perf_counter()
            method.run(queries)
            method.batch.append(len(queries) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for row in queries[:singles]:
                method.run(row[None])
            method.single.append(singles / (time.perf_counter() - t0))
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)


def measure(base: np.ndarray, queries: np.ndarray, indexes: dict, ms: list[int], factors: list[int], args) -> list[Result]:
    """Build the methods over ``indexes`` ({(kind, m): index}), time them, score their recall."""
    dim = base.shape[1]
    full = Method("full D", dim, 0, plain(indexes[("Flat", dim)], dim))
    methods = [full]
    for (kind, m), index in indexes.items():
        if m == dim:
            continue
        methods.append(Method(f"plain m={m} ({kind})", m, 0, plain(index, m)))
        for f in factors:
            methods.append(Method(f"funnel {m}->D x{f} ({kind})", m, K * f, funnel(index, m, base, K * f)))
    if args.blas:
        methods.insert(1, Method("full D (blas)", dim, 0, blas_exact(base), "blas"))
    truth = full.run(queries)  # exact full-D top-10
    tenth = np.einsum("qd,qd->q", base[truth[:, -1]], queries)  # (Q,) the 10th exact score
    recalls = {}
    for mt in methods:
        found = mt.run(queries)
        recalls[id(mt)] = (fi.recall_at_k(found, truth), recall_with_ties(found, base, queries, tenth))
    time_rounds(methods, queries, args.single, args.rounds)
    out = []
    for mt in methods:
        batch, single = float(np.median(mt.batch)), float(np.median(mt.single))
        out.append(Result(mt.name, mt.family, mt.m, mt.candidates, *recalls[id(mt)], batch, single))
    exact = [r for r in out if r.candidates == 0 and r.m == dim]  # full D: FAISS, and blas
    best_batch, best_single = max(r.batch_qps for r in exact), max(r.single_qps for r in exact)
    for r in out:
        r.batch_speedup = r.batch_qps / best_batch
        r.single_speedup = r.single_qps / best_single
    return out


def recall_with_ties(found: np.ndarray, base: np.ndarray, queries: np.ndarray, tenth: np.ndarray) -> float:
    """Share of K found rows whose exact full-D score reaches the 10th exact score (within float error).

    An index with duplicate vectors (openclipart files repeated across category folders:
    8,097 images, 6,788 distinct vectors) has ties at the 10th place; which of the tied
    rows the exact search returns is arbitrary, and id-based recall charges the others
    as misses. Shapes: (Q, K), (N, D), (Q, D), (Q,).
    """
    valid = found >= 0
    scores = np.einsum("qkd,qd->qk", base[np.where(valid, found, 0)], queries)  # (Q, K)
    hits = (scores >= tenth[:, None] - TIE_TOL) & valid
    return float(np.minimum(hits.sum(axis=1), K).mean() / K)


def synthetic_case(args) -> tuple[np.ndarray, np.ndarray, dict]:
    rng = np.random.default_rng(args.seed)
    centres = rng.standard_normal((10_000, args.dim)).astype(np.float32)
    t0 = time.perf_counter()
    base = synthetic(args.n, args.dim, args.seed + 1, centres, args.decay)  # (N, D)
    queries = synthetic(args.queries, args.dim, args.seed + 2, centres, args.decay)  # (Q, D)
    print(f"data: {args.n} x {args.dim} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    indexes = {}
    for kind, m in [("Flat", args.dim), ("Flat", args.m)] + ([("HNSW32", args.m)] if args.hnsw else []):
        t0 = time.perf_counter()
        indexes[(kind, m)] = fi.build(prune(base, m) if m < args.dim else base, kind, seed=args.seed, progress=True)
        print(f"built {kind} at m={m} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return base, queries, indexes


def folder_case(args) -> tuple[np.ndarray, np.ndarray, dict]:
    from triclip.index.store import load_contents

    contents = load_contents(args.index)
    base = contents.vectors  # (N, D)
    queries = np.ascontiguousarray(query_vectors(contents, args.query_set, args.queries, args.seed))  # (Q, D)
    dim = base.shape[1]
    indexes = {("Flat", dim): fi.build(base, "Flat")}  # the exact reference, whatever the folder uses at D
    for m, index in contents.image_indexes.items():
        if m < dim and (args.m is None or m == args.m):
            kind = contents.manifest.get("factories", {}).get(str(m), "index")
            indexes[(kind, m)] = index
    return base, queries, indexes


def query_vectors(contents, query_set: str, limit: int, seed: int) -> np.ndarray:
    """Text->image queries from an index folder's own caption vectors. Shape: (Q, D).

    ``titles``: the first caption of each image (for openclipart its title), each distinct
    text once: what people type. ``val-titles``: the same for the images added from a
    source whose file name starts with ``val`` (the held-out split). ``captions``: any
    caption (titles, descriptions, keyword lists). At most ``limit``, sampled with
    ``seed``. Without caption vectors: a sample of the image vectors (image->image).
    """
    text, rows = contents.text_vectors, contents.text_rows
    if text is None:
        pool = np.arange(len(contents.vectors))
        return contents.vectors[_sample(pool, limit, seed)]
    if query_set == "captions":
        return text[_sample(np.arange(len(text)), limit, seed)]
    keep = np.ones(len(contents.meta), bool)  # image rows whose title counts
    if query_set == "val-titles":
        keep[:] = False
        start = 0
        for source in contents.manifest.get("sources", []):
            end = start + int(source.get("added", 0))
            keep[start:end] = os.path.basename(str(source.get("data", ""))).startswith("val")
            start = end
        if not keep.any():
            raise SystemExit(f"bench_funnel: no source of {len(contents.manifest.get('sources', []))} is named val*")
    first = {}  # distinct title -> its caption-vector row
    for j, (row, caption) in enumerate(np.asarray(rows).tolist()):
        if caption == 0 and keep[row]:
            first.setdefault(contents.meta[row]["captions"][0].strip().lower(), j)
    return text[_sample(np.array(sorted(first.values())), limit, seed)]


def _sample(pool: np.ndarray, limit: int, seed: int) -> np.ndarray:
    if len(pool) <= limit:
        return pool
    return np.sort(np.random.default_rng(seed).choice(pool, size=limit, replace=False))


def table(results: list[Result], header: str) -> str:
    lines = [header, f"{'method':<30} {'m':>4} {'cands':>6} {'recall@10':>9} {'w/ ties':>7} {'batch q/s':>10} {'x':>6} {'1-query q/s':>11} {'x':>6}"]
    for r in results:
        lines.append(
            f"{r.method:<30} {r.m:>4} {r.candidates:>6} {r.recall_at_10:>9.4f} {r.recall_ties:>7.4f} {r.batch_qps:>10.1f} {r.batch_speedup:>6.2f}"
            f" {r.single_qps:>11.1f} {r.single_speedup:>6.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="synthetic base vectors")
    p.add_argument("--dim", type=int, default=256, help="synthetic D")
    p.add_argument("--m", type=int, default=None, help="shortlist m (default: D/8; with --index: every m of the folder)")
    p.add_argument("--factors", default="10,20", help="funnel candidates per hit, comma-separated")
    p.add_argument("--queries", type=int, default=1000, help="queries in the batch (and for recall)")
    p.add_argument("--single", type=int, default=50, help="single-query calls timed per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (median kept)")
    p.add_argument("--hnsw", action="store_true", help="also an HNSW32 shortlist index at m (slow to build)")
    p.add_argument("--index", default=None, help="a triclip index folder instead of synthetic data")
    p.add_argument(
        "--query-set", choices=["titles", "val-titles", "captions"], default="titles",
        help="with --index: distinct titles (first captions, default), those of the val split, or any caption",
    )
    p.add_argument("--no-blas", dest="blas", action="store_false",
                   help="skip the blas family (exact and funnel as numpy matmuls, batched alike)")
    p.add_argument("--decay", type=float, default=0.6, help="synthetic spectrum: coordinate d scaled by (d+1)**-decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    factors = [int(f) for f in args.factors.split(",") if f.strip()]
    if args.index is None and args.m is None:
        args.m = args.dim // 8
    base, queries, indexes = folder_case(args) if args.index else synthetic_case(args)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = (
        f"N={len(base)} D={base.shape[1]} queries={len(queries)} single={args.single} rounds={args.rounds}"
        f" threads={faiss.omp_get_max_threads()} load={load:.1f}"
        f" source={f'{args.index} ({args.query_set})' if args.index else f'synthetic decay={args.decay}'}"
    )
    results = measure(base, queries, indexes, sorted({m for _, m in indexes}), factors, args)
    print(table(results, header))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"header": header, "results": [asdict(r) for r in results]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
