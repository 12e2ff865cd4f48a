"""The funnel's pieces (``triclip.index.search``): the Flat shortlist, the vectorised re-rank, batched == one by one."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from triclip.index import faiss_index as fi
from triclip.index.vectors import exact_topk, prefix
import triclip.index.search as search_module
from triclip.index.search import RERANK_CHUNK, SHORTLIST_CHUNK, flat_vectors, matmul_shortlist, rerank, shortlist_flat

N, D, M = 500, 32, 8


def _unit(rng, n, d) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    base, queries = _unit(rng, N, D), _unit(rng, 3 * max(RERANK_CHUNK, SHORTLIST_CHUNK) + 5, D)  # several chunks
    small = fi.build(prefix(base, M), "Flat")
    return base, queries, small


def test_rerank_equals_exact_search_over_the_shortlist(data):
    base, queries, _ = data
    rng = np.random.default_rng(1)
    cand = np.stack([rng.choice(N, 40, replace=False) for _ in queries])  # (Q, 40)
    cand[::3, -5:] = -1  # some rows with missing candidates
    scores, ids = rerank(base, queries, cand, 10)
    assert scores.shape == ids.shape == (len(queries), 10)
    for q in range(len(queries)):
        pool = cand[q][cand[q] >= 0]
        exact = base[pool] @ queries[q]  # (C,)
        best = np.argsort(-exact, kind="stable")[:10]
        np.testing.assert_array_equal(ids[q], pool[best])
        np.testing.assert_allclose(scores[q], exact[best], rtol=1e-5, atol=1e-6)


def test_rerank_pads_when_fewer_candidates_than_k(data):
    base, queries, _ = data
    cand = np.array([[3, -1, 7, -1]])
    scores, ids = rerank(base, queries[:1], cand, 10)
    assert ids.shape == (1, 4) and sorted(ids[0, :2].tolist()) == [3, 7] and (ids[0, 2:] == -1).all()
    assert np.isneginf(scores[0, 2:]).all() and scores[0, 0] >= scores[0, 1]


def test_flat_shortlist_is_the_flat_index_top_c(data):
    _, queries, small = data
    q = prefix(queries, M)
    got = shortlist_flat(flat_vectors(small), q, 50)
    _, want = small.search(q, 50)
    assert got.shape == (len(q), 50)
    for g, w in zip(got, want):
        assert set(g.tolist()) == set(w.tolist())
    assert shortlist_flat(flat_vectors(small), q[:2], 10 * N).shape == (2, N)  # more wanted than stored: all


def test_flat_vectors_is_a_read_only_view_of_flat_indexes_only(data):
    base, _, small = data
    view = flat_vectors(small)
    np.testing.assert_array_equal(view, prefix(base, M))
    assert not view.flags.writeable
    assert flat_vectors(fi.build(prefix(base, M), "HNSW32")) is None
    assert flat_vectors(faiss.IndexFlatL2(M)) is None  # L2 distances: not our scores


def test_batched_funnel_equals_one_query_at_a_time(data):
    base, queries, small = data
    view = flat_vectors(small)

    def funnel(q):
        return rerank(base, q, shortlist_flat(view, prefix(q, M), 60), 10)

    scores, ids = funnel(queries)
    for i in range(len(queries)):
        s1, i1 = funnel(queries[i : i + 1])
        np.testing.assert_array_equal(ids[i], i1[0])
        np.testing.assert_allclose(scores[i], s1[0], rtol=1e-6)
    wide_scores, wide_ids = rerank(base, queries, shortlist_flat(view, prefix(queries, M), N), 10)  # everything: exact
    truth = exact_topk(base, queries, 10)
    np.testing.assert_array_equal(wide_ids, truth)
    np.testing.assert_allclose(wide_scores, np.take_along_axis(queries @ base.T, truth, axis=1), rtol=1e-5, atol=1e-6)


def test_large_flat_indexes_are_shortlisted_by_faiss(data, monkeypatch):
    _, _, small = data
    assert matmul_shortlist(small) is not None
    monkeypatch.setattr(search_module, "MATMUL_SHORTLIST_MAX", N - 1)
    assert matmul_shortlist(small) is None  # FAISS's heap is faster on large indexes
