"""The OpenMP threads a FAISS search runs with, set in the thread that searches.

OpenMP's thread count is per thread: ``faiss.omp_set_num_threads(1)`` in the main thread leaves every other
thread at the process default (the number of cores, or ``OMP_NUM_THREADS``). A server answering from worker
threads (Gradio's, the JSON route's, a user's thread pool) therefore searched with a team of that many OpenMP
threads per query; FAISS's residual-quantiser search spins them, and on the 2-core machine 20 such threads
cost 30.6 ms of CPU per query against 0.22 ms with one thread each (docs/benchmarks.md).

:func:`set_search_threads` sets the count for every search from then on, in whatever thread;
:func:`in_search_thread` is called at every search entry (``triclip.index.faiss_index.search``,
``triclip.codecs.Codec.search``, ``triclip.index.search.Searcher.search_vectors``) and applies it to the
calling thread when that thread's count differs (one call to OpenMP, ~1 µs; nothing when it already matches).
:func:`all_cores` is the builder's: adds and encodes in its block run with the process default (every core
unless ``OMP_NUM_THREADS`` says otherwise), whatever a server set for its searches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import faiss

_DEFAULT = int(faiss.omp_get_max_threads())  # the process default, read once when this module is first imported
_threads: int = _DEFAULT  # the serving count: what every search runs with


def set_search_threads(threads: int | None) -> None:
    """Every later FAISS search, in any thread, runs with ``threads`` OpenMP threads (None: the process default)."""
    global _threads
    if threads is not None and (isinstance(threads, bool) or int(threads) < 1):
        raise ValueError(f"search threads must be a positive integer, got {threads!r}")
    _threads = _DEFAULT if threads is None else int(threads)
    in_search_thread()


def search_threads() -> int:
    """The OpenMP threads each search runs with."""
    return _threads


def in_search_thread() -> None:
    """Give the calling thread the serving count of OpenMP threads (a no-op when it has it already)."""
    if faiss.omp_get_max_threads() != _threads:
        faiss.omp_set_num_threads(_threads)


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """FAISS work of the calling thread in this block (adds, encodes, training) runs with the process default of
    OpenMP threads, not the serving count; the thread's count is restored after."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(_DEFAULT)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
