"""How long one query takes, one thread, on a code holding the collection's N vectors: measured, or extrapolated.

``index build --bytes B`` keeps the best code that answers within a latency (``--latency-ms``; by default the
exact float32 scan of the same N vectors at full D, :meth:`LatencyModel.float_scan`). A code is timed on a copy
holding a sample of the collection (at most ``triclip.index.budgets.FIT_ROWS`` rows), filled up with random
entries to min(N, :data:`TIME_ROWS`) (a scan's cost depends on how many codes it reads, not on what they say):

- ``measured``: N <= :data:`TIME_ROWS`; the median of single-query searches at N entries.
- ``extrapolated``: a larger N. The time of a query at :data:`TIME_ROWS` entries is split into what comes before
  the scan (timed on a copy holding :data:`TINY` rows: lookup tables, the coarse quantiser of inverted lists) and
  the scan, which grows with the codes scanned: ``fixed + (timed - fixed) x N / TIME_ROWS``. Timing grows faster
  than linearly where the codes stop fitting in the CPU caches (a flat float32 scan of D = 256, one thread, shared
  2 cores: 1.8 ms at 20k, 87 ms at 100k), so :data:`TIME_ROWS` is past that point; beyond it the scan streams
  from memory.
- ``extrapolated``, inverted lists: the code stored at N is refitted with the lists N will have
  (``triclip.codecs.ivf.lists_for``), not the sample's (capped by its 20,000 rows), so a query there scans
  nprobe / nlist_N of N rows, not the sample's share (:func:`lists_ms`). At 10M rows and 32 B, lists of OPQ timed
  with the sample's 128 lists (16 probed: 12.5% of the rows) were put at 14.7 ms and never measured at N; with
  16,384 lists a probe of 64 reads 0.4% of them.

Before a slow-to-train code is fitted, its *probe* (:meth:`LatencyModel.probe`) times a twin with the same
structure and random codebooks (nothing to train), filled with random codes, against the float scan timed again
beside it: a code whose scan alone is slower than the bound is left out unfitted. Timing runs with one OpenMP
thread (``triclip.codecs.threads``).

Tests inject their own :class:`LatencyModel` (fixed numbers), so nothing is timed there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import faiss
import numpy as np

from triclip.codecs.base import Codec
from triclip.codecs.ivf import lists_for
from triclip.codecs.threads import search_threads, set_search_threads

REPS = 25  # single queries timed per measurement (the median is kept)
COLD_QUERIES = 75  # single queries timed end to end, cold (cold_search): the median of 25 moved by 1 ms at 10M
TINY = 64  # rows of the copy that times a query's fixed cost (before the scan)
TIME_ROWS = 200_000  # entries a code (or the float reference) is timed at before its time is scaled to N
NPROBE_GROWTH = 4  # lists at N are charged this many times the sample's nprobe (at most a quarter of nlist_N):
# tuned at N, nprobe was 0.5-4 x the sample's in the 10 builds at 1M and 10M rows of docs/results_scale.md


@dataclass(frozen=True)
class Latency:
    """One query's time, and how it was obtained."""

    ms: float  # milliseconds, one query, one thread
    how: str  # "measured" (at the collection's size), "extrapolated" (from a sample), "given" (an injected model)

    def plus(self, ms: float) -> "Latency":
        return Latency(self.ms + ms, self.how)

    def to_json(self) -> dict:
        return {"ms": round(self.ms, 4), "how": self.how}


