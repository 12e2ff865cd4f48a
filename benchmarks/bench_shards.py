"""Index building from embedding shards at scale: build time, memory peak, recall@10, queries/s.

Usage::

    .venv/bin/python benchmarks/bench_shards.py                       # 1M vectors, 5 shards, + single-process build
    .venv/bin/python benchmarks/bench_shards.py --n 10000000 --no-single   # the issue's 10M (disk: 2 bytes x D x N)
    .venv/bin/python benchmarks/bench_shards.py --n 200000 --factory auto --memory-budget 64M --json out.json

Data: the synthetic stand-in of ``benchmarks/bench_index.py`` (D = 512 unit vectors with a
power-law spectrum around 10,000 clusters, dimensions already in importance order),
written as ``--shard-size`` shards of float16 ``.npy`` files like ``triclip embed`` writes
them, then memory-mapped. The index is built at m = D/8 over the re-normalised prefix.

Two pipelines, each in its own fresh process so that the peak resident memory (``VmHWM``,
``ru_maxrss`` where there is no /proc) is its own; the line also gives the peak after the
imports (``base_mb``):

- ``shards``: ``index.from_embeddings`` (IVF trained once on a sample drawn across the
  shards, each shard added to a copy of the trained index, merged with id offsets; Flat /
  HNSW added shard by shard), ``nprobe`` tuned to ``--recall-target`` on held-out queries.
- ``single`` (today's ``index build`` path): all vectors concatenated in memory, then
  ``index.faiss_index.build`` with the same factory, ``nprobe`` tuned the same way.

Queries are fresh draws from the same clusters (held out: never in the base). Recall@10 is
against exact search at m over all N vectors; queries/s is the best of 5 batches of
``--queries`` at the tuned ``nprobe`` on FAISS's threads (``OMP_NUM_THREADS``). ``load_s``
(single only) is reading and concatenating the shards; ``build_s`` is training + adding
(+ merging), and for ``shards`` includes reading them. On a shared machine every timing moves
with the load: the header prints the load average.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (see bench_index.py)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

K = 10


def _peak_mb() -> float:
    """Peak resident memory of this process, MB: ``VmHWM`` (reset by exec, unlike ``ru_maxrss``,
    which a spawned child inherits from the parent that forked it), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024  # KiB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def write_shards(folder: Path, n: int, dim: int, shard_size: int, seed: int) -> list[Path]:
    """Synthetic shards as float16 ``.npy`` files, generated shard by shard (bounded memory)."""
    from benchmarks.bench_index import synthetic

    centres = np.random.default_rng(seed).standard_normal((10_000, dim), dtype=np.float32)
    files = []
    for s, start in enumerate(range(0, n, shard_size)):
        rows = min(shard_size, n - start)
        path = folder / f"shard-{s:05d}" / "image.npy"
        path.parent.mkdir(parents=True)
        np.save(path, synthetic(rows, dim, seed + 1 + s, centres).astype(np.float16))
        files.append(path)
    queries = synthetic(2 * K * 100, dim, seed + 10_000_000, centres)  # fresh draws: held-out queries
    np.save(folder / "queries.npy", queries)
    return files


