"""Index speed at top-m pruning: queries/s, single-query latency, recall@10 and bytes per vector.

Usage::

    .venv/bin/python benchmarks/bench_index.py --n 1000000            # the full table (slow: HNSW build)
    .venv/bin/python benchmarks/bench_index.py --n 100000 --json out.json
    .venv/bin/python benchmarks/bench_index.py --n 1000000 --factories Flat,IVF-PQ --hnsw-n 200000

Data: a synthetic stand-in for D = 512 image embeddings (no trained model of that size
exists offline), with a realistic decaying spectrum and cluster structure:

    latent = centre[label] + 0.5 * noise        # 10,000 clusters, all N(0, 1) in R^D
    x_d    = latent_d * (d + 1) ** -0.6          # power-law spectrum, like real CLIP features
    z      = x / ||x||                           # unit rows

Dimension d's variance decreases with d, so the dimensions are already in importance
order; the top-m embedding of the benchmark is ``normalize(z[:, :m])`` (the ``sqrt(w)``
weights of a tri-factor model are folded into the spectrum). Queries are fresh draws
from the same clusters, so each has true neighbours in the base.

For each m in D, D/2, D/4, D/8 and each index (Flat; HNSW32; IVF{sqrt N},PQ{m/4}):
build seconds, batch throughput (queries/s over ``--queries`` queries at once), p50/p99
latency of ``--single`` single queries (one query per call), recall@10 against exact
search at the same m (Flat) and against exact search at m = D, and bytes per vector.
The last lines print the Flat speed-up of m = D/8 over m = D, measured side by side in
alternating rounds of this run.

Exact (Flat) search in FAISS takes one of two paths: a SIMD scan per query (memory-bound:
every query streams the whole base) when ``queries x m < distance_compute_blas_threshold``
(128,000 by default), else blocked BLAS matrix products (the base is streamed once per
4,096 queries). So the batch column depends on the batch size: 1,000 queries use BLAS at
m = 512 but the per-query scan at m = 64. ``--blas-threshold`` changes the switch point.
All runs use FAISS's default OpenMP threads (the machine's cores) with
``OMP_WAIT_POLICY=PASSIVE`` unless set otherwise (see below); the header prints the load
average, since other processes on a shared machine change every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

# Idle OpenMP threads sleep instead of spinning. On a shared, oversubscribed CPU, spinning
# threads make FAISS's parallel loops many times slower (measured here: PQ training 80 s
# spinning vs 2.6 s passive, 2 threads, load 10). Set before FAISS loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from triclip.index import faiss_index as fi  # noqa: E402

K = 10  # recall@K and hits per query
CHUNK = 100_000  # rows generated at once


@dataclass
class Row:
    """One measured (index, m) cell of the table."""

    factory: str  # FAISS factory string
    n: int  # vectors in the index
    m: int  # dimensions kept
    build_s: float  # training + adding, seconds
    batch_qps: float  # queries/s, all queries in one call
    p50_ms: float  # single-query latency, median
    p99_ms: float  # single-query latency, 99th percentile
    single_qps: float  # 1 / mean single-query latency
    recall_same_m: float  # recall@10 against exact search at this m
    recall_full_d: float  # recall@10 against exact search at m = D
    bytes_per_vector: float  # serialized index size / n


def synthetic(n: int, dim: int, seed: int, centres: np.ndarray, decay: float = 0.6) -> np.ndarray:
    """Unit rows with a power-law spectrum around ``centres`` (see the module docstring). Shape: (n, dim)."""
    rng = np.random.default_rng(seed)
    scale = ((np.arange(dim, dtype=np.float32) + 1) ** -decay).astype(np.float32)  # (D,)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, CHUNK):
        rows = min(CHUNK, n - start)
        latent = centres[rng.integers(0, len(centres), rows)] + 0.5 * rng.standard_normal((rows, dim), dtype=np.float32)
        x = latent * scale  # (rows, D)
        out[start : start + rows] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def prune(z: np.ndarray, m: int) -> np.ndarray:
    """Top-m embedding of the stand-in: first m dims, re-normalised. Shape: (N, D) -> (N, m)."""
    out = np.ascontiguousarray(z[:, :m])
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


def factory_for(name: str, n: int, m: int) -> str:
    """Benchmark name -> FAISS factory string at size n and dimension m."""
    return {"Flat": "Flat", "HNSW32": "HNSW32", "IVF-PQ": fi.ivf_pq_factory(n, m)}[name]


def exact(base: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Exact top-K ids with a Flat index (batched BLAS). Shape: (Q, K)."""
    index = faiss.IndexFlatIP(base.shape[1])
    index.add(base)
    return index.search(queries, K)[1]


