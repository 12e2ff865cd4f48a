"""Index building from embedding shards at scale: build time, memory peak, recall@10, queries/s.

Usage::

    .venv/bin/python benchmarks/bench_shards.py                       # 1M vectors, 5 shards: shards, ondisk, single
    .venv/bin/python benchmarks/bench_shards.py --n 10000000 --no-single   # 10M vectors (disk: 2 bytes x D x N)
    .venv/bin/python benchmarks/bench_shards.py --n 10000000 --dim 256 --pipelines shards,ondisk
    .venv/bin/python benchmarks/bench_shards.py --n 200000 --factory auto --memory-budget 64M --json out.json

Data: the synthetic stand-in of ``benchmarks/bench_index.py`` (D = 512 unit vectors with a
power-law spectrum around 10,000 clusters, dimensions already in importance order),
written as ``--shard-size`` shards of float16 ``.npy`` files like ``triclip embed`` writes
them, then memory-mapped. The index is built at m = D/8 over the re-normalised prefix.

Three pipelines (``--pipelines``), each built in its own fresh process so that the peak
memory is its own, then saved and searched in **another** fresh process (what serving
costs). Peak memory is ``VmHWM`` (resident, file-backed pages of a memory map included;
``ru_maxrss`` where there is no /proc) and ``anon``, the peak of ``RssAnon`` sampled every
20 ms: the process's own memory, which a memory-mapped file's pages are not (the kernel
drops those under pressure). ``base_mb`` is the peak after the imports; the table's
``own`` is the ``RssAnon`` peak minus its value after the imports. An on-disk index is
searched twice: as triclip opens it (``triclip.index.faiss_index.PREFETCH_THREADS`` = 32 threads
prefetching the lists of each batch, FAISS's default) and without them (``prefetch 0``).

- ``shards``: ``triclip.index.build`` (IVF trained once on a sample drawn across the
  shards, each shard added to a copy of the trained index, merged in memory with id
  offsets), ``nprobe`` tuned to ``--recall-target`` on held-out queries.
- ``ondisk``: the same, merged on disk (``on_disk="always"``: parts with global ids,
  ``OnDiskInvertedLists`` in an ``.ivfdata`` file); the search process memory-maps it
  after evicting it from the page cache (``posix_fadvise(DONTNEED)``), so the first batch
  (``cold q/s``) reads from the disk.
- ``single`` (today's ``index build`` path): all vectors concatenated in memory, then
  ``triclip.index.faiss_index.build`` with the same factory, ``nprobe`` tuned the same way.

Queries are fresh draws from the same clusters (held out: never in the base). Recall@10 is
against exact search at m over all N vectors (computed once, by the parent, shard by
shard); queries/s is the best of 5 batches of ``--queries`` at the tuned ``nprobe`` on
FAISS's threads (``OMP_NUM_THREADS``). ``load_s`` (single only) is reading and
concatenating the shards; ``build_s`` is training + adding + merging, and for ``shards`` /
``ondisk`` includes reading them; ``open_s`` is the search process reading the index. On a
shared machine every timing moves with the load: the header prints the load average.
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


class PeakAnon:
    """Samples ``RssAnon`` (the process's own resident memory, MB) every 20 ms in a thread; ``.peak``."""

    def __init__(self) -> None:
        import threading

        self.peak = _anon_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _anon_mb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_mb())
        return round(self.peak, 1)


def _anon_mb() -> float:
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def _build(pipeline: str, files: list[str], queries_file: str, m: int, factory: str, budget: int,
           target: float, n_queries: int, out_dir: str, out) -> None:
    """Child process: build one way, tune nprobe, save the index under ``out_dir``; put a result dict on ``out``."""
    import faiss

    from triclip.index import faiss_index as fi
    from triclip.index.build import ShardedBuilder, choose_factory, tune_nprobe
    from triclip.index.vectors import ShardFile, ShardVectors, prefix

    base_mb = _peak_mb()
    anon = PeakAnon()
    base_anon = anon.peak
    shards = ShardVectors.of([ShardFile(f) for f in files])
    factory = choose_factory(shards.count, m, budget, factory)
    start = time.perf_counter()
    load_s = 0.0
    if pipeline == "shards":
        index = ShardedBuilder(seed=0).build(shards, m, factory)  # reads the shards as it goes
    elif pipeline == "ondisk":
        builder = ShardedBuilder(seed=0, work=Path(out_dir), on_disk="always")
        index = builder.build(shards, m, factory, tag="index")  # lists: out_dir/index.ivfdata
    else:
        whole = prefix(np.concatenate([np.asarray(p) for p in shards.parts]), m)  # (N, m) float32 in memory
        load_s = time.perf_counter() - start
        index = fi.build(whole, factory, seed=0)
        del whole
    build_s = time.perf_counter() - start - load_s
    held_out = ShardVectors.of([np.load(queries_file)[:n_queries]])  # tuning queries (the first half)
    cfg = SimpleNamespace(seed=0, tune_queries=n_queries, recall_target=target)
    start = time.perf_counter()
    tuning = tune_nprobe(index, shards, held_out, m, cfg)
    tune_s = time.perf_counter() - start
    if fi.is_on_disk(index):
        fi.relocate_lists(index, "index.ivfdata")
    fi.save(index, Path(out_dir) / "index.faiss")
    size = sum(f.stat().st_size for f in Path(out_dir).glob("index.*"))
    out.put({
        "pipeline": pipeline, "n": shards.count, "shards": len(files), "m": m, "factory": factory,
        "load_s": round(load_s, 2), "build_s": round(build_s, 2), "tune_s": round(tune_s, 2),
        "build_peak_mb": round(_peak_mb(), 1), "build_anon_mb": anon.stop(), "base_mb": round(base_mb, 1),
        "base_anon_mb": round(base_anon, 1), "nprobe": tuning["nprobe"] if tuning else None,
        "bytes_per_vector": round(size / max(1, index.ntotal), 1),
        "on_disk": fi.is_on_disk(index), "threads": faiss.omp_get_max_threads(),
    })