def _measure(pipeline: str, files: list[str], queries_file: str, m: int, factory: str, budget: int,
             target: float, n_queries: int, out) -> None:
    """Child process: build one way, tune / apply nprobe, measure; put a result dict on ``out``."""
    import faiss

    from index import faiss_index as fi
    from index.from_embeddings import (
        ShardedBuilder, ShardFile, ShardVectors, choose_factory, exact_topk, prefix, tune_nprobe,
    )

    base_mb = _peak_mb()
    shards = ShardVectors.of([ShardFile(f) for f in files])
    queries_all = np.load(queries_file)
    factory = choose_factory(shards.count, m, budget, factory)
    start = time.perf_counter()
    load_s = 0.0
    if pipeline == "shards":
        index = ShardedBuilder(seed=0).build(shards, m, factory)  # reads the shards as it goes
    else:
        whole = prefix(np.concatenate([np.asarray(p) for p in shards.parts]), m)  # (N, m) float32 in memory
        load_s = time.perf_counter() - start
        index = fi.build(whole, factory, seed=0)
        del whole
    build_s = time.perf_counter() - start - load_s
    held_out = ShardVectors.of([queries_all[: len(queries_all) // 2]])  # tuning queries
    cfg = SimpleNamespace(seed=0, tune_queries=n_queries, recall_target=target)
    start = time.perf_counter()
    tuning = tune_nprobe(index, shards, held_out, m, cfg)
    tune_s = time.perf_counter() - start
    queries = prefix(queries_all[len(queries_all) // 2 :][:n_queries], m)  # other held-out queries to score
    truth = exact_topk(shards, queries, m, K)
    params = faiss.SearchParametersIVF(nprobe=tuning["nprobe"]) if tuning else fi.search_parameters(index, K)
    index.search(queries[:8], K, params=params)  # warm-up
    seconds = []
    for _ in range(5):  # best of 5: other processes on a shared machine only ever slow a run down
        start = time.perf_counter()
        _, found = index.search(queries, K, params=params)
        seconds.append(time.perf_counter() - start)
    qps = len(queries) / min(seconds)
    out.put({
        "pipeline": pipeline, "n": shards.count, "shards": len(files), "m": m, "factory": factory,
        "load_s": round(load_s, 2), "build_s": round(build_s, 2), "peak_mb": round(_peak_mb(), 1), "base_mb": round(base_mb, 1),
        "nprobe": tuning["nprobe"] if tuning else None, "tune_s": round(tune_s, 2),
        "recall_at_10": round(fi.recall_at_k(found, truth), 4), "qps": round(qps, 1),
        "bytes_per_vector": round(faiss.serialize_index(index).nbytes / max(1, index.ntotal), 1),
        "threads": faiss.omp_get_max_threads(),
    })


def run_child(*args) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(*args, out))
    proc.start()
    result = out.get()
    proc.join()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="vectors (default 1M; the issue's 10M: 10000000)")
    p.add_argument("--dim", type=int, default=512, help="D; the index is built at m = D/8")
    p.add_argument("--shard-size", type=int, default=200_000)
    p.add_argument("--factory", default="ivf-flat", help="ivf-flat (IVF{nlist},Flat), ivf-pq, auto, or a FAISS string")
    p.add_argument("--memory-budget", default="4G", help="for --factory auto (e.g. 64M, 4G)")
    p.add_argument("--recall-target", type=float, default=0.95)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--no-single", action="store_true", help="skip today's single-process build")
    p.add_argument("--workdir", default=None, help="where the shards go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    from index import faiss_index as fi
    from index.from_embeddings import parse_bytes

    m = args.dim // 8
    factory = {"ivf-flat": f"IVF{fi.ivf_nlist(args.n)},Flat", "ivf-pq": fi.ivf_pq_factory(args.n, m)}.get(
        args.factory, args.factory
    )
    print(f"# n={args.n} D={args.dim} m={m} shard_size={args.shard_size} factory={factory}"
          f" cpus={os.cpu_count()} load={os.getloadavg()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-shards-", dir=args.workdir))
    try:
        start = time.perf_counter()
        files = write_shards(work, args.n, args.dim, args.shard_size, seed=0)
        print(f"# wrote {len(files)} float16 shards in {time.perf_counter() - start:.1f} s", flush=True)
        common = ([str(f) for f in files], str(work / "queries.npy"), m, factory,
                  parse_bytes(args.memory_budget), args.recall_target, args.queries)
        results = []
        for pipeline in ["shards"] + ([] if args.no_single else ["single"]):
            results.append(run_child(pipeline, *common))
            print(json.dumps(results[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| pipeline | N | shards | m | factory | load s | build s | peak MB | nprobe | recall@10 | queries/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['pipeline']} | {r['n']:,} | {r['shards']} | {r['m']} | {r['factory']} | {r['load_s']} | {r['build_s']} |"
              f" {r['peak_mb']:.0f} | {r['nprobe']} | {r['recall_at_10']} | {r['qps']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
