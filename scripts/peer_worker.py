"""One peer index built or measured in a process of its own: ``benchmarks.haystack_peers`` runs it.

    PYTHON scripts/peer_worker.py build|measure JOB.json

Imports numpy and the method's own package only, so that it runs in the main environment (plain FAISS, triclip)
or in the peers' own (autofaiss, usearch: numpy < 2) and each peer is measured with its real package. JOB (JSON):
``method``, ``dir`` (the index folder), ``npy`` (the haystack's float32 rows as NNNN.npy, in row order),
``queries`` (Q, D) .npy, ``ids`` (where measure writes their (Q, 10) row ids) and the method's own fields.
Prints one JSON line: what was built (build s, disk bytes) or measured (load RSS delta, single-query p50 / p99 on
1 and 2 threads after :data:`WARMUP` untimed queries, and cold: the index's files evicted from the page cache before
each query; batch queries/s on 2 threads).
"""

from __future__ import annotations

import glob
import importlib
import json
import mmap
import os
import sys
import time
from importlib.metadata import version

import numpy as np

K = 10  # neighbours asked for, timed and returned
WARMUP = 20  # queries searched before timing
K_FACTORS = tuple(2**i for i in range(10))  # IndexRefineFlat: candidates = k_factor x K, 1 to 512


def rss_bytes() -> int:
    """This process's resident set (VmRSS), bytes."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def npy_parts(folder: str) -> list[np.ndarray]:
    """The haystack's rows, part by part, memory-mapped (row order = sorted file names)."""
    return [np.load(p, mmap_mode="r") for p in sorted(glob.glob(os.path.join(folder, "*.npy")))]


def sample_rows(parts: list[np.ndarray], count: int, seed: int = 0) -> np.ndarray:
    """``count`` rows drawn without replacement over all parts, float32. (count, D)"""
    sizes = np.array([len(p) for p in parts])
    rows = np.sort(np.random.default_rng(seed).choice(sizes.sum(), min(count, sizes.sum()), replace=False))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.concatenate([np.asarray(p[rows[(rows >= s) & (rows < s + len(p))] - s], np.float32)
                           for p, s in zip(parts, starts)])


# ---------------------------------------------------------------------------- each method: build, then load


def faiss_build(spec: dict) -> dict:
    """``IVF{nlist},PQ{M}x4fs`` trained on a sample, filled part by part, in ``IndexRefineFlat`` (the float rows in
    memory); nprobe and k_factor tuned on the val queries (:func:`faiss_tune`)."""
    import faiss
    parts = npy_parts(spec["npy"])
    base = faiss.index_factory(parts[0].shape[1], f"IVF{spec['nlist']},PQ{spec['M']}x4fs", faiss.METRIC_INNER_PRODUCT)
    base.train(sample_rows(parts, spec["train_rows"]))
    index = faiss.IndexRefineFlat(base)
    for part in parts:
        index.add(np.ascontiguousarray(part, np.float32))
    params = faiss_tune(index, np.load(spec["tune_queries"]), np.load(spec["tune_truth"])[:, :K], spec["target"])
    faiss.write_index(index, os.path.join(spec["dir"], "index.faiss"))
    with open(os.path.join(spec["dir"], "params.json"), "w") as fh:
        json.dump(params, fh)
    return params


def faiss_tune(index, queries: np.ndarray, truth: np.ndarray, target: float) -> dict:
    """Per power-of-two nprobe the smallest k_factor whose top 10 holds ``target`` of ``truth`` (Q, 10); of those
    pairs the fastest on one thread over the queries (timed); the last pair tried when none holds it."""
    import faiss
    from triclip.index.budgets import overlap
    ivf, held = faiss.extract_index_ivf(index), {}
    for nprobe in (2**i for i in range(int(np.log2(ivf.nlist)) + 1)):
        for k_factor in K_FACTORS:
            ivf.nprobe, index.k_factor = nprobe, k_factor
            held[nprobe, k_factor] = overlap(index.search(queries, K)[1], truth)
            if held[nprobe, k_factor] >= target:
                break
    pairs = [pair for pair, share in held.items() if share >= target] or [list(held)[-1]]
    search = faiss_searcher(index)
    ms = [sum(single_query_ms(search, queries, 1, tune=pair)) for pair in pairs]
    nprobe, k_factor = pairs[int(np.argmin(ms))]
    return {"nprobe": nprobe, "k_factor": k_factor, "held_on_val": held[nprobe, k_factor]}


