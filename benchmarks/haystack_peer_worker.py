"""One peer index built or measured in a process of its own: ``benchmarks.haystack_peers`` runs it.

    PYTHON benchmarks/haystack_peer_worker.py build JOB.json     # writes the index under spec["dir"]
    PYTHON benchmarks/haystack_peer_worker.py measure JOB.json   # loads it, times it, writes spec["ids"]

Runs under the main virtual environment (triclip, plain FAISS) or under a peer's own (autofaiss needs
numpy < 2): it imports only numpy and the method's own package, so a peer is measured with its real package.
A spec (JSON): ``method`` (a key of :data:`METHODS`), ``dir`` (the index folder), ``npy`` (a folder of the
haystack's float32 rows as ``NNNN.npy``, in row order), ``queries`` (Q, D) .npy, ``ids`` (where measure writes
the (Q, 10) row ids), and the method's own fields. One JSON line on stdout: what was built or measured.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import numpy as np

K = 10  # neighbours asked for, timed and returned
WARMUP = 20  # queries searched before timing
K_FACTORS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # IndexRefineFlat: candidates = k_factor x 10


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


def dir_bytes(folder: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "**"), recursive=True) if os.path.isfile(p))


# ---------------------------------------------------------------------------- plain FAISS: IVF + PQ fast scan + refine


def faiss_build(spec: dict) -> dict:
    """``IVF{nlist},PQ{M}x4fs`` trained on a sample, filled part by part, wrapped in ``IndexRefineFlat`` (the float
    rows in memory); nprobe and k_factor tuned on the validation queries to spec["target"] of their exact top 10."""
    import faiss
    parts = npy_parts(spec["npy"])
    dim = parts[0].shape[1]
    base = faiss.index_factory(dim, f"IVF{spec['nlist']},PQ{spec['M']}x4fs", faiss.METRIC_INNER_PRODUCT)
    base.train(sample_rows(parts, spec["train_rows"]))
    index = faiss.IndexRefineFlat(base)
    for part in parts:
        index.add(np.ascontiguousarray(part, np.float32))
    tune_q, truth = np.load(spec["tune_queries"]), np.load(spec["tune_truth"])[:, :K]
    nprobe, k_factor, held = faiss_tune(index, tune_q, truth, spec["target"])
    faiss.write_index(index, os.path.join(spec["dir"], "index.faiss"))
    params = {"nprobe": nprobe, "k_factor": k_factor, "held_on_val": held}
    with open(os.path.join(spec["dir"], "params.json"), "w") as fh:
        json.dump(params, fh)
    return params


def faiss_tune(index, queries: np.ndarray, truth: np.ndarray, target: float) -> tuple[int, int, float]:
    """Per power-of-two nprobe the smallest k_factor whose top 10 holds ``target`` of ``truth``; of those pairs
    the fastest on one thread over the queries (timed). Returns nprobe, k_factor, share held."""
    import faiss
    faiss.omp_set_num_threads(1)
    ivf, found, nprobe = faiss.extract_index_ivf(index), [], 1
    while nprobe <= ivf.nlist:
        ivf.nprobe = nprobe
        for k_factor in K_FACTORS:
            index.k_factor = k_factor
            held = overlap(index.search(queries, K)[1], truth)
            if held >= target:
                found.append((nprobe, k_factor, held))
                break
        nprobe *= 2
    if not found:
        return ivf.nlist, K_FACTORS[-1], held
    times = []
    for nprobe, k_factor, _ in found:
        ivf.nprobe, index.k_factor = nprobe, k_factor
        started = time.perf_counter()
        for q in queries:
            index.search(q[None], K)
        times.append(time.perf_counter() - started)
    return found[int(np.argmin(times))]


def faiss_load(spec: dict):
    import faiss
    index = faiss.read_index(os.path.join(spec["dir"], "index.faiss"))
    with open(os.path.join(spec["dir"], "params.json")) as fh:
        params = json.load(fh)
    faiss.extract_index_ivf(index).nprobe = params["nprobe"]
    index.k_factor = params["k_factor"]
    return faiss_searcher(index)


def faiss_searcher(index):
    import faiss

    def search(q: np.ndarray, threads: int) -> np.ndarray:
        faiss.omp_set_num_threads(threads)
        return index.search(q, K)[1]
    return search


# ---------------------------------------------------------------------------- autofaiss


def autofaiss_build(spec: dict) -> dict:
    """``autofaiss.build_index`` on the .npy folder, inner product, the memory and query-time bounds of the spec."""
    import autofaiss
    import faiss
    index_path = os.path.join(spec["dir"], "knn.index")
    infos_path = os.path.join(spec["dir"], "index_infos.json")
    autofaiss.build_index(embeddings=spec["npy"], index_path=index_path, index_infos_path=infos_path,
                          max_index_memory_usage=spec["max_memory"], max_index_query_time_ms=spec["latency_ms"],
                          current_memory_available=spec["memory_available"], metric_type="ip",
                          nb_cores=spec["cores"], verbose=30)
    if not os.path.isfile(index_path):
        raise RuntimeError(f"autofaiss wrote no index for max_index_memory_usage={spec['max_memory']}")
    with open(infos_path) as fh:
        infos = json.load(fh)
    return {"label": infos.get("index_key"), "index_param": infos.get("index_param"), "faiss": faiss.__version__,
            "autofaiss": autofaiss_version(), "code_bytes": code_size(faiss.read_index(index_path))}


def code_size(index) -> int:
    """Bytes of one vector's code in a FAISS index (its inverted lists' codes when it has them)."""
    import faiss
    try:
        return int(faiss.extract_index_ivf(index).code_size)
    except RuntimeError:
        return int(index.sa_code_size())


def autofaiss_version() -> str:
    from importlib.metadata import version
    return version("autofaiss")


def autofaiss_load(spec: dict):
    import faiss
    print(f"searched with faiss {faiss.__version__}", file=sys.stderr)
    return faiss_searcher(faiss.read_index(os.path.join(spec["dir"], "knn.index")))


# ---------------------------------------------------------------------------- usearch


USEARCH_METRIC = {"b1": "hamming", "i8": "ip", "f16": "ip", "f32": "ip"}  # b1 vectors are bits: Hamming


def usearch_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """Rows as usearch takes them: sign bits packed for b1, float32 otherwise."""
    x = np.asarray(x, np.float32)
    return np.packbits(x > 0, axis=1) if dtype == "b1" else np.ascontiguousarray(x)


def usearch_build(spec: dict) -> dict:
    from usearch.index import Index
    parts = npy_parts(spec["npy"])
    dim, dtype = parts[0].shape[1], spec["dtype"]
    index = Index(ndim=dim, metric=USEARCH_METRIC[dtype], dtype=dtype)
    done = 0
    for part in parts:
        index.add(np.arange(done, done + len(part)), usearch_rows(part, dtype), threads=spec["cores"])
        done += len(part)
    index.save(os.path.join(spec["dir"], "index.usearch"))
    return {"connectivity": int(index.connectivity), "expansion_search": int(index.expansion_search),
            "usearch": usearch_version(), "memory_usage": int(index.memory_usage)}


def usearch_version() -> str:
    from importlib.metadata import version
    return version("usearch")


def usearch_load(spec: dict):
    from usearch.index import Index
    index = Index.restore(os.path.join(spec["dir"], "index.usearch"))

    def search(q: np.ndarray, threads: int) -> np.ndarray:
        keys = index.search(usearch_rows(q, spec["dtype"]), K, threads=threads).keys
        return np.asarray(keys, np.int64).reshape(len(q), -1)
    return search


# ---------------------------------------------------------------------------- triclip (its own index folder)


def triclip_load(spec: dict):
    """The index folder's live version, searched by budget with the stages its build recorded (no model: the
    queries are vectors already)."""
    from triclip.codecs.threads import set_search_threads
    from triclip.index.search import Searcher
    from triclip.index.store import load_contents
    contents = load_contents(spec["dir"])
    searcher = Searcher(contents, None, None, None)
    row = {m["id"]: i for i, m in enumerate(contents.meta)}

    def search(q: np.ndarray, threads: int) -> np.ndarray:
        set_search_threads(threads)
        hits = searcher.search_vectors(q, K, bytes=spec["bytes"])
        return np.array([[row[h["id"]] for h in hs] + [-1] * (K - len(hs)) for hs in hits], np.int64)
    return search


METHODS = {  # method -> (build, load); triclip's index is built by its own CLI (benchmarks.haystack_peers)
    "faiss": (faiss_build, faiss_load),
    "autofaiss": (autofaiss_build, autofaiss_load),
    "usearch": (usearch_build, usearch_load),
    "triclip": (None, triclip_load),
}


# ---------------------------------------------------------------------------- measuring a loaded index


def overlap(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each row of ``truth`` (Q, k) found in the same row of ``found`` (Q, >= k)."""
    return float(np.mean([len(set(f.tolist()) & set(t.tolist())) / len(t) for f, t in zip(found, truth)]))


