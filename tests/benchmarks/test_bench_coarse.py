"""benchmarks.bench_coarse: assigners measured against the flat scan of the same centroids."""

import numpy as np

from benchmarks import bench_coarse as bc
from triclip.codecs import ivf


def _clustered(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((50, d))
    x = centres[rng.integers(0, 50, n)] + 0.4 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_every_group_scanned_is_the_flat_assignment_and_fewer_mostly_agree():
    """The flat row agrees with itself; an IVF assigner scanning all its groups agrees on every row and holds what
    the flat one holds; scanning one group of 16 agrees on most rows, not all."""
    rows, queries = _clustered(6000, 16, 0), _clustered(40, 16, 1)
    truth = np.argsort(-(queries @ rows.T), axis=1)[:, :10]
    centroids = ivf.two_level_centroids(rows, 256, 10)
    assert centroids.shape == (256, 16)
    out = {r["assigner"]: r for r in bc.measure(centroids, rows, rows[:1000], queries, truth, [1, 10_000])}
    flat, every, one = out["flat"], out["ivf16 p10000"], out["ivf16 p1"]
    assert flat["same_list"] == every["same_list"] == 1.0
    assert all(every[f"held_p{p}"] == flat[f"held_p{p}"] for p in bc.NPROBES)
    assert 0.5 < one["same_list"] < 1.0
    assert flat["held_p64"] >= flat["held_p8"] > 0.3 and "hnsw32 ef16" in out
