"""The vector-level FAISS layer: approximate indexes against exact search, files, auto factory."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import pytest

from triclip.index import faiss_index as fi
from triclip.index.vectors import exact_topk

DIM = 32


def _clustered(n: int, seed: int, clusters: int = 40, noise: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, DIM))
    x = centres[rng.integers(0, clusters, n)] + noise * rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    base = _clustered(4000, seed=0)
    rng = np.random.default_rng(1)
    queries = base[rng.choice(len(base), 100, replace=False)] + 0.05 * rng.standard_normal((100, DIM))
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    return base, queries, exact_topk(base, queries, 10)


def test_exact_topk_matches_a_loop(data):
    base, queries, truth = data
    for q in range(5):
        scores = [float(np.dot(queries[q], base[i])) for i in range(len(base))]
        assert truth[q].tolist() == sorted(range(len(base)), key=lambda i: -scores[i])[:10]


def test_flat_is_exact_with_cosine_scores(data):
    base, queries, truth = data
    index = fi.build(base, "Flat")
    scores, ids = fi.search(index, queries, 10)
    np.testing.assert_array_equal(ids, truth)
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ base.T, truth, axis=1), rtol=1e-5, atol=1e-6)
    assert (np.diff(scores, axis=1) <= 1e-7).all()  # sorted, best first


@pytest.mark.parametrize(
    "factory, floor",
    [("HNSW32", 0.95), ("IVF32,Flat", 0.9), ("IVF32,PQ8", 0.4)],  # measured 1.0, 1.0, 0.48 on this data
)
def test_approximate_index_recall_against_exact(data, factory, floor):
    base, queries, truth = data
    index = fi.build(base, factory)
    _, ids = fi.search(index, queries, 10)
    assert fi.recall_at_k(ids, truth) >= floor
    assert fi.recall_at_k(ids, truth) <= 1.0


def test_search_params_are_per_call_and_leave_the_index_alone(data):
    base, queries, truth = data
    hnsw = fi.build(base[:500], "HNSW32")
    assert fi.search_parameters(hnsw, 100).efSearch == 200  # default max(64, 2k)
    assert fi.search_parameters(hnsw, 5, fi.SearchParams(ef_search=17)).efSearch == 17
    fi.search(hnsw, base[:2], 5, fi.SearchParams(ef_search=17))
    assert faiss.downcast_index(hnsw).hnsw.efSearch == 16  # FAISS's default, untouched
    ivf = fi.build(base, "IVF32,Flat")
    _, one = fi.search(ivf, queries, 10, fi.SearchParams(nprobe=1))
    _, every = fi.search(ivf, queries, 10, fi.SearchParams(nprobe=32))  # all lists: exact
    assert faiss.extract_index_ivf(ivf).nprobe == 1
    np.testing.assert_array_equal(every, truth)
    assert fi.recall_at_k(one, truth) < 1.0
    assert fi.search_parameters(fi.build(base, "Flat"), 10) is None
    spread = _clustered(4000, seed=3, clusters=4000, noise=1.0)  # no clusters: nprobe matters
    wrapped = fi.build(spread, "PCA16,IVF16,Flat")
    _, wide = fi.search(wrapped, queries, 10, fi.SearchParams(nprobe=16))  # reaches the IVF inside the wrapper
    _, narrow = fi.search(wrapped, queries, 10, fi.SearchParams(nprobe=1))
    assert (wide != narrow).any() and faiss.extract_index_ivf(wrapped).nprobe == 1


def test_concurrent_searches_with_different_params_do_not_race(data):
    base, queries, _ = data
    ivf = fi.build(base, "IVF32,Flat")
    hnsw = fi.build(base, "HNSW32")
    calls = [(ivf, fi.SearchParams(nprobe=p)) for p in (1, 2, 4, 32)]
    calls += [(hnsw, fi.SearchParams(ef_search=e)) for e in (10, 20, 200)]
    expected = [fi.search(index, queries, 10, params)[1] for index, params in calls]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(5):
            got = list(pool.map(lambda c: fi.search(c[0], queries, 10, c[1])[1], calls * 3))
            for a, b in zip(got, expected * 3):
                np.testing.assert_array_equal(a, b)


def test_too_few_training_vectors_is_a_clear_error(data):
    base, _, _ = data
    for factory, need in (("IVF1024,Flat", 1024), ("IVF1024,PQ8", 1024), ("PQ8", 256), ("IVF16,PQ8", 256)):
        with pytest.raises(ValueError, match=f"needs at least {need} training vectors.*got 200"):
            fi.build(base[:200], factory)


def test_recall_helper():
    truth = np.array([[1, 2, 3], [4, 5, 6]])
    assert fi.recall_at_k(np.array([[3, 2, 1], [4, 9, 8]]), truth) == pytest.approx((1 + 1 / 3) / 2)


def test_add_continues_ids_and_matches_one_build(data):
    base, queries, truth = data
    index = fi.build(base[:1500], "IVF32,Flat")
    fi.add_vectors(index, base[1500:])
    assert index.ntotal == len(base)
    _, ids = fi.search(index, queries, 10, fi.SearchParams(nprobe=32))  # all lists: exact
    np.testing.assert_array_equal(ids, truth)


def test_save_load_round_trip(tmp_path, data):
    base, queries, _ = data
    for factory in ("Flat", "HNSW32", "IVF32,PQ8"):
        index = fi.build(base, factory)
        path = tmp_path / f"{factory.replace(',', '_')}.faiss"
        fi.save(index, path)
        back = fi.load(path)
        assert back.ntotal == index.ntotal and back.d == DIM
        for a, b in zip(fi.search(index, queries, 10), fi.search(back, queries, 10)):
            np.testing.assert_array_equal(a, b)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_load_and_factory_errors(tmp_path):
    with pytest.raises(ValueError, match="no FAISS index"):
        fi.load(tmp_path / "missing.faiss")
    junk = tmp_path / "junk.faiss"
    junk.write_bytes(b"not an index")
    with pytest.raises(ValueError, match="not a readable"):
        fi.load(junk)
    with pytest.raises(ValueError, match="bad FAISS factory"):
        fi.new_index(DIM, "Nonsense42")
    with pytest.raises(ValueError, match="IDMap"):
        fi.new_index(DIM, "IDMap,Flat")
    with pytest.raises(ValueError, match="at least 32"):
        fi.build(_clustered(20, seed=3), "IVF32,Flat")


def test_search_input_checks(data):
    base, queries, _ = data
    index = fi.build(base[:5], "Flat")
    scores, ids = fi.search(index, queries[:2], 10)
    assert ids.shape == (2, 5) and sorted(ids[0].tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="k must be"):
        fi.search(index, queries, 0)
    with pytest.raises(ValueError, match="shape"):
        fi.search(index, queries[:, :8], 3)
    with pytest.raises(ValueError, match="NaN"):
        fi.search(index, np.full((1, DIM), np.nan, np.float32), 3)


def test_auto_factory_thresholds():
    big = 1 << 40
    assert fi.auto_factory(0, 64) == "Flat"
    assert fi.auto_factory(99_999, 512, memory_bytes=big) == "Flat"
    assert fi.auto_factory(100_000, 512, memory_bytes=big) == "HNSW32"
    assert fi.auto_factory(5_000_000, 64, memory_bytes=big) == "HNSW32"
    assert fi.auto_factory(5_000_001, 64, memory_bytes=big) == "IVF2048,PQ16"
    # 1M x 512 HNSW needs ~2.2 GB: refused with 1 GB available, IVF-PQ instead
    assert fi.hnsw_bytes(1_000_000, 512) > 2e9
    assert fi.auto_factory(1_000_000, 512, memory_bytes=1 << 30) == "IVF1024,PQ128"
    with pytest.raises(ValueError):
        fi.AutoPolicy(flat_max=10, hnsw_max=5)


def test_ivf_and_pq_sizes():
    assert fi.ivf_nlist(1_000_000) == 1024
    assert fi.ivf_nlist(100) == 2  # at most n / 39 lists
    assert fi.ivf_nlist(10) == 1
    assert fi.pq_subquantizers(512) == 128
    assert fi.pq_subquantizers(8) == 2
    assert fi.pq_subquantizers(6) == 1  # largest divisor of 6 not above 6 // 4 = 1
    assert fi.pq_subquantizers(12) == 3
    for dim in (4, 8, 24, 64):
        fi.new_index(dim, fi.ivf_pq_factory(10_000, dim))  # FAISS accepts what auto builds


def test_bytes_per_vector(data):
    base, _, _ = data
    assert fi.bytes_per_vector(fi.build(base, "Flat")) == pytest.approx(4 * DIM, rel=0.01)
    assert fi.bytes_per_vector(fi.build(base, "IVF32,PQ8")) < 0.3 * 4 * DIM
