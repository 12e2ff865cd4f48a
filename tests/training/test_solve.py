"""The exact solver (triclip.training.solve): CCA maths against known answers, the run folder, --init."""

import json

import pytest
import torch
import torch.nn.functional as F

import triclip.training.train as train_mod
from triclip.app.cli import main
from triclip.model.cache import locked_tower_outputs
from triclip.data import load_pairs
from triclip.model.embed import embed_pairs
from triclip.core.errors import UserError
from triclip.losses import build_loss
from triclip.model.run import load_run
from triclip.training.config import SolveConfig
from triclip.training.evaluate import evaluate_run
from triclip.training.solve import eq6_value, fit_cca, pair_stats, paired_features, solve
from triclip.training.train import TrainConfig, train

CORRS = torch.tensor([0.9, 0.2, 0.75, 0.5, 0.05, 0.6], dtype=torch.float64)  # known canonical correlations


def _known_problem(n: int = 200_000, seed: int = 0):
    """x, y whose canonical correlations are CORRS: x_k = u_k, y_k = c_k u_k + sqrt(1 - c_k^2) e_k,
    then each side mixed by a random invertible map and shifted (CCA does not see either)."""
    gen = torch.Generator().manual_seed(seed)
    k = len(CORRS)
    u, e = torch.randn(n, k, generator=gen, dtype=torch.float64), torch.randn(n, k, generator=gen, dtype=torch.float64)
    v = CORRS * u + (1 - CORRS**2).sqrt() * e
    mix_x = torch.randn(k, k, generator=gen, dtype=torch.float64) + 2 * torch.eye(k, dtype=torch.float64)
    mix_y = torch.randn(k, k, generator=gen, dtype=torch.float64) + 2 * torch.eye(k, dtype=torch.float64)
    return u @ mix_x + 3.0, v @ mix_y - 1.0


def test_s_is_the_known_canonical_correlations_sorted():
    x, y = _known_problem()
    solution = fit_cca(pair_stats(x, y, torch.arange(len(x))), dim=6, ridge=0.0, anchor_x=x)
    torch.testing.assert_close(solution.rho, CORRS.sort(descending=True).values, atol=0.01, rtol=0)
    assert bool((solution.rho[:-1] >= solution.rho[1:]).all())


def test_heads_satisfy_the_decorrelation_constraint_up_to_the_ridge():
    x, y = _known_problem(20_000, seed=1)
    stats = pair_stats(x, y, torch.arange(len(x)))
    for ridge in (0.0, 0.1):
        s = fit_cca(stats, dim=4, ridge=ridge)
        zx, zy = (x - s.mean_x) @ s.a, (y - s.mean_y) @ s.b  # (N, 4)
        eye = torch.eye(4, dtype=torch.float64)
        # exactly whitened under the ridge-regularised covariance ...
        reg_x = stats.cxx + ridge * stats.cxx.diagonal().mean() * torch.eye(6, dtype=torch.float64)
        torch.testing.assert_close(s.a.T @ reg_x @ s.a, eye, atol=1e-8, rtol=0)
        # ... so E[z z^T] = I without it, and below I with it; the cross moment is diag(rho)
        cov_x = zx.T @ zx / len(zx)
        if ridge == 0.0:
            torch.testing.assert_close(cov_x, eye, atol=1e-8, rtol=0)
            torch.testing.assert_close(zx.T @ zy / len(zx), torch.diag(s.rho), atol=1e-8, rtol=0)
        else:
            assert float(torch.linalg.eigvalsh(eye - cov_x).min()) > 0
        assert float(zx.mean(0).abs().max()) < 1e-8  # centred: the affine heads' bias