class LatencyModel:
    """Single-query latencies, one thread, timed on this machine (the median of :data:`REPS` queries)."""

    def search(self, codec, queries: np.ndarray, k: int, n: int, params: dict | None = None) -> Latency:
        """A query for the top ``k`` of ``codec`` at N = ``n`` vectors. ``codec``: a copy holding a sample of the
        collection; it is filled up here with random entries to min(n, :data:`TIME_ROWS`)."""
        rows = min(n, TIME_ROWS)
        if len(codec) < rows:
            codec.add_random(rows - len(codec), np.random.default_rng(len(codec)))
        timed = _median_ms(lambda q: codec.search(q, k, params=params), queries)
        if n <= len(codec):
            return Latency(timed, "measured")
        tiny = codec.empty_copy()
        tiny.add_random(TINY, np.random.default_rng(1))
        fixed = min(timed, _median_ms(lambda q: tiny.search(q, min(k, TINY), params=params), queries))
        if not hasattr(codec, "sized_for"):  # a flat code, or binary lists (not refitted for N: N's rows fill the
            return Latency(fixed + (timed - fixed) * n / len(codec), "extrapolated")  # sample's lists): by the rows
        # lists refitted for N (IVFCodec.sized_for) get N's lists
        nlist = codec.exhaustive()["nprobe"]  # an exhaustive search probes every list
        nprobe = int((params or {}).get("nprobe", codec.spec.params["nprobe"]))
        coarse = self.coarse_ms(codec.spec.m, *lists_at_n(n, nprobe), queries)
        return Latency(lists_ms(timed, fixed, coarse, len(codec), nlist, nprobe, n), "extrapolated")

    def coarse_ms(self, m: int, nlist: int, nprobe: int, queries: np.ndarray) -> float:
        """Milliseconds to pick the ``nprobe`` nearest of ``nlist`` lists for one query (a flat inner-product scan
        of ``nlist`` random centroids of width ``m``, as an IVF's coarse quantiser does); timed once per shape."""
        cache = self.__dict__.setdefault("_coarse", {})
        if (m, nlist, nprobe) not in cache:
            rng = np.random.default_rng(0)
            centroids = rng.standard_normal((nlist, m), dtype=np.float32)
            quantiser = faiss.IndexFlatIP(m)
            quantiser.add(centroids / np.linalg.norm(centroids, axis=1, keepdims=True))
            x = np.ascontiguousarray(np.resize(queries, (len(queries), m)), np.float32)  # only the time matters
            cache[m, nlist, nprobe] = _median_ms(lambda q: quantiser.search(q, nprobe), x)
        return cache[m, nlist, nprobe]

    def rerank(self, vectors: np.ndarray, queries: np.ndarray, count: int) -> float:
        """Milliseconds to re-rank ``count`` candidates of one query by the float vectors (N, D) in memory."""
        from triclip.index.search import rerank

        rng = np.random.default_rng(0)
        candidates = rng.integers(0, len(vectors), (1, count))
        return _median_ms(lambda q: rerank(vectors, q, candidates, 10), queries)

    def cold_rows(self, file: str, count: int) -> float:
        """Milliseconds to read ``count`` random rows of the vectors ``file`` from disk, cold, as a re-rank that
        reads from disk gathers them (``triclip.index.diskrows.cold_read_ms``; timed once per file and count)."""
        from triclip.index.diskrows import cold_read_ms

        cache = self.__dict__.setdefault("_cold_rows", {})
        if (file, count) not in cache:
            cache[file, count] = cold_read_ms(file, count)
        return cache[file, count]

    def cold_search(self, codes, file: str, queries: np.ndarray, length: int, k: int = 10,
                    sq8: np.ndarray | None = None) -> float:
        """Median milliseconds of one query searched as a stored two-stage budget whose float vectors are read
        from disk: the top ``length`` of ``codes`` (filled, its nprobe set), their rows gathered from ``file``
        (``triclip.index.diskrows.DiskRows``) and re-ranked to ``k``, end to end; before each query (not timed)
        its rows are read once and the file evicted from the page cache (``triclip.index.diskrows.settle``: what
        "cold" is). The parts timed apart and summed miss some of it: at 10M rows, 16 B, a shortlist of 500
        summed to 9.8 ms and ran in 9.7-11.1 ms (the code's scan is slower right after an eviction, and cold
        reads vary). ``sq8``: the file holds sq8 codes of these ranges (``triclip.index.vectors.SQ8Rows``), decoded
        as a served re-rank decodes them."""
        from triclip.index.diskrows import DiskRows, settle
        from triclip.index.search import rerank_from
        from triclip.index.vectors import SQ8Rows

        rows = DiskRows(file)
        source = rows if sq8 is None else SQ8Rows(rows, sq8)

        def query(q: np.ndarray) -> np.ndarray:
            return rerank_from(source, q, codes.search(q, length)[1], k)

        def cold(q: np.ndarray) -> None:  # its rows read once, then out of the page cache (diskrows.settle)
            settle(rows, codes.search(q, length)[1].reshape(-1))
        return _median_ms(query, queries, prepare=cold, reps=COLD_QUERIES)

    def float_scan(self, vectors: np.ndarray, queries: np.ndarray, n: int) -> Latency:
        """The exact float32 scan at full D (``IndexFlatIP``) of ``n`` vectors: a sample ``vectors`` (n_s, D), filled
        up with random rows as :meth:`search` does. Timed once per sample and N (every budget shares it)."""
        return self._float_scan(vectors, queries, n)[0]

    def _float_scan(self, vectors: np.ndarray, queries: np.ndarray, n: int) -> tuple[Latency, Codec, float]:
        """(:meth:`float_scan`, a flat code holding the sample alone, its ms timed then): the second is timed again
        beside each probe (:meth:`probe`), without refilling N's random rows."""
        key = (vectors.shape, n, float(np.asarray(vectors[0]).sum()))
        cache = self.__dict__.setdefault("_float_scans", {})
        if key not in cache:
            alone = _flat(vectors)
            cache[key] = (self.search(_flat(vectors), queries, 10, n), alone,
                          self.search(alone, queries, 10, len(vectors)).ms)
        return cache[key]

    def probe(self, spec, sample: np.ndarray, n: int, queries: np.ndarray) -> Latency | None:
        """A top-10 query on a twin of ``spec`` (:meth:`~triclip.codecs.Codec.probe`) holding N random
        codes (at most :data:`TIME_ROWS`, then scaled), in the time scale of :meth:`float_scan` of ``sample``
        (n_s, D): times the sample's flat scan timed with the float scan over the same scan timed right after the
        probe. The machine's speed drifts between the two: the demo's RQ4x8 probe for its image codes measured 1.34x
        the float scan timed seconds before it in one build and at most 1.0x in the next, where it was fitted for
        nothing (7 s). Ten repeats on the demo's vectors, seconds of fits between the bound and the probe: 0.85-1.58x
        raw (once under the bound), 1.04-1.38x scaled (never).
        None when the codec has no twin (it is cheap to fit: it is timed once fitted)."""
        from triclip.codecs import lookup

        twin = lookup(spec.codec).probe(spec, sample.shape[1])
        if twin is None:
            return None
        timed = self.search(twin, queries, 10, n)
        _, alone, then = self._float_scan(sample, queries, n)
        return Latency(timed.ms * then / self.search(alone, queries, 10, len(sample)).ms, timed.how)