def measure(index: faiss.Index, queries: np.ndarray, singles: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Batch queries/s, single-query latencies in ms (Q,) and the batch's ids (Q, K)."""
    params = fi.search_parameters(index, K)  # per call, as triclip.index.search.Searcher does
    index.search(queries[:8], K, params=params)  # warm-up
    start = time.perf_counter()
    _, ids = index.search(queries, K, params=params)
    batch_qps = len(queries) / (time.perf_counter() - start)
    latencies = []
    for row in queries[:singles]:
        t0 = time.perf_counter()
        index.search(row[None], K, params=params)
        latencies.append(time.perf_counter() - t0)
    return batch_qps, np.array(latencies) * 1e3, ids


def run_cell(name: str, base: np.ndarray, queries: np.ndarray, singles: int, truth: dict, full_dim: int) -> Row:
    """Build one index on ``base`` (n, m), measure it with ``queries`` (Q, m), score it against exact search.

    ``truth`` caches exact ids by ``(n, m)`` and ``(n, "D")`` (m = D); a Flat cell is
    exact, so it fills the cache instead of a second exhaustive pass.
    """
    n, m = base.shape
    factory = factory_for(name, n, m)
    start = time.perf_counter()
    index = fi.build(base, factory, progress=False)
    build_s = time.perf_counter() - start
    batch_qps, lat_ms, ids = measure(index, queries, singles)
    if name == "Flat":
        truth.setdefault((n, m), ids)
        if m == full_dim:
            truth.setdefault((n, "D"), ids)
    row = Row(
        factory=factory,
        n=n,
        m=m,
        build_s=build_s,
        batch_qps=batch_qps,
        p50_ms=float(np.percentile(lat_ms, 50)),
        p99_ms=float(np.percentile(lat_ms, 99)),
        single_qps=float(1e3 / lat_ms.mean()),
        recall_same_m=fi.recall_at_k(ids, _truth(truth, base, queries)),
        recall_full_d=fi.recall_at_k(ids, truth[(n, "D")]),
        bytes_per_vector=fi.bytes_per_vector(index),
    )
    del index
    return row


def _truth(cache: dict, base: np.ndarray, queries: np.ndarray) -> np.ndarray:
    key = base.shape
    if key not in cache:
        cache[key] = exact(base, queries)
    return cache[key]


def side_by_side(
    base: np.ndarray, queries: np.ndarray, dims: tuple[int, int], rounds: int, batch: int, singles: int
) -> dict:
    """Flat at two m, measured in alternating rounds (load drift hits both alike); medians of the rounds."""
    indexes = {}
    for m in dims:
        indexes[m] = faiss.IndexFlatIP(m)
        indexes[m].add(prune(base, m))
    qs = {m: prune(queries, m) for m in dims}
    results: dict[int, dict[str, list[float]]] = {m: {"batch": [], "single": []} for m in dims}
    for r in range(rounds):
        for m in dims if r % 2 == 0 else dims[::-1]:
            batch_qps, lat_ms, _ = measure(indexes[m], qs[m][:batch], singles)
            results[m]["batch"].append(batch_qps)
            results[m]["single"].append(1e3 / lat_ms.mean())
    return {m: {key: float(np.median(vals)) for key, vals in res.items()} for m, res in results.items()}


def print_row(row: Row) -> None:
    print(
        f"{row.factory:>16} {row.n:>9,} {row.m:>4} {row.build_s:>8.1f} {row.batch_qps:>10.1f} {row.p50_ms:>8.2f}"
        f" {row.p99_ms:>8.2f} {row.single_qps:>10.1f} {row.recall_same_m:>9.3f} {row.recall_full_d:>9.3f}"
        f" {row.bytes_per_vector:>9.1f}",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="vectors in the index")
    p.add_argument("--dim", type=int, default=512, help="D of the stand-in")
    p.add_argument("--dims", default=None, help="m values (default: D, D/2, D/4, D/8)")
    p.add_argument("--factories", default="Flat,HNSW32,IVF-PQ", help="subset of Flat,HNSW32,IVF-PQ")
    p.add_argument("--hnsw-n", type=int, default=None, help="index only the first N vectors for HNSW32 (its build is slow)")
    p.add_argument("--queries", type=int, default=1000, help="queries of the batch measurement")
    p.add_argument("--single", type=int, default=200, help="single queries timed one by one")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds of the Flat m=D vs m=D/8 comparison (0: skip)")
    p.add_argument("--ratio-queries", type=int, default=200, help="batch size of each comparison round")
    p.add_argument("--ratio-single", type=int, default=40, help="single queries of each comparison round")
    p.add_argument(
        "--blas-threshold",
        type=int,
        default=None,
        help="faiss distance_compute_blas_threshold: exact search uses BLAS when queries x m >= it (faiss: 128000)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    args.dims = [int(x) for x in args.dims.split(",")] if args.dims else [args.dim // f for f in (1, 2, 4, 8)]
    args.factories = [f.strip() for f in args.factories.split(",") if f.strip()]
    bad = set(args.factories) - {"Flat", "HNSW32", "IVF-PQ"}
    if bad or args.n < 1 or any(not 1 <= m <= args.dim for m in args.dims):
        p.error(f"bad --factories {sorted(bad)} / --n / --dims")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.blas_threshold is not None:
        faiss.cvar.distance_compute_blas_threshold = args.blas_threshold
    rng = np.random.default_rng(args.seed)
    centres = rng.standard_normal((10_000, args.dim), dtype=np.float32)
    t0 = time.perf_counter()
    base = synthetic(args.n, args.dim, args.seed + 1, centres)
    queries = synthetic(args.queries, args.dim, args.seed + 2, centres)
    print(
        f"# synthetic D={args.dim} N={args.n:,} queries={args.queries} singles={args.single}"
        f" threads={faiss.omp_get_max_threads()} OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
        f" blas_threshold={faiss.cvar.distance_compute_blas_threshold}"
        f" load={os.getloadavg()[0]:.2f} faiss={faiss.__version__}"
        f" (data {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    print(
        f"{'index':>16} {'N':>9} {'m':>4} {'build_s':>8} {'batch_q/s':>10} {'p50_ms':>8} {'p99_ms':>8}"
        f" {'single_q/s':>10} {'R@10_m':>9} {'R@10_D':>9} {'B/vec':>9}",
        flush=True,
    )
    truth: dict = {}  # (n, m) -> exact top-K ids; (n, "D") -> exact at m = D
    hnsw_n = min(args.hnsw_n or args.n, args.n)
    rows: list[Row] = []
    for m in args.dims:
        pruned, pruned_q = prune(base, m), prune(queries, m)
        for name in sorted(args.factories, key=lambda f: f != "Flat"):  # Flat first: its ids are the exact truth
            n = hnsw_n if name == "HNSW32" else args.n
            if (n, "D") not in truth and not (name == "Flat" and m == args.dim):
                truth[(n, "D")] = exact(prune(base[:n], args.dim), prune(queries, args.dim))
            rows.append(run_cell(name, pruned[:n], pruned_q, args.single, truth, args.dim))
            print_row(rows[-1])
        del pruned
    full, eighth = args.dim, max(1, args.dim // 8)
    if args.rounds > 0:
        ratio = side_by_side(base, queries, (full, eighth), args.rounds, args.ratio_queries, args.ratio_single)
        print(
            f"# side by side, Flat N={args.n:,}, {args.rounds} alternating rounds (median):"
            f" m={full}: batch {ratio[full]['batch']:.1f} q/s, single {ratio[full]['single']:.1f} q/s;"
            f" m={eighth}: batch {ratio[eighth]['batch']:.1f} q/s, single {ratio[eighth]['single']:.1f} q/s",
        )
        print(
            f"# Flat m={eighth} vs m={full}: batch {ratio[eighth]['batch'] / ratio[full]['batch']:.2f}x,"
            f" single {ratio[eighth]['single'] / ratio[full]['single']:.2f}x (goal >= 5x)",
            flush=True,
        )
    print(f"# load after: {os.getloadavg()[0]:.2f}, total {time.perf_counter() - t0:.0f}s")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