def _search(index_dir: str, on_disk: bool, queries_file: str, truth_file: str, nprobe: int | None,
            prefetch: int | None, out) -> None:
    """Child process: open the saved index (mapped when on disk, after evicting it from the page cache), search.

    ``prefetch``: threads of ``OnDiskInvertedLists.prefetch_lists`` (None: not on disk).
    """
    import faiss

    from triclip.index import faiss_index as fi

    base_mb = _peak_mb()
    queries, truth = np.load(queries_file), np.load(truth_file)  # (Q, m), (Q, K)
    lists = Path(index_dir) / "index.ivfdata"
    cached = None
    if on_disk and hasattr(os, "posix_fadvise"):  # cold start: the lists' pages out of the page cache
        fd = os.open(lists, os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        cached = _cached_mb(lists)
    anon = PeakAnon()
    base_anon = anon.peak
    start = time.perf_counter()
    index = fi.load(Path(index_dir) / "index.faiss", on_disk=on_disk)
    open_s = time.perf_counter() - start
    if on_disk:
        fi.on_disk_lists(index).prefetch_nthread = prefetch
    params = faiss.SearchParametersIVF(nprobe=nprobe) if nprobe else fi.search_parameters(index, K)
    seconds = []
    for _ in range(6):  # the first batch cold, then best of 5
        start = time.perf_counter()
        _, found = index.search(queries, K, params=params)
        seconds.append(time.perf_counter() - start)
    out.put({
        "open_s": round(open_s, 2), "cold_qps": round(len(queries) / seconds[0], 1),
        "qps": round(len(queries) / min(seconds[1:]), 1), "recall_at_10": round(fi.recall_at_k(found, truth), 4),
        "search_peak_mb": round(_peak_mb(), 1), "search_anon_mb": anon.stop(), "search_base_mb": round(base_mb, 1),
        "search_base_anon_mb": round(base_anon, 1), "prefetch_threads": prefetch if on_disk else None,
        "lists_cached_mb_at_open": cached,
    })


def _speed(indexes: list[tuple], queries_file: str, out, rounds: int = 5) -> None:
    """Child process: queries/s of every saved index side by side, batches interleaved, best of ``rounds`` each.

    On a shared machine the load moves between the search processes above; interleaving
    puts every index under the same load, so these are the numbers to compare.
    """
    import faiss

    from triclip.index import faiss_index as fi

    queries = np.load(queries_file)  # (Q, m)
    opened = {}
    for name, folder, on_disk, nprobe, prefetch in indexes:
        if folder not in opened:
            opened[folder] = fi.load(Path(folder) / "index.faiss", on_disk=on_disk)
        index = opened[folder]
        params = faiss.SearchParametersIVF(nprobe=nprobe) if nprobe else fi.search_parameters(index, K)
        opened[name] = (index, params, prefetch)
    best = {name: float("inf") for name, *_ in indexes}
    for round_ in range(rounds + 1):  # round 0 warms every index up
        for name in best:
            index, params, prefetch = opened[name]
            if fi.is_on_disk(index):
                fi.on_disk_lists(index).prefetch_nthread = prefetch
            start = time.perf_counter()
            index.search(queries, K, params=params)
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    out.put({name: round(len(queries) / seconds, 1) for name, seconds in best.items()})


def _cached_mb(file: Path) -> float | None:
    """MB of ``file`` in the page cache (``fincore``), None where it is not installed."""
    import subprocess

    try:
        done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(file)],
                              capture_output=True, text=True, check=True)
        return round(int(done.stdout.split()[0]) / 2**20, 1)
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def run_child(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    result = out.get()
    proc.join()
    return result


def exact_truth(files: list[Path], queries: np.ndarray, m: int) -> np.ndarray:
    """Exact top-K ids of the held-out queries at m over all shards, a shard at a time. Shape: (Q, K)."""
    from triclip.index.vectors import ShardFile, ShardVectors, exact_topk

    return exact_topk(ShardVectors.of([ShardFile(f) for f in files]), queries, K, m)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="vectors (default 1M; 10M: 10000000)")
    p.add_argument("--dim", type=int, default=512, help="D; the index is built at m = D/8")
    p.add_argument("--shard-size", type=int, default=200_000)
    p.add_argument("--factory", default="ivf-flat", help="ivf-flat (IVF{nlist},Flat), ivf-pq, auto, or a FAISS string")
    p.add_argument("--memory-budget", default="4G", help="for --factory auto (e.g. 64M, 4G)")
    p.add_argument("--recall-target", type=float, default=0.95)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--pipelines", default="shards,ondisk,single", help="comma-separated: shards, ondisk, single")
    p.add_argument("--no-single", action="store_true", help="skip today's single-process build")
    p.add_argument("--workdir", default=None, help="where the shards and indexes go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    from triclip.index import faiss_index as fi
    from triclip.index.config import parse_bytes
    from triclip.index.vectors import prefix

    pipelines = [x for x in args.pipelines.split(",") if x and not (args.no_single and x == "single")]
    if not set(pipelines) <= {"shards", "ondisk", "single"}:
        p.error(f"--pipelines: shards, ondisk, single; got {args.pipelines}")
    m = args.dim // 8
    factory = {"ivf-flat": f"IVF{fi.ivf_nlist(args.n)},Flat", "ivf-pq": fi.ivf_pq_factory(args.n, m)}.get(
        args.factory, args.factory
    )
    print(f"# n={args.n} D={args.dim} m={m} shard_size={args.shard_size} factory={factory}"
          f" cpus={os.cpu_count()} load={os.getloadavg()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-shards-", dir=args.workdir))
    results = []
    try:
        start = time.perf_counter()
        files = write_shards(work, args.n, args.dim, args.shard_size, seed=0)
        print(f"# wrote {len(files)} float16 shards in {time.perf_counter() - start:.1f} s", flush=True)
        held_out = np.load(work / "queries.npy")
        np.save(work / "tune.npy", held_out[: len(held_out) // 2])  # tuning queries
        evaluation = prefix(held_out[len(held_out) // 2 :][: args.queries], m)  # (Q, m) other held-out queries
        np.save(work / "eval.npy", evaluation)
        start = time.perf_counter()
        np.save(work / "truth.npy", exact_truth(files, evaluation, m))
        print(f"# exact top-{K} of {len(evaluation)} queries in {time.perf_counter() - start:.1f} s", flush=True)
        for pipeline in pipelines:
            out_dir = work / f"index-{pipeline}"
            out_dir.mkdir()
            result = run_child(_build, pipeline, [str(f) for f in files], str(work / "tune.npy"), m, factory,
                               parse_bytes(args.memory_budget), args.recall_target, args.queries, str(out_dir))
            other = 0 if fi.PREFETCH_THREADS else 32  # on disk: as triclip opens it, then the other way
            searched = [fi.PREFETCH_THREADS, other] if result["on_disk"] else [None]
            for prefetch in searched:
                label = f"{pipeline}, prefetch {prefetch}" if prefetch not in (None, fi.PREFETCH_THREADS) else pipeline
                row = dict(result, pipeline=label)
                row.update(run_child(_search, str(out_dir), result["on_disk"], str(work / "eval.npy"),
                                     str(work / "truth.npy"), result["nprobe"], prefetch))
                results.append(row)
                print(json.dumps(row), flush=True)
        speeds = run_child(_speed, [(r["pipeline"], str(work / f"index-{r['pipeline'].split(',')[0]}"), r["on_disk"],
                                     r["nprobe"], r["prefetch_threads"]) for r in results], str(work / "eval.npy"))
        for r in results:
            r["qps_side_by_side"] = speeds[r["pipeline"]]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| pipeline | N | m | factory | load s | build s | build peak / own MB | nprobe | recall@10 |"
          " search peak / own MB | open s | cold q/s | q/s alone | q/s side by side |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:  # own: the peak of RssAnon above its value after the imports (mapped files not counted)
        build_own, search_own = r["build_anon_mb"] - r["base_anon_mb"], r["search_anon_mb"] - r["search_base_anon_mb"]
        print(f"| {r['pipeline']} | {r['n']:,} | {r['m']} | {r['factory']} | {r['load_s']} | {r['build_s']} |"
              f" {r['build_peak_mb']:,.0f} / {build_own:,.0f} | {r['nprobe']} | {r['recall_at_10']} |"
              f" {r['search_peak_mb']:,.0f} / {search_own:,.0f} | {r['open_s']} | {r['cold_qps']:.0f} |"
              f" {r['qps']:.0f} |"
              f" {r['qps_side_by_side']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