def faiss_searcher(index):
    import faiss

    def search(q: np.ndarray, threads: int, tune: tuple[int, int] | None = None) -> np.ndarray:
        if tune:  # (nprobe, k_factor)
            faiss.extract_index_ivf(index).nprobe, index.k_factor = tune
        faiss.omp_set_num_threads(threads)
        return index.search(q, K)[1]
    return search


def faiss_load(spec: dict):
    import faiss
    with open(os.path.join(spec["dir"], "params.json")) as fh:
        params = json.load(fh)
    index = faiss.read_index(os.path.join(spec["dir"], "index.faiss"))
    faiss.extract_index_ivf(index).nprobe, index.k_factor = params["nprobe"], params["k_factor"]
    return faiss_searcher(index)


def autofaiss_build(spec: dict) -> dict:
    """``autofaiss.build_index`` on the .npy folder, inner product, within the spec's memory and query-time bounds."""
    import autofaiss
    import faiss
    index_path, infos_path = (os.path.join(spec["dir"], name) for name in ("knn.index", "index_infos.json"))
    autofaiss.build_index(embeddings=spec["npy"], index_path=index_path, index_infos_path=infos_path,
                          max_index_memory_usage=spec["max_memory"], max_index_query_time_ms=spec["latency_ms"],
                          current_memory_available=spec["memory_available"], metric_type="ip",
                          nb_cores=spec["cores"], verbose=30)
    if not os.path.isfile(index_path):
        raise RuntimeError(f"autofaiss wrote no index for max_index_memory_usage={spec['max_memory']}")
    with open(infos_path) as fh:
        infos = json.load(fh)
    index = faiss.read_index(index_path)
    try:  # one vector's code: its inverted lists' when it has them, else the whole index's bytes per vector
        code = faiss.extract_index_ivf(index).code_size
    except RuntimeError:
        code = round(len(faiss.serialize_index(index)) / max(index.ntotal, 1), 1)
    return {"label": infos.get("index_key"), "index_param": infos.get("index_param"), "faiss": faiss.__version__,
            "autofaiss": version("autofaiss"), "code_bytes": code}


def autofaiss_load(spec: dict):
    import faiss
    return faiss_searcher(faiss.read_index(os.path.join(spec["dir"], "knn.index")))


USEARCH_METRIC = {"b1": "hamming", "i8": "ip", "f16": "ip", "f32": "ip"}  # b1 vectors are bits: Hamming


def usearch_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """Rows as usearch takes them: sign bits packed for b1, float32 otherwise."""
    x = np.asarray(x, np.float32)
    return np.packbits(x > 0, axis=1) if dtype == "b1" else np.ascontiguousarray(x)


def usearch_build(spec: dict) -> dict:
    """An HNSW index of ``spec["dtype"]``, usearch's default connectivity and expansions, rows added part by part."""
    from usearch.index import Index
    parts, dtype = npy_parts(spec["npy"]), spec["dtype"]
    index, done = Index(ndim=parts[0].shape[1], metric=USEARCH_METRIC[dtype], dtype=dtype), 0
    for part in parts:
        index.add(np.arange(done, done + len(part)), usearch_rows(part, dtype), threads=spec["cores"])
        done += len(part)
    index.save(os.path.join(spec["dir"], "index.usearch"))
    return {"connectivity": int(index.connectivity), "expansion_search": int(index.expansion_search),
            "usearch": version("usearch"), "memory_usage": int(index.memory_usage)}