def test_eq6_is_lower_at_the_solution_than_at_perturbed_heads():
    x, y = _known_problem(20_000, seed=2)
    stats = pair_stats(x, y, torch.arange(len(x)))
    s = fit_cca(stats, dim=3, ridge=0.0)
    zx, zy = (x - s.mean_x) @ s.a, (y - s.mean_y) @ s.b
    best = float(eq6_value(zx, zy, s.rho))
    torch.testing.assert_close(best, -float((s.rho**2).sum()), atol=1e-6, rtol=0)  # the closed-form value
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        a = s.a + 0.3 * torch.randn(s.a.shape, generator=gen, dtype=torch.float64)
        b = s.b + 0.3 * torch.randn(s.b.shape, generator=gen, dtype=torch.float64)
        a, b = a @ _inv_sqrt(a.T @ stats.cxx @ a), b @ _inv_sqrt(b.T @ stats.cyy @ b)  # back on the constraint
        px, py = (x - s.mean_x) @ a, (y - s.mean_y) @ b
        s_best = (px * py).mean(0).clamp_min(0)  # the best diagonal S for these heads
        assert float(eq6_value(px, py, s_best)) > best + 1e-6
        assert float(eq6_value(zx, zy, s.rho * 1.1)) > best  # and S = rho is the best S for the solution


def _inv_sqrt(m: torch.Tensor) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(m)
    return vecs @ torch.diag(vals.rsqrt()) @ vecs.T


