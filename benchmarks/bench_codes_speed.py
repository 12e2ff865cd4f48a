"""Speed and memory of the codes of ``triclip.index.codecs`` as ratios against float32 Flat, in one run.

Usage::

    .venv/bin/python -m benchmarks.bench_codes_speed --n 1000000 --budget 16
    .venv/bin/python -m benchmarks.bench_codes_speed --n 10000000 --budget 16 --no-float --codecs pq,opq,binary,int8

Synthetic unit vectors (``benchmarks.bench_index.synthetic``: D = 256, a power-law spectrum, clustered), generated
and added in chunks so the float vectors of a large N never exist at once. Each code is fitted on 20,000 other
vectors, then filled with all N. Reported per code: bytes per vector and the code array's size, resident memory
added by filling it (RSS after minus before), single-query latency (median of ``--single`` one-query calls),
batch queries/s (``--queries`` in one call), and recall@10 against exact float32 search over the same N (computed
in chunks) and against exhaustive search of the code itself (1.0 by construction: every code here is searched
exhaustively; listed so an approximate structure added later is measured the same way). ``--no-float`` leaves
out the float32 Flat index (at 10M it would take 10 GB); ratios then are against the float32 numbers of the
1M run, scaled by N, which the output says.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_index import synthetic  # noqa: E402
from triclip.index import codecs  # noqa: E402
from triclip.index.faiss_index import recall_at_k  # noqa: E402

K = 10
CHUNK = 500_000  # vectors generated and added at once
TRAIN = 20_000


def rss_mb() -> float:
    """Resident memory of this process now, MB (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def chunks(n: int, dim: int, centres: np.ndarray):
    for i, start in enumerate(range(0, n, CHUNK)):
        yield synthetic(min(CHUNK, n - start), dim, 1000 + i, centres)


def exact_truth(n: int, dim: int, centres: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Exact float32 top-K ids over all N, streamed chunk by chunk. Shape: (Q, K)."""
    best_s = np.full((len(q), 0), -np.inf, np.float32)
    best_i = np.zeros((len(q), 0), np.int64)
    offset = 0
    for x in chunks(n, dim, centres):
        s = q @ x.T  # (Q, chunk)
        best_s = np.concatenate([best_s, s], 1)
        best_i = np.concatenate([best_i, np.broadcast_to(np.arange(offset, offset + len(x)), s.shape)], 1)
        keep = np.argpartition(-best_s, K - 1, axis=1)[:, :K]
        best_s, best_i = np.take_along_axis(best_s, keep, 1), np.take_along_axis(best_i, keep, 1)
        offset += len(x)
    return np.take_along_axis(best_i, np.argsort(-best_s, 1), 1)


def measure(spec: codecs.CodecSpec, n: int, dim: int, centres, q, truth, single: int) -> dict:
    train = synthetic(TRAIN, dim, 7, centres)
    start = time.perf_counter()
    codec = codecs.fit(spec, train)
    fit_s = time.perf_counter() - start
    del train
    before, add_s = rss_mb(), 0.0
    for x in chunks(n, dim, centres):
        start = time.perf_counter()
        codec.add(x)
        add_s += time.perf_counter() - start  # encoding only, not generating the synthetic chunk
        del x  # the chunk's floats are not the code's memory
    added = rss_mb() - before
    lat = []
    for i in range(single):
        t = time.perf_counter()
        codec.search(q[i : i + 1], K)
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    ids = codec.search(q, K)[1]
    batch_s = time.perf_counter() - t
    return {"code": codec.spec.label(), "bytes_per_vector": codec.spec.bytes_per_vector,
            "code_mb": codec.code_bytes() / 2**20, "rss_added_mb": added, "fit_s": fit_s, "add_s": add_s,
            "single_ms": 1000 * statistics.median(lat), "batch_qps": len(q) / batch_s,
            "recall_vs_exact_float": None if truth is None else recall_at_k(ids, truth), "recall_vs_own_exhaustive": 1.0}  # fmt: skip


def specs_for(budget: int, dim: int, names: list[str]) -> list[codecs.CodecSpec]:
    """The largest-m candidate of each named codec at ``budget`` bytes (float32: full D, the reference)."""
    out = [codecs.CodecSpec("float32", dim, 4 * dim)] if "float32" in names else []
    for name in names:
        fits = [s for s in codecs.candidates(budget, dim) if s.codec == name and name != "float32"]
        if fits:
            out.append(max(fits, key=lambda s: s.m))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--codecs", default=",".join(codecs.names()), help="codec names (default: every registered codec)")
    p.add_argument("--no-float", action="store_true", help="leave out the float32 Flat reference")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--single", type=int, default=20)
    p.add_argument("--no-truth", action="store_true", help="skip exact float32 search over N (recall then n/a)")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    names = [c for c in ns.codecs.split(",") if not (ns.no_float and c == "float32")]
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((10_000, ns.dim)).astype(np.float32)
    q = synthetic(ns.queries, ns.dim, 99, centres)
    t = time.perf_counter()
    truth = None if ns.no_truth else exact_truth(ns.n, ns.dim, centres, q)
    print(f"exact float32 truth over {ns.n:,} vectors: {time.perf_counter() - t:.0f} s", flush=True)
    rows = []
    for spec in specs_for(ns.budget, ns.dim, names):
        rows.append(measure(spec, ns.n, ns.dim, centres, q, truth, ns.single))
        print(json.dumps(rows[-1]), flush=True)
    ref = rows[0] if rows and rows[0]["code"].startswith("float32") else None
    print(f"\nN = {ns.n:,}, D = {ns.dim}, {ns.queries} batch queries, {ns.single} single queries, "
          f"OMP threads {os.environ.get('OMP_NUM_THREADS', 'all')}\n")  # fmt: skip
    print("| code | B/vector | codes MB | RSS added MB | single-query ms | batch q/s | recall@10 vs exact float |"
          + (" memory x float | latency x float | q/s x float |" if ref else ""))  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if ref else ""))
    for r in rows:
        cells = [r["code"], str(r["bytes_per_vector"]), f"{r['code_mb']:.0f}", f"{r['rss_added_mb']:.0f}",
                 f"{r['single_ms']:.1f}", f"{r['batch_qps']:.1f}",
                 "n/a" if r["recall_vs_exact_float"] is None else f"{r['recall_vs_exact_float']:.3f}"]  # fmt: skip
        if ref:
            cells += [f"{r['code_mb'] / ref['code_mb']:.3f}", f"{r['single_ms'] / ref['single_ms']:.2f}",
                      f"{r['batch_qps'] / ref['batch_qps']:.2f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    with open("/proc/self/status") as f:
        peak = next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:")), float("nan"))
    print(f"\npeak resident memory of the whole run (VmHWM): {peak:.0f} MB")
    if ns.json:
        from triclip.core.io import write_json_atomic

        write_json_atomic(ns.json, {"n": ns.n, "dim": ns.dim, "budget": ns.budget, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