def _flat(vectors: np.ndarray) -> Codec:
    """A float32 flat code of width D holding ``vectors`` (n, D)."""
    from triclip.codecs import CodecSpec, fit

    flat = fit(CodecSpec("float32", vectors.shape[1], 4 * vectors.shape[1]), vectors[:1])
    flat.add(vectors)
    return flat


def lists_at_n(n: int, nprobe: int) -> tuple[int, int]:
    """The lists a code refitted for ``n`` rows will have, and the nprobe it is charged there: the sample's
    ``nprobe`` times :data:`NPROBE_GROWTH`, at most a quarter of those lists (what tuning allows)."""
    nlist = lists_for(n)
    return nlist, max(1, min(NPROBE_GROWTH * nprobe, nlist // 4))


def lists_ms(timed: float, fixed: float, coarse: float, rows: int, nlist: int, nprobe: int, n: int) -> float:
    """One query's milliseconds on inverted lists holding ``n`` rows, from a timing on ``rows`` random entries in
    the sample's ``nlist`` lists at ``nprobe`` (``timed``; ``fixed`` of it before the scan): the cost per code
    scanned there, times the codes a query scans at N (:func:`lists_at_n`'s nprobe of its nlist, of ``n`` rows),
    plus ``fixed`` and the coarse search over N's lists (``coarse``)."""
    per_code = (timed - fixed) / (rows * min(nprobe, nlist) / nlist)
    nlist_n, nprobe_n = lists_at_n(n, nprobe)
    return fixed + coarse + per_code * n * nprobe_n / nlist_n


def _median_ms(search, queries: np.ndarray, prepare=lambda q: None, reps: int = REPS) -> float:
    """Median milliseconds of ``search(q)`` over ``reps`` single queries (cycling), one thread; ``prepare(q)`` runs
    untimed before each."""
    before = search_threads()
    set_search_threads(1)
    try:
        search(queries[:1])  # warm: first-call allocations
        times = []
        for i in range(reps):
            q = queries[i % len(queries) : i % len(queries) + 1]
            prepare(q)
            started = time.perf_counter()
            search(q)
            times.append(time.perf_counter() - started)
    finally:
        set_search_threads(before)
    return float(np.median(times) * 1000)
