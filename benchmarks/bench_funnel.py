"""Funnel search against plain pruned search and exact full-D search: recall@10 and queries/s.

Usage::

    .venv/bin/python -m benchmarks.bench_funnel                        # N = 1M synthetic, D = 256, m = 32
    .venv/bin/python -m benchmarks.bench_funnel --n 200000 --factors 5,10,20
    .venv/bin/python -m benchmarks.bench_funnel --index demo/index     # a real index folder (its own m's)

Funnel search is the adaptive retrieval of Matryoshka Representation Learning
(Kusupati et al. 2022): the index at a small m returns ``k * factor`` candidates,
which are re-ranked exactly on the stored full-D vectors (``index.search.rerank``,
what ``Searcher(..., funnel=m)`` runs). Three ways to answer the same queries:

- ``full D``: exact search at D (Flat): the reference for recall and speed;
- ``plain m=M``: the index at m alone (Flat: exact at m; HNSW32 with ``--hnsw``);
- ``funnel M->D xF``: shortlist at m (Flat, or HNSW32 with ``--hnsw``), re-rank at D.

recall@10 is measured against exact full-D search. Speed is measured two ways: a batch
(``--queries`` queries in one call) and single queries (``--single`` calls of one query,
the app's case). The methods run in alternating rounds and each reports its median
round, so a shared machine's load affects all of them alike; the ratio column is the
speed over ``full D`` in the same run.

Synthetic data (as ``benchmarks/bench_index.py``): unit rows around 10,000 cluster
centres with a power-law spectrum ``(d + 1) ** -decay`` (``--decay``, default 0.6: 83% of
the variance in the first D/8 dims, close to the 81% measured on the stored vectors of a
small ``lite`` openclipart demo index), so a prefix carries most of the information, as
in an importance-ordered embedding. Queries are fresh draws from the
same clusters. With ``--index``: the folder's full-D vectors are the base, its caption
vectors (else a sample of its image vectors) the queries, its FAISS index per m the
plain and shortlist indexes.
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
from index import faiss_index as fi  # noqa: E402
from index.search import rerank  # noqa: E402

K = 10


@dataclass
class Result:
    """One method's numbers."""

    method: str  # full D, plain m, funnel m->D xF
    m: int  # dimensions of the index searched first
    candidates: int  # vectors re-ranked per query (0: none)
    recall_at_10: float  # against exact full-D search
    batch_qps: float  # queries/s, --queries at once (median round)
    single_qps: float  # queries/s, one query per call (median round)
    batch_speedup: float = 0.0  # batch_qps / full D's
    single_speedup: float = 0.0  # single_qps / full D's


class Method:
    """A way to answer queries: ``run(queries (Q, D)) -> ids (Q, K)``."""

    def __init__(self, name: str, m: int, candidates: int, run):
        self.name, self.m, self.candidates, self.run = name, m, candidates, run
        self.batch: list[float] = []
        self.single: list[float] = []


def plain(index: faiss.Index, m: int):
    params = fi.search_parameters(index, K)
    return lambda q: index.search(prune(q, m) if m < q.shape[1] else q, K, params=params)[1]


def funnel(index: faiss.Index, m: int, base: np.ndarray, candidates: int):
    params = fi.search_parameters(index, candidates)

    def run(q: np.ndarray) -> np.ndarray:
        _, cand = index.search(prune(q, m), candidates, params=params)  # (Q, C)
        return rerank(base, q, cand, K)[1]

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
    truth = full.run(queries)  # exact full-D top-10
    recalls = {id(mt): fi.recall_at_k(mt.run(queries), truth) for mt in methods}
    time_rounds(methods, queries, args.single, args.rounds)
    out = []
    for mt in methods:
        out.append(Result(mt.name, mt.m, mt.candidates, recalls[id(mt)], float(np.median(mt.batch)), float(np.median(mt.single))))
    for r in out:
        r.batch_speedup = r.batch_qps / out[0].batch_qps
        r.single_speedup = r.single_qps / out[0].single_qps
    return out


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
    from index.store import load_contents

    contents = load_contents(args.index)
    base = contents.vectors  # (N, D)
    pool = contents.text_vectors if contents.text_vectors is not None else base
    rows = np.random.default_rng(args.seed).choice(len(pool), size=min(args.queries, len(pool)), replace=False)
    queries = np.ascontiguousarray(pool[np.sort(rows)])  # (Q, D)
    dim = base.shape[1]
    indexes = {("Flat", dim): fi.build(base, "Flat")}  # the exact reference, whatever the folder uses at D
    for m, index in contents.image_indexes.items():
        if m < dim and (args.m is None or m == args.m):
            kind = contents.manifest.get("factories", {}).get(str(m), "index")
            indexes[(kind, m)] = index
    return base, queries, indexes


def table(results: list[Result], header: str) -> str:
    lines = [header, f"{'method':<28} {'m':>4} {'cands':>6} {'recall@10':>9} {'batch q/s':>10} {'x':>6} {'1-query q/s':>11} {'x':>6}"]
    for r in results:
        lines.append(
            f"{r.method:<28} {r.m:>4} {r.candidates:>6} {r.recall_at_10:>9.4f} {r.batch_qps:>10.1f} {r.batch_speedup:>6.2f}"
            f" {r.single_qps:>11.1f} {r.single_speedup:>6.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="synthetic base vectors")
    p.add_argument("--dim", type=int, default=256, help="synthetic D")
    p.add_argument("--m", type=int, default=None, help="shortlist m (default: D/8; with --index: every m of the folder)")
    p.add_argument("--factors", default="10,20", help="funnel candidates per hit, comma-separated")
    p.add_argument("--queries", type=int, default=1000, help="queries in the batch (and for recall)")
    p.add_argument("--single", type=int, default=50, help="single-query calls timed per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (median kept)")
    p.add_argument("--hnsw", action="store_true", help="also an HNSW32 shortlist index at m (slow to build)")
    p.add_argument("--index", default=None, help="a triclip index folder instead of synthetic data")
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
        f" source={args.index or f'synthetic decay={args.decay}'}"
    )
    results = measure(base, queries, indexes, sorted({m for _, m in indexes}), factors, args)
    print(table(results, header))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"header": header, "results": [asdict(r) for r in results]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
