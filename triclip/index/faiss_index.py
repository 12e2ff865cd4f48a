"""Vector-level FAISS layer: choose a factory, build, search, save and load an index.

Every index uses the inner product (``METRIC_INNER_PRODUCT``) on L2-normalised
vectors, so scores are cosine similarities. FAISS: https://github.com/facebookresearch/faiss

``auto`` chooses like autofaiss (https://github.com/criteo/autofaiss), by size and memory:

- ``Flat`` (exact) below ``flat_max`` = 100,000 vectors: exact search of 100k vectors
  takes a few milliseconds per query and needs no training;
- ``HNSW32`` up to ``hnsw_max`` = 5,000,000 vectors when its memory (the vectors plus
  about 2 x 32 int32 links per vector at level 0) fits in ``memory_fraction`` of the
  available memory;
- ``IVF{nlist},PQ{M}`` beyond (or when HNSW does not fit): ``nlist`` the power of two
  nearest ``sqrt(n)`` (at most ``n / 39``, FAISS' minimum training points per list),
  ``M`` = about m/4 sub-quantizers of 8 bits, i.e. m/4 bytes per vector instead of 4m
  (16x smaller). That is a memory-first choice: on the benchmark's synthetic stand-in
  (200k vectors, m = 64) recall@10 against exact search is 0.62 with PQ16 (m/4) and 0.78
  with PQ32 (m/2) at nprobe 16; pass ``--factory IVF{nlist},PQ{m/2}`` when recall matters
  more than memory.

Run-time settings (:class:`SearchParams`, passed per call as ``faiss.SearchParameters*``, never
set on the shared index): IVF visits ``min(nlist, max(8, nlist // 32))``
lists, HNSW keeps ``max(64, 2k)`` candidates.

With a GPU and faiss-gpu, Flat and IVF indexes are moved to the GPU to build and search
(:func:`to_device`); they are always saved from a CPU copy.

On disk (:func:`merge_on_disk`, :func:`load` with ``on_disk=True``): an IVF index whose
inverted lists live in a ``.ivfdata`` file (``faiss.OnDiskInvertedLists``, as in
``faiss.contrib.ondisk``), memory-mapped read-only, so the lists are paged in by the
kernel as queries touch them and never copied into the process. The ``.faiss`` file
records the lists file's absolute path at writing time; it is read back with
``IO_FLAG_ONDISK_SAME_DIR`` (the lists file is looked up beside the ``.faiss`` file), so
a folder can be moved or copied. FAISS prints a line to stdout (the C ``printf``) when
it resizes or relocates such a file; that is silenced, since ``--json`` output goes there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import faiss
import numpy as np
from triclip.core.progress import progress as progress_bar
from triclip.codecs import ondisk
from triclip.codecs.ondisk import (  # noqa: F401  (also read as fi.*)
    is_on_disk, ivf_list_bytes, ivf_or_none, merge_on_disk, on_disk_lists, quiet_stdout, relocate_lists)
from triclip.codecs.threads import in_search_thread

METRIC = faiss.METRIC_INNER_PRODUCT
# threads prefetching the lists of an on-disk index per search (FAISS's default). benchmarks/bench_shards.py
# on 2 cores: with the lists in the page cache, 0 threads search ~1.4x faster; read cold from the disk, 32 were
# up to 2.6x faster (in one of two runs). An index goes on disk when it does not fit in memory: cold reads.
PREFETCH_THREADS = 32
ADD_BATCH = 65_536  # vectors added per call (bounds temporary memory, drives the progress bar)


@dataclass
class AutoPolicy:
    """Thresholds of the ``auto`` factory (see the module docstring)."""

    flat_max: int = 100_000  # exact Flat search below this many vectors
    hnsw_max: int = 5_000_000  # HNSW32 up to this many vectors, if it fits in memory
    hnsw_links: int = 32  # HNSW neighbours per node (M)
    memory_fraction: float = 0.5  # share of the available memory the index may take

    def __post_init__(self) -> None:
        if not 0 < self.flat_max <= self.hnsw_max:
            raise ValueError("AutoPolicy needs 0 < flat_max <= hnsw_max")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError("AutoPolicy.memory_fraction must be in (0, 1]")


@dataclass
class SearchParams:
    """Run-time search settings of approximate indexes (ignored where they do not apply)."""

    nprobe: int | None = None  # IVF lists visited per query; None = min(nlist, max(8, nlist // 32))
    ef_search: int | None = None  # HNSW candidate list size; None = max(64, 2k)


# ---------------------------------------------------------------------------- choosing


def available_memory() -> int:
    """Bytes of physical memory available now (Linux sysconf; 8 GiB where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def hnsw_bytes(n: int, dim: int, links: int = 32) -> int:
    """Approximate memory of an HNSW index: float32 vectors plus int32 links (2M at level 0, ~M above)."""
    return n * (4 * dim + 4 * (2 * links + links // 2) + 16)


def ivf_nlist(n: int) -> int:
    """Number of IVF lists for ``n`` vectors: power of two nearest sqrt(n), at most n / 39, at least 1."""
    if n < 1:
        raise ValueError("ivf_nlist needs n >= 1")
    nlist = 2 ** round(math.log2(max(1.0, math.sqrt(n))))
    while nlist > 1 and nlist * 39 > n:
        nlist //= 2
    return min(nlist, 65_536)


def pq_subquantizers(dim: int, dims_per_code: int = 4) -> int:
    """PQ sub-quantizers for ``dim``: the largest divisor of ``dim`` not above ``dim / dims_per_code``."""
    target = max(1, dim // dims_per_code)
    return max(d for d in range(1, target + 1) if dim % d == 0)


def ivf_pq_factory(n: int, dim: int) -> str:
    """``IVF{nlist},PQ{M}`` sized for ``n`` vectors of dimension ``dim``."""
    return f"IVF{ivf_nlist(n)},PQ{pq_subquantizers(dim)}"


def auto_factory(
    n: int, dim: int, memory_bytes: int | None = None, policy: AutoPolicy | None = None, budget: int | None = None
) -> str:
    """The one ``auto`` policy: factory string for ``n`` vectors of dimension ``dim``.

    ``Flat`` below ``flat_max`` vectors, ``HNSW32`` up to ``hnsw_max``, ``IVF{nlist},Flat``
    (up to ``hnsw_max``) when HNSW's links do not fit but the float codes do, else
    ``IVF{nlist},PQ{M}``; each only when it fits ``budget`` bytes (None:
    ``memory_fraction`` of ``memory_bytes``, itself None: of the available memory).
    """
    if n < 0 or dim < 1:
        raise ValueError(f"auto_factory needs n >= 0 and dim >= 1, got n={n}, dim={dim}")
    policy = policy or AutoPolicy()
    if budget is None:
        budget = (available_memory() if memory_bytes is None else memory_bytes) * policy.memory_fraction
    flat = n * dim * 4  # float32 codes
    if n < policy.flat_max and flat <= budget:
        return "Flat"
    if n <= policy.hnsw_max and hnsw_bytes(n, dim, policy.hnsw_links) <= budget:
        return f"HNSW{policy.hnsw_links}"
    if n <= policy.hnsw_max and flat + 8 * n <= budget:  # codes + ids of an IVF-Flat
        return f"IVF{ivf_nlist(n)},Flat"
    return ivf_pq_factory(n, dim)


# ---------------------------------------------------------------------------- building


def new_index(dim: int, factory: str) -> faiss.Index:
    """An empty inner-product index from a factory string; ValueError names a bad string."""
    if dim < 1:
        raise ValueError(f"index dimension must be >= 1, got {dim}")
    if "IDMap" in factory:
        raise ValueError(f"factory {factory!r}: IDMap is not supported, ids are the rows' positions")
    try:
        return faiss.index_factory(int(dim), factory, METRIC)
    except RuntimeError as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else "rejected by FAISS"
        raise ValueError(f"bad FAISS factory string {factory!r} for dimension {dim}: {reason}") from None


def as_float32(vectors: np.ndarray, dim: int | None = None) -> np.ndarray:
    """C-contiguous float32 (N, d) array; ValueError on a wrong shape or non-finite value."""
    arr = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32))
    if arr.ndim != 2 or (dim is not None and arr.shape[1] != dim):
        raise ValueError(f"expected vectors of shape (N, {dim or 'd'}), got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("vectors contain NaN or infinity")
    return arr


def train_sample(vectors: np.ndarray, index: faiss.Index, seed: int = 0) -> np.ndarray:
    """Rows to train on: 64 per IVF list (at least 20,000, all if fewer), drawn without replacement."""
    ivf = ivf_or_none(index)
    want = max(20_000, 64 * ivf.nlist) if ivf is not None else 20_000
    if len(vectors) <= want:
        return vectors
    rows = np.sort(np.random.default_rng(seed).choice(len(vectors), size=want, replace=False))
    return vectors[rows]


def add_vectors(index: faiss.Index, vectors: np.ndarray, progress: bool = False) -> None:
    """Append vectors in batches (ids continue from ``index.ntotal``)."""
    vectors = as_float32(vectors, index.d)
    starts = range(0, len(vectors), ADD_BATCH)
    for start in progress_bar(starts, desc="indexing", unit="batch", disable=not progress or len(starts) < 2):
        index.add(vectors[start : start + ADD_BATCH])


def build(
    vectors: np.ndarray, factory: str, seed: int = 0, progress: bool = False, gpu: bool | None = None
) -> faiss.Index:
    """Train (when needed) and fill a CPU index; on a GPU when asked (``None``: when present).

    Args:
        vectors: L2-normalised vectors. Shape: (N, d).
        factory: FAISS factory string (``auto`` is resolved by the caller, :func:`auto_factory`).
        seed: seed of the training sample and of k-means.
        progress: show progress while adding.
        gpu: move to the GPU for training and adding when possible.

    Returns:
        The index, on the CPU.
    """
    vectors = as_float32(vectors)
    index = new_index(vectors.shape[1], factory)
    _prepare_training(index, seed)
    work = to_device(index, gpu)
    if not work.is_trained:
        sample = train_sample(vectors, index, seed)
        need, why = min_train_vectors(index)
        if len(sample) < need:
            raise ValueError(
                f"{factory} needs at least {need} training vectors ({why}), got {len(vectors)};"
                " use fewer lists / codes or Flat / HNSW32"
            )
        try:
            work.train(sample)
        except RuntimeError as err:
            raise ValueError(f"{factory}: FAISS could not train it: {_last_line(err)}") from None
    add_vectors(work, vectors, progress)
    return to_cpu(work)


def min_train_vectors(index: faiss.Index) -> tuple[int, str]:
    """Fewest training vectors FAISS accepts for ``index`` (one per k-means centroid) and why."""
    need, why = 1, "no training"
    ivf = ivf_or_none(index)
    if ivf is not None:
        need, why = ivf.nlist, f"one per IVF list: {ivf.nlist} lists"
    inner = faiss.downcast_index(ivf) if ivf is not None else faiss.downcast_index(index)
    storage = getattr(inner, "storage", None)  # HNSW over PQ codes
    pq = getattr(inner, "pq", None)
    if pq is None and storage is not None:
        pq = getattr(faiss.downcast_index(storage), "pq", None)
    if pq is not None and pq.ksub > need:
        need, why = int(pq.ksub), f"one per PQ centroid: {pq.ksub} per sub-quantizer"
    return need, why


def _last_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[-1].split("failed: ")[-1] if text else "rejected by FAISS"


def _prepare_training(index: faiss.Index, seed: int) -> None:
    """Seed k-means; skip polysemous PQ training (only for Hamming filtering, unused here, and slow)."""
    ivf = ivf_or_none(index)
    if ivf is not None:
        ivf.cp.seed = seed
        ivf = faiss.downcast_index(ivf)
        if hasattr(ivf, "do_polysemous_training"):
            ivf.do_polysemous_training = False


# ---------------------------------------------------------------------------- devices


def gpu_available() -> bool:
    """True when faiss has GPU support and sees at least one GPU."""
    return hasattr(faiss, "index_cpu_to_all_gpus") and faiss.get_num_gpus() > 0


def to_device(index: faiss.Index, gpu: bool | None = None) -> faiss.Index:
    """A GPU copy of a Flat / IVF index when ``gpu`` (``None``: when one is present); else ``index``.

    An on-disk index stays where it is (a GPU copy would load its lists into GPU memory).
    """
    if is_on_disk(index) or not (gpu_available() if gpu is None else gpu and gpu_available()):
        return index
    try:
        return faiss.index_cpu_to_all_gpus(index)
    except (RuntimeError, AttributeError):  # HNSW and some wrappers have no GPU version
        return index


def to_cpu(index: faiss.Index) -> faiss.Index:
    """The CPU version of ``index`` (itself when already on the CPU)."""
    if "Gpu" in type(index).__name__ and hasattr(faiss, "index_gpu_to_cpu"):
        return faiss.index_gpu_to_cpu(index)
    return index


# ---------------------------------------------------------------------------- searching


def search_parameters(index: faiss.Index, k: int, params: SearchParams | None = None):
    """Per-call ``faiss.SearchParameters`` for ``index`` (``None`` for exact indexes).

    Passed to ``index.search(x, k, params=...)``: nothing is set on the (shared) index, so
    concurrent searches with different settings cannot race. Wrappers (``IndexPreTransform``,
    ``IndexRefine``) get their wrapper parameters around the inner index's.
    """
    params = params or SearchParams()
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexPreTransform):
        inner = search_parameters(index.index, k, params)
        return None if inner is None else _keep(faiss.SearchParametersPreTransform(index_params=inner), inner)
    if isinstance(index, faiss.IndexRefine):
        inner = search_parameters(index.base_index, k, params)
        return None if inner is None else _keep(faiss.IndexRefineSearchParameters(base_index_params=inner), inner)
    if isinstance(index, faiss.IndexHNSW):
        return faiss.SearchParametersHNSW(efSearch=params.ef_search or max(64, 2 * k))
    ivf = ivf_or_none(index)
    if ivf is None and hasattr(index, "nprobe"):  # a GPU IVF index
        ivf = index
    if ivf is not None:
        nlist = ivf.nlist if hasattr(ivf, "nlist") else ivf.getNumLists()
        return faiss.SearchParametersIVF(nprobe=params.nprobe or min(nlist, max(8, nlist // 32)))
    return None


def _keep(outer, inner):
    """Hold a Python reference to ``inner`` on ``outer`` (SWIG does not own nested parameters)."""
    outer._inner = inner
    return outer


def search(
    index: faiss.Index, queries: np.ndarray, k: int, params: SearchParams | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by inner product.

    Args:
        index: a built index.
        queries: L2-normalised queries. Shape: (Q, d).
        k: hits per query (clipped to the index size).
        params: run-time settings of approximate indexes.

    Returns:
        ``(scores (Q, k'), ids (Q, k'))``, best first; an approximate index may pad a row
        with id -1 (score -inf) when it found fewer than k' vectors.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    in_search_thread()  # this thread's OpenMP count is the serving count (triclip.codecs.threads)
    queries = as_float32(queries, index.d)
    k = min(int(k), int(index.ntotal))
    if k == 0:
        return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
    scores, ids = index.search(queries, k, params=search_parameters(index, k, params))
    return scores, ids


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each true top-k row present in the found row. Shapes: (Q, k), (Q, k)."""
    if found.shape[0] != truth.shape[0]:
        raise ValueError("found and truth need the same number of rows")
    hits = [len(set(f.tolist()) & set(t.tolist())) / max(1, len(t)) for f, t in zip(found, truth)]
    return float(np.mean(hits)) if hits else 0.0


def bytes_per_vector(index: faiss.Index) -> float:
    """Serialized index size divided by its number of vectors."""
    if index.ntotal == 0:
        raise ValueError("empty index")
    return faiss.serialize_index(to_cpu(index)).nbytes / index.ntotal


# ---------------------------------------------------------------------------- files


def save(index: faiss.Index, path: str | os.PathLike) -> None:
    """Write atomically (``triclip.codecs.ondisk.save``) a CPU copy of ``index``."""
    ondisk.save(to_cpu(index), path)


def load(path: str | os.PathLike, on_disk: bool = False, prefetch_threads: int = PREFETCH_THREADS) -> faiss.Index:
    """Read an index written by :func:`save`; ValueError when the file is missing or not an index.

    ``on_disk``: the index's lists are in a ``.ivfdata`` file beside ``path`` (whatever
    path it was written at); they are memory-mapped read-only, not loaded.
    ``prefetch_threads``: threads FAISS starts per search to touch the lists it will
    read (``OnDiskInvertedLists.prefetch_nthread``, FAISS's default 32).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"no FAISS index at {path}")
    try:
        if not on_disk:
            return faiss.read_index(path)
        with quiet_stdout():
            index = faiss.read_index(path, faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError as err:
        why = f" ({_last_line(err)})" if on_disk else ""
        raise ValueError(f"{path} is not a readable FAISS index{why}") from None
    if on_disk_lists(index) is not None:
        on_disk_lists(index).prefetch_nthread = prefetch_threads
    return index
