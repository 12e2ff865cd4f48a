"""benchmarks.identifiability on synthetic tower features with a known spectrum."""

import math

import torch

from benchmarks import identifiability as ident


def _split(n: int, corrs: torch.Tensor, seed: int) -> ident.Split:
    """Paired features whose canonical correlations are ``corrs`` (one caption per image)."""
    gen = torch.Generator().manual_seed(seed)
    k = len(corrs)
    u = torch.randn(n, k, generator=gen)
    v = corrs * u + (1 - corrs**2).sqrt() * torch.randn(n, k, generator=gen)
    mix = torch.eye(k) + 0.3 * torch.randn(k, k, generator=torch.Generator().manual_seed(99))
    return ident.Split(u @ mix, v, torch.arange(n), [f"text {i}" for i in range(n)])


def test_gaps_are_the_distance_to_the_nearer_neighbour():
    gaps = ident._gaps(torch.tensor([0.9, 0.5, 0.45, 0.1], dtype=torch.float64))
    assert math.isclose(float(gaps[0]), 0.4) and math.isclose(float(gaps[1]), 0.05)
    assert math.isclose(float(gaps[2]), 0.05) and math.isclose(float(gaps[3]), 0.35)


def test_column_corr_matches_numpy():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, 3, generator=gen, dtype=torch.float64), torch.randn(50, 3, generator=gen, dtype=torch.float64)
    b[:, 0] += 2 * a[:, 0]
    want = [float(torch.corrcoef(torch.stack([a[:, k], b[:, k]]))[0, 1]) for k in range(3)]
    torch.testing.assert_close(ident._column_corr(a, b), torch.tensor(want, dtype=torch.float64))


def test_tables_on_a_known_spectrum(capsys):
    corrs = torch.tensor([0.95, 0.6, 0.58, 0.3, 0.1, 0.05])  # a gap after the first, a near-tie after it
    train, val, test = _split(4000, corrs, 1), _split(500, corrs, 2), _split(500, corrs, 3)
    data = ident.Feats(train.x, train.y, train.owner, val, test, dim=6)
    full = data.fit(torch.arange(4000), 0.0)
    torch.testing.assert_close(full.rho.float(), corrs, atol=0.05, rtol=0)  # small-sample bias of the low ones
    ident.identifiability_table(data, 0.0, [0, 1], full)
    ident.sign_table(data, full, [0, 1])
    ident.suggest_table(data, full)
    out = capsys.readouterr().out
    first_row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert float(first_row.split("|")[4]) > 0.95  # the separated first direction is the same on both halves
    assert "| skew |" in out and "within x?" in out


def test_on_run_fits_what_solve_run_fits(tmp_path, monkeypatch):
    """``--on-run RUN``: the CCA of the run's served embeddings, the one ``triclip solve --run`` writes."""
    import json

    from triclip.data.builtin import prepare
    from triclip.training.config import SolveConfig, TrainConfig
    from triclip.training.solve import solve
    from triclip.training.train import train

    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    data_dir, base, solved = tmp_path / "data", tmp_path / "base", tmp_path / "solved"
    prepare("shapes", str(data_dir), num=160, seed=0)
    train_data = str(data_dir / "train.jsonl")
    train(TrainConfig(train_data=train_data, out=str(base), model="tiny", embed_dim=16, head="mlp", loss="tricl",
                      lock_image=True, lock_text=True, batch_size=32, max_steps=3, epochs=1))  # fmt: skip
    solve(SolveConfig(train_data=train_data, out=str(solved), run=str(base), ridge="0.1", device="cpu"))
    data = ident.Feats.load(str(data_dir), "tiny", None, str(base))
    assert data.dim == 16 and data.val is not None
    torch.testing.assert_close(data.x.norm(dim=1), torch.ones(data.x.shape[0]))  # served: L2-normalised sqrt(w) * z
    rho = json.loads((solved / "config.json").read_text())["solver"]["canonical_correlations"]
    got = data.fit(torch.arange(data.x.shape[0]), 0.1).rho.float()
    torch.testing.assert_close(got, torch.tensor(rho), atol=1e-4, rtol=0)
