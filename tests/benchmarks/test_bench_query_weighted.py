"""benchmarks/bench_query_weighted.py: the weighting makes a code's objective the score error, searches stay exact."""

import numpy as np
import pytest

from benchmarks.bench_query_weighted import weighted_ids, weighting


def _unit(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32) * np.linspace(2, 0.2, d, dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("how, eps", [("full", 0.0), ("full", 0.1), ("diag", 0.0), ("diag", 0.1)])
def test_the_coded_error_is_the_mean_square_score_error(how, eps):
    q, e = _unit(500, 12, 0), np.random.default_rng(1).standard_normal((7, 12))
    a = weighting(q, how, eps).astype(np.float64)
    cov = q.T.astype(np.float64) @ q / len(q)
    if how == "diag":
        cov = np.diag(np.diag(cov))
        assert np.count_nonzero(a - np.diag(np.diag(a))) == 0
    target = np.einsum("nd,de,ne->n", e, cov + eps * np.trace(cov) / 12 * np.eye(12), e)  # E_q[(q.e)^2] (+ eps)
    coded = np.sum((e @ a.T) ** 2, axis=1)  # |A e|^2
    np.testing.assert_allclose(coded / target, np.full(7, coded[0] / target[0]), rtol=1e-4)  # equal up to one scale
    x = _unit(5, 12, 2)
    np.testing.assert_allclose((q[:3] @ np.linalg.inv(a)) @ (x @ a.T).T, q[:3] @ x.T, atol=1e-5)  # A^-T q . A x = q . x


@pytest.mark.parametrize("codec", ["rq", "opq"])
def test_a_weighted_code_searches_the_original_scores_and_a_bad_weighting_is_refused(codec):
    train, q = _unit(300, 16, 3), _unit(9, 16, 5)
    gallery = train[:60]  # coded almost losslessly: 16 codes of 256 centroids for 300 vectors
    a = np.diag(np.geomspace(0.1, 10, 16)).astype(np.float32)  # far from the identity: a wrong query map ranks badly
    exact = np.argsort(-(q @ gallery.T), axis=1)[:, :10]
    ids = weighted_ids(codec, 16, a, train, gallery, q)
    overlap = np.mean([len(set(r) & set(e)) / 10 for r, e in zip(ids, exact)])
    assert overlap >= 0.9, overlap
    assert np.array_equal(weighting(q, "none", 0.0), np.eye(16, dtype=np.float32))
    with pytest.raises(ValueError, match="none, diag or full"):
        weighting(q, "pca", 0.0)
