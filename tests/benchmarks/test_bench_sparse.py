"""benchmarks.bench_sparse: exactly k active entries, 4k bytes, a top-k autoencoder learns a k-sparse dictionary."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import bench_sparse as bs  # noqa: E402


def _k_sparse(n: int, dim: int, atoms: int, k: int, seed: int) -> np.ndarray:
    """Rows that are exact sums of k of ``atoms`` unit atoms (one dictionary for every seed), positive weights."""
    dictionary = np.random.default_rng(123).standard_normal((atoms, dim))
    rng = np.random.default_rng(seed)
    dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
    z = np.zeros((n, atoms))
    for row in z:
        row[rng.choice(atoms, k, replace=False)] = rng.uniform(0.5, 1.5, k)
    return (z @ dictionary).astype(np.float32)


def test_bytes_are_an_index_and_a_half_float_per_active_entry():
    assert [bs.bytes_per_vector(k) for k in (2, 4, 8, 16, 32)] == [8, 16, 32, 64, 128]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_encoder_keeps_exactly_k_entries(k):
    model = bs.SparseAutoencoder(dim=6, hidden=24, k=k, seed=0)
    with torch.no_grad():
        model.b_enc.fill_(10.0)  # every pre-activation positive: top-k, not ReLU, decides what is kept
    z = bs.codes(model, np.random.default_rng(0).standard_normal((50, 6)).astype(np.float32))
    assert z.shape == (50, 24)
    assert ((z != 0).sum(1) == k).all()
    with pytest.raises(ValueError):
        bs.SparseAutoencoder(dim=6, hidden=4, k=5)


def test_autoencoder_learns_a_k_sparse_dictionary():
    k, dim, atoms = 2, 16, 24
    x = _k_sparse(1200, dim, atoms, k, seed=1)
    owner = np.arange(len(x))
    model = bs.fit(x, x, owner, k=k, hidden=64, steps=600, batch=128, lr=3e-3, seed=0)
    test = _k_sparse(300, dim, atoms, k, seed=2)
    z = bs.codes(model, test, half=True)
    assert ((z != 0).sum(1) <= k).all()
    err = ((bs.decoded(model, z) - test) ** 2).sum(1).mean()
    variance = ((test - test.mean(0)) ** 2).sum(1).mean()
    assert err < 0.2 * variance, (err, variance)
    untrained = bs.SparseAutoencoder(dim, 64, k, seed=0)
    with torch.no_grad():
        untrained.b_dec.copy_(torch.from_numpy(x.mean(0)))
    base = ((bs.decoded(untrained, bs.codes(untrained, test)) - test) ** 2).sum(1).mean()
    assert err < 0.5 * base, (err, base)  # training, not the architecture, did it