def test_eq6_value_matches_a_loop_over_all_negative_pairs():
    gen = torch.Generator().manual_seed(4)
    zx, zy, s = torch.randn(7, 3, generator=gen), torch.randn(7, 3, generator=gen), torch.rand(3, generator=gen)
    pos = sum(float((zx[i] * s * zy[i]).sum()) for i in range(7)) / 7
    neg = sum(float((zx[i] * s * zy[j]).sum()) ** 2 for i in range(7) for j in range(7)) / 49
    torch.testing.assert_close(float(eq6_value(zx, zy, s)), -2 * pos + neg, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- the run folder


def _solve_cfg(shapes_data, out, **kw) -> SolveConfig:
    base = dict(
        train_data=str(shapes_data / "train.jsonl"),
        val_data=str(shapes_data / "val.jsonl"),
        out=str(out),
        model="tiny",
        embed_dim=16,
        device="cpu",
    )
    base.update(kw)
    return SolveConfig(**base)


@pytest.fixture
def solved(shapes_data, tmp_path):
    run = tmp_path / "solved"
    result = solve(_solve_cfg(shapes_data, run))
    return run, result


def test_solved_run_is_an_ordinary_run_whose_embeddings_are_the_solution(shapes_data, solved):
    run, result = solved
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["head"] == "affine" and config["model"]["importance"] == "softplus"
    assert f"{config['solver']['ridge']:g}" in config["solver"]["ridge_grid_t2i_r10"]  # one of those it tried
    assert max(config["solver"]["ridge_grid_t2i_r10"].values()) == result["t2i_r10"]
    model, _ = load_run(run)
    rho = torch.tensor(config["solver"]["canonical_correlations"])
    torch.testing.assert_close(model.importance().detach(), rho, atol=1e-5, rtol=1e-4)  # w = rho, not normalised
    # the loaded model embeds the training images exactly as the CCA formula does
    pairs = load_pairs(str(shapes_data / "train.jsonl"))
    cache = locked_tower_outputs(model, pairs, "cpu")
    x, y, owner = paired_features(cache)
    solution = fit_cca(pair_stats(x, y, owner), 16, config["solver"]["ridge"], x)
    want = F.normalize(((x.double() - solution.mean_x) @ solution.a).float(), dim=-1)
    got = embed_pairs(model, pairs, "cpu", cache=cache).image
    # float32 heads against the float64 formula: a small ridge leaves large, cancelling entries in a, and
    # one coordinate in a few thousand was seen 1.6e-4 off (a wrong formula is off by ~0.1)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    # eval reads it unchanged and finds the solver's validation recall
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    again = evaluate_run(str(run), str(shapes_data / "val.jsonl"), device="cpu")
    assert again["t2i_r10"] == pytest.approx(metrics["t2i_r10"]) == pytest.approx(result["t2i_r10"])


@pytest.mark.parametrize("head", [None, "residual"])  # residual: affine skip from the run, MLP branch starting at 0
def test_init_starts_training_from_the_solved_weights(shapes_data, solved, tmp_path, monkeypatch, head):
    run, _ = solved
    first = {}
    real_step = train_mod._train_step

    def spy(step_module, batch, *args, **kwargs):
        if not first:
            first["batch"] = batch
            first["terms"] = real_step(step_module, batch, *args, **kwargs)
            return first["terms"]
        return real_step(step_module, batch, *args, **kwargs)

    monkeypatch.setattr(train_mod, "_train_step", spy)
    cfg = TrainConfig(
        train_data=str(shapes_data / "train.jsonl"), out=str(tmp_path / "trained"), model="tiny", init=str(run),
        lock_image=True, lock_text=True, loss="infonce", loss_options={"nested": 0}, batch_size=32, max_steps=2, epochs=1,
        head=head,
    )  # fmt: skip
    train(cfg)
    config = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert config["model"]["head"] == (head or "affine") and config["model"]["embed_dim"] == 16  # taken from --init
    if head == "residual":  # the branch got gradients: after two steps it is no longer zero
        trained, _ = load_run(tmp_path / "trained", which="last")
        assert float(trained.image_head.branch[-1].weight.detach().abs().max()) > 0
    assert config["model"]["importance"] == "softplus"
    solved_model, _ = load_run(run)
    batch = first["batch"]
    with torch.no_grad():
        img = solved_model.project_image(batch.image)
        txt = solved_model.project_text(batch.text)
        want = build_loss("infonce", nested=0)(img, txt, solved_model.logit_scale(), solved_model.importance())
    assert sum(first["terms"].values()) == pytest.approx(float(sum(want.values())), abs=1e-5)


def test_init_refuses_another_head_kind(shapes_data, solved, tmp_path):
    run, _ = solved
    cfg = TrainConfig(
        train_data=str(shapes_data / "train.jsonl"), out=str(tmp_path / "mlp"), model="tiny", init=str(run), head="mlp",
        lock_image=True, lock_text=True, max_steps=1, epochs=1,
    )  # fmt: skip
    with pytest.raises(UserError, match="affine heads"):
        train(cfg)


def test_cli_solve_refuses_an_existing_run_without_overwrite(shapes_data, solved, capsys):
    run, _ = solved
    args = ["solve", "--train-data", str(shapes_data / "train.jsonl"), "--out", str(run), "--model", "tiny",
            "--embed-dim", "8", "--ridge", "0.1", "--device", "cpu"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "overwrite" in err and "--resume" not in err  # solve has no --resume
    assert main(args + ["--overwrite"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["embed_dim"] == 8 and config["solver"]["ridge"] == 0.1
    assert not (run / "metrics.jsonl").exists()  # no --val-data: nothing evaluated, the old metrics gone
    assert main(args[:-4] + ["--ridge", "lots", "--device", "cpu", "--overwrite"]) == 2


@pytest.mark.parametrize("weighting", [0.0, 0.5, 1.0, 2.0])
def test_set_heads_serves_rho_to_the_power_weighting_and_keeps_w_rho(weighting):
    from triclip.model.model import ModelConfig, build_model
    from triclip.training.solve import CCA, set_heads

    model = build_model(ModelConfig(preset="tiny", embed_dim=4, head="affine", importance="softplus"))
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(128, 4, generator=gen, dtype=torch.float64), torch.randn(128, 4, generator=gen, dtype=torch.float64)
    mx, my = torch.randn(128, generator=gen, dtype=torch.float64), torch.randn(128, generator=gen, dtype=torch.float64)
    rho = torch.tensor([0.9, 0.6, 0.3, 0.1], dtype=torch.float64)
    set_heads(model, CCA(mx, my, a, b, rho, 0.1), weighting)
    torch.testing.assert_close(model.importance().detach().double(), rho, atol=1e-6, rtol=0)
    x, y = torch.randn(5, 128, generator=gen), torch.randn(3, 128, generator=gen)
    with torch.no_grad():
        zx, zy = model.project_image(x, normalize=False), model.project_text(y, normalize=False)
        served = (zx * model.importance()) @ zy.T  # sum_k w_k zx_k zy_k
    cx, cy = (x.double() - mx) @ a, (y.double() - my) @ b  # canonical variates
    torch.testing.assert_close(served.double(), (cx * rho**weighting) @ cy.T, atol=1e-3, rtol=1e-4)


def test_solve_refuses_more_dimensions_than_the_towers_have_and_writes_nothing(shapes_data, tmp_path):
    out = tmp_path / "too_wide"
    with pytest.raises(UserError, match="exceeds the smaller tower's width"):
        solve(_solve_cfg(shapes_data, out, embed_dim=129, ridge="0.1"))  # tiny towers are 128 wide
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()


def test_cli_trains_residual_heads_with_tricl_from_a_solved_run(shapes_data, solved, tmp_path):
    """The README's own-data recipe after ``solve``: ``train --init SOLVED --head residual --loss tricl``."""
    run, _ = solved
    out = tmp_path / "res"
    args = ["train", "--train-data", str(shapes_data / "train.jsonl"), "--model", "tiny", "--init", str(run),
            "--lock-image", "--lock-text", "--loss", "tricl", "--epochs", "1", "--max-steps", "2",
            "--batch-size", "32", "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert main(args + ["--head", "mlp"]) == 2  # an MLP cannot start as the affine solution
    assert not out.exists() or not any(out.iterdir())
    assert main(args + ["--head", "residual"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["head"] == "residual" and config["loss"] == "tricl"
    assert config["loss_options"]["nested"] == 4  # tricl's default nesting, on S's order
    trained, solved_model = load_run(out)[0], load_run(run)[0]
    w, rho = trained.importance().detach(), solved_model.importance().detach()
    torch.testing.assert_close(w, rho, atol=0.01, rtol=0)  # S starts at the canonical correlations (2 steps later)
    assert w.argsort(descending=True)[:4].tolist() == rho.argsort(descending=True)[:4].tolist()


def test_ridge_auto_looks_beyond_the_end_of_the_grid_that_wins(shapes_data, tmp_path, monkeypatch):
    import triclip.training.solve as solve_mod

    monkeypatch.setattr(solve_mod, "RIDGE_GRID", (1e-4, 3e-4))  # two values: the best is at one end
    solve(_solve_cfg(shapes_data, tmp_path / "run"))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    grid = {float(r): v for r, v in config["solver"]["ridge_grid_t2i_r10"].items()}
    assert len(grid) >= 3  # it stepped beyond the winning end ...
    picked = config["solver"]["ridge"]
    assert max(grid.values()) == grid[picked]
    beyond = sorted(r for r in grid if r not in (1e-4, 3e-4))
    # ... in one direction, by factors of 3, and stopped at the first step that did not win (or after 3 steps)
    assert all(r > 3e-4 for r in beyond) or all(r < 1e-4 for r in beyond)
    assert len(beyond) == solve_mod.RIDGE_EXTEND or picked != (max(beyond) if beyond[0] > 3e-4 else min(beyond))


# ---------------------------------------------------------------------------- solve --run: Eq. 6 on a trained run


@pytest.fixture
def trained_base(shapes_data, tmp_path):
    """A tiny run on locked towers with MLP heads and a non-uniform importance (tricl: the ramp)."""
    out = tmp_path / "base"
    cfg = TrainConfig(
        train_data=str(shapes_data / "train.jsonl"), out=str(out), model="tiny", embed_dim=16, head="mlp",
        lock_image=True, lock_text=True, loss="tricl", batch_size=32, max_steps=3, epochs=1,
    )  # fmt: skip
    train(cfg)
    return out


def test_solve_on_a_run_appends_the_canonical_directions_of_its_served_embeddings(shapes_data, trained_base, tmp_path, capsys):
    from triclip.training.evaluate import model_score_embeddings

    out = tmp_path / "solved_on"
    result = solve(_solve_cfg(shapes_data, out, model=None, embed_dim=None, run=str(trained_base)))
    config = json.loads((out / "config.json").read_text())
    # the summary prints, per ridge, the number that picked it and names it
    printed = " ".join(capsys.readouterr().out.split())
    assert "The ridge is picked by validation t2i_r10 averaged over m = 1, 2, 4 and full D" in printed
    kept = f"{config['solver']['ridge']:g}"
    for r, value in config["solver"]["ridge_grid_curve_t2i_r10"].items():
        assert f"{r}: {value:.4f}{' (kept)' if r == kept else ''}" in printed
    assert config["model"]["post_affine"] and config["model"]["head"] == "mlp" and config["model"]["importance"] == "softplus"
    assert config["solver"]["run"] == str(trained_base.resolve())
    curve = config["solver"]["ridge_grid_curve_t2i_r10"]  # the ridge is picked by the curve's mean, not by full D
    assert curve[f"{config['solver']['ridge']:g}"] == max(curve.values())
    base, _ = load_run(trained_base)
    w0 = base.importance().detach()
    assert float(w0.max() / w0.min()) > 1.5  # the base's own weights matter (the test would not see sqrt(w0) otherwise)
    model, _ = load_run(out)
    rho = torch.tensor(config["solver"]["canonical_correlations"])
    torch.testing.assert_close(model.importance().detach(), rho.clamp_min(1e-6), atol=1e-5, rtol=1e-4)
    # its embeddings are the CCA formula on what the base run serves: normalize(sqrt(w0) * z0)
    pairs = load_pairs(str(shapes_data / "train.jsonl"))
    cache = locked_tower_outputs(model, pairs, "cpu")
    e0 = embed_pairs(base, pairs, "cpu", cache=cache)
    img0, txt0 = model_score_embeddings(e0.image, e0.text, w0)
    solution = fit_cca(pair_stats(img0, txt0, e0.text_to_image), 16, config["solver"]["ridge"], img0)
    want_img = F.normalize(((img0.double() - solution.mean_x) @ solution.a).float(), dim=-1)
    want_txt = F.normalize(((txt0.double() - solution.mean_y) @ solution.b).float(), dim=-1)
    got = embed_pairs(model, pairs, "cpu", cache=cache)
    torch.testing.assert_close(got.image, want_img, atol=1e-3, rtol=0)
    torch.testing.assert_close(got.text, want_txt, atol=1e-3, rtol=0)
    # the base run's heads are kept as they were
    for side in ("image_head", "text_head"):
        for key, value in getattr(base, side).state_dict().items():
            torch.testing.assert_close(getattr(model, side).inner.state_dict()[key], value)
    again = evaluate_run(str(out), str(shapes_data / "val.jsonl"), device="cpu")
    assert again["t2i_r10"] == pytest.approx(result["t2i_r10"])


def test_cli_solve_on_a_run_refuses_what_it_cannot_solve_and_keeps_the_run(shapes_data, trained_base, tmp_path, capsys):
    common = ["solve", "--train-data", str(shapes_data / "train.jsonl"), "--ridge", "0.1", "--device", "cpu"]
    before = {p.name: p.read_bytes() for p in trained_base.iterdir() if p.is_file()}
    bad = [
        (["--run", str(tmp_path / "nothing"), "--out", str(tmp_path / "a")], "not a run folder"),
        (["--run", str(trained_base), "--out", str(trained_base), "--overwrite"], "--out is --run"),
        (["--run", str(trained_base), "--out", str(tmp_path / "b"), "--embed-dim", "8"], "keeps its model"),
        (["--run", str(trained_base), "--out", str(tmp_path / "c"), "--model", "lite"], "keeps its model"),
    ]
    for args, message in bad:
        assert main(common + args) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in trained_base.iterdir() if p.is_file()} == before
    assert main(common + ["--run", str(trained_base), "--out", str(tmp_path / "ok")]) == 0
    # a run solved on a run is not solved on again
    assert main(common + ["--run", str(tmp_path / "ok"), "--out", str(tmp_path / "again")]) == 2
    assert "itself solved on a run" in capsys.readouterr().err


def test_train_from_a_run_solved_on_a_run_starts_at_its_solution_trains_the_maps_and_resumes(
    shapes_data, trained_base, tmp_path, monkeypatch
):
    """``train --init SOLVED`` (solve --run's output): the affine maps come along, start as solved, and train."""
    solved = tmp_path / "solved_on"
    solve(_solve_cfg(shapes_data, solved, model=None, embed_dim=None, run=str(trained_base), ridge="0.1"))
    first = {}
    real_step = train_mod._train_step

    def spy(step_module, batch, *args, **kwargs):
        terms = real_step(step_module, batch, *args, **kwargs)
        first.setdefault("batch", batch)
        first.setdefault("terms", terms)
        return terms

    monkeypatch.setattr(train_mod, "_train_step", spy)
    out = tmp_path / "tuned"
    options = {"nested": 2, "nested_order": "importance"}
    common = dict(train_data=str(shapes_data / "train.jsonl"), out=str(out), model="tiny", loss="tricl", batch_size=32)
    train(TrainConfig(**common, init=str(solved), loss_options=options, lr=1e-2, epochs=1, lock_image=True, lock_text=True))
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["post_affine"] and config["train"]["post_affine"]  # taken from --init, not an option
    assert (config["model"]["head"], config["model"]["importance"], config["model"]["embed_dim"]) == ("mlp", "softplus", 16)
    start, _ = load_run(solved)
    with torch.no_grad():  # the first step's loss is the solved-on run's: training starts exactly at the solution
        img, txt = start.project_image(first["batch"].image), start.project_text(first["batch"].text)
        want = build_loss("tricl", **options)(img, txt, start.logit_scale(), start.importance())
    assert sum(first["terms"].values()) == pytest.approx(float(sum(want.values())), abs=1e-5)
    tuned, _ = load_run(out, which="last")
    moved = tuned.image_head.post.weight.detach() - start.image_head.post.weight.detach()
    assert float(moved.abs().max()) > 1e-4  # the canonical directions train
    torch.testing.assert_close(tuned.image_head.scale, start.image_head.scale)  # the base run's sqrt(w0): a buffer
    train(TrainConfig(**common, epochs=2, resume=True), given={"train_data", "out", "model", "epochs", "resume"})
    resumed = json.loads((out / "config.json").read_text())
    assert resumed["model"]["post_affine"] and resumed["train"]["epochs"] == 2
    again, _ = load_run(out, which="last")  # rebuilt with its maps from config.json, trained one epoch further
    assert not torch.equal(again.image_head.post.weight, tuned.image_head.post.weight)


def test_solve_on_a_run_refuses_trained_towers(shapes_data, tmp_path):
    out = tmp_path / "unlocked"
    train(TrainConfig(train_data=str(shapes_data / "train.jsonl"), out=str(out), model="tiny", embed_dim=16,
                      lock_image=False, lock_text=False, batch_size=32, max_steps=1, epochs=1))  # fmt: skip
    with pytest.raises(UserError, match="its towers trained"):
        solve(_solve_cfg(shapes_data, tmp_path / "s", model=None, embed_dim=None, run=str(out), ridge="0.1"))
    assert not (tmp_path / "s" / "config.json").exists()