def usearch_load(spec: dict):
    from usearch.index import Index
    index = Index.restore(os.path.join(spec["dir"], "index.usearch"))

    def search(q: np.ndarray, threads: int) -> np.ndarray:
        keys = index.search(usearch_rows(q, spec["dtype"]), K, threads=threads).keys
        return np.asarray(keys, np.int64).reshape(len(q), -1)
    return search


def triclip_load(spec: dict):
    """The index folder's live version, searched at spec["bytes"] with the stages its build recorded (no model:
    the queries are vectors already)."""
    from triclip.codecs.threads import set_search_threads
    from triclip.index.search import Searcher
    from triclip.index.store import load_contents
    contents = load_contents(spec["dir"], indexes="codes")  # not the float indexes per m: search --bytes holds none
    searcher = Searcher(contents, None, None, None)

    def rows(q: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
        """Scores and row ids of the top K (Q, K), by the stages the build recorded; no meta read."""
        set_search_threads(threads)
        return searcher._ranked(q, K, None, "image", None, spec["bytes"], None)

    def search(q: np.ndarray, threads: int) -> np.ndarray:
        """The hits as ``search_vectors`` gives them (their meta rows read), the row ids returned as they rank."""
        scores, ids = rows(q, threads)
        for s, i in zip(scores, ids):
            searcher._hits(s, i, "image")
        return ids

    def drop() -> None:  # cold: the pages this process maps stay cached, so they are unmapped first
        for disk in searcher._rows_on_disk.values():
            if disk is not None:
                getattr(disk, "codes", disk).drop_pages()  # sq8 rows (SQ8Rows): their codes' DiskRows
        for name in ("offsets", "hashes", "order"):  # the meta's arrays (a version read whole has none)
            mapped = getattr(getattr(contents.meta, name, None), "_mmap", None)
            if mapped is not None:
                mapped.madvise(mmap.MADV_DONTNEED)
    search.drop = drop
    search.rows = lambda q, threads: rows(q, threads)[1]  # without the hits' meta rows
    search.rows.drop = drop
    return search


METHODS = {  # method -> (build, load); triclip's index is built by its own CLI (benchmarks.haystack_peers)
    "faiss": (faiss_build, faiss_load),
    "autofaiss": (autofaiss_build, autofaiss_load),
    "usearch": (usearch_build, usearch_load),
    "triclip": (None, triclip_load),
}


# ---------------------------------------------------------------------------- measuring a loaded index


def single_query_ms(search, queries: np.ndarray, threads: int, **how) -> list[float]:
    """Milliseconds of each query searched alone (after :data:`WARMUP` untimed ones)."""
    for q in queries[:WARMUP]:
        search(q[None], threads, **how)
    out = []
    for q in queries:
        started = time.perf_counter()
        search(q[None], threads, **how)
        out.append(1000 * (time.perf_counter() - started))
    return out


def index_files(folder: str) -> list[str]:
    """Every file under ``folder``."""
    return [p for p in glob.glob(os.path.join(folder, "**"), recursive=True) if os.path.isfile(p)]


def read_through(folder: str) -> None:
    """Read every file under ``folder`` once, so the warm measurements find them in the page cache (a build may
    have left them evicted)."""
    for file in index_files(folder):
        with open(file, "rb") as fh:
            while fh.read(1 << 24):
                pass


def cold_query_ms(search, queries: np.ndarray, folder: str) -> list[float]:
    """Milliseconds of each query searched alone on one thread, cold: searched once untimed (what it reads, the
    storage has just served), then every file under ``folder`` evicted from the page cache (not timed), then
    timed. What "cold" is for the build's choice too (``triclip.index.diskrows.settle``): a VM's host caches what
    it served, so a query's first reads would be slower than its repeats, by what ran before."""
    return evicted_query_ms(search, queries, index_files(folder))


def evicted_query_ms(search, queries: np.ndarray, files: list[str]) -> list[float]:
    """:func:`cold_query_ms` evicting ``files`` before each timed query."""
    from triclip.index.diskrows import evict
    out = []
    for q in queries:
        search(q[None], 1)
        getattr(search, "drop", lambda: None)()  # a mapped page stays cached: unmapped first
        for file in files:
            evict(file)
        started = time.perf_counter()
        search(q[None], 1)
        out.append(1000 * (time.perf_counter() - started))
    return out


IMPORTS = {  # method -> the modules its load imports: imported before the RSS is read, so it counts the index only
    "faiss": ("faiss",), "autofaiss": ("faiss",), "usearch": ("usearch.index",),
    "triclip": ("triclip.index.search", "triclip.index.store", "triclip.codecs.threads"),
}


def measure(spec: dict) -> dict:
    """The load's RSS delta (its modules imported first) and time; single-query p50 / p99 on 1 and 2 threads, every
    file of the index read into the page cache first (:func:`read_through`), and cold (:func:`cold_query_ms`, 1
    thread; triclip also for the row ids alone, without the hits' meta rows: ``p50_ms_cold_rows``); batch
    queries/s on 2 threads (median of 3). The top-10 row ids of every query go to spec["ids"], each query's cold
    milliseconds to spec["times"] (``.npz``: "cold", and "cold_rows" for triclip) when given."""
    queries = np.ascontiguousarray(np.load(spec["queries"]), np.float32)
    for module in IMPORTS[spec["method"]]:
        importlib.import_module(module)
    read_through(spec["dir"])
    before, started = rss_bytes(), time.perf_counter()
    search = METHODS[spec["method"]][1](spec)
    out = {"load_s": round(time.perf_counter() - started, 2), "rss_bytes": rss_bytes() - before}
    for threads in (1, 2):
        p50, p99 = np.percentile(single_query_ms(search, queries, threads), [50, 99])
        out[f"p50_ms_{threads}t"], out[f"p99_ms_{threads}t"] = round(float(p50), 3), round(float(p99), 3)
    each = {"cold": cold_query_ms(search, queries, spec["dir"])}  # name -> (Q,) ms of each query
    if hasattr(search, "rows"):  # triclip: also the row ids alone, as the peers answer, without the hits' meta rows
        each["cold_rows"] = cold_query_ms(search.rows, queries, spec["dir"])
    for name, ms in each.items():
        p50, p99 = np.percentile(ms, [50, 99])
        out[f"p50_ms_{name}"], out[f"p99_ms_{name}"] = round(float(p50), 3), round(float(p99), 3)
    if spec.get("times"):  # each query's cold milliseconds, to find which queries make the tail
        np.savez(spec["times"], **{name: np.asarray(ms) for name, ms in each.items()})
    seconds = []
    for _ in range(3):
        started = time.perf_counter()
        ids = search(queries, 2)
        seconds.append(time.perf_counter() - started)
    np.save(spec["ids"], ids)
    return {**out, "batch_qps_2t": round(len(queries) / float(np.median(seconds)), 1),
            "rss_after_bytes": rss_bytes() - before}


def main(argv: list[str] | None = None) -> None:
    step, path = sys.argv[1:] if argv is None else argv
    with open(path) as fh:
        spec = json.load(fh)
    if step == "measure":
        print(json.dumps(measure(spec)), flush=True)
        return
    started = time.perf_counter()
    result = METHODS[spec["method"]][0](spec)
    files = glob.glob(os.path.join(spec["dir"], "**"), recursive=True)
    disk = sum(os.path.getsize(p) for p in files if os.path.isfile(p))
    print(json.dumps({**result, "build_s": round(time.perf_counter() - started, 1), "disk_bytes": disk}), flush=True)


if __name__ == "__main__":
    main()