def single_query_ms(search, queries: np.ndarray, threads: int) -> list[float]:
    """Milliseconds of each query searched alone (after :data:`WARMUP` untimed ones)."""
    for q in queries[:WARMUP]:
        search(q[None], threads)
    out = []
    for q in queries:
        started = time.perf_counter()
        search(q[None], threads)
        out.append(1000 * (time.perf_counter() - started))
    return out


def measure(spec: dict) -> dict:
    """RSS delta of loading, single-query p50 / p99 on 1 and 2 threads, batch queries/s on 2 threads; the top-10
    row ids of every query go to spec["ids"]."""
    queries = np.ascontiguousarray(np.load(spec["queries"]), np.float32)
    before = rss_bytes()
    started = time.perf_counter()
    search = METHODS[spec["method"]][1](spec)
    out = {"load_s": round(time.perf_counter() - started, 2), "rss_bytes": rss_bytes() - before}
    for threads in (1, 2):
        ms = single_query_ms(search, queries, threads)
        out[f"p50_ms_{threads}t"], out[f"p99_ms_{threads}t"] = (round(float(v), 3) for v in np.percentile(ms, [50, 99]))
    batch = []
    for _ in range(3):
        started = time.perf_counter()
        ids = search(queries, 2)
        batch.append(time.perf_counter() - started)
    out["batch_qps_2t"] = round(len(queries) / float(np.median(batch)), 1)
    out["rss_after_bytes"] = rss_bytes() - before
    np.save(spec["ids"], ids)
    return out


def main(argv: list[str] | None = None) -> None:
    step, path = (sys.argv[1:] if argv is None else argv)
    with open(path) as fh:
        spec = json.load(fh)
    if step == "build":
        started = time.perf_counter()
        result = METHODS[spec["method"]][0](spec)
        result["build_s"] = round(time.perf_counter() - started, 1)
        result["disk_bytes"] = dir_bytes(spec["dir"])
    else:
        result = measure(spec)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
