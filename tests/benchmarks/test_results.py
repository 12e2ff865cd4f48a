"""benchmarks.results: statistics, tables, the Tux Paint manifests and one small end-to-end experiment."""

from __future__ import annotations

import json
import statistics

import pytest
from PIL import Image

from benchmarks import results as R


def _fake(values_by_m: dict[int, float], **extra) -> dict:
    curve = {o: {str(m): v for m, v in values_by_m.items()} for o in ("importance", "first", "random", "pca")}
    return {"curve": curve, **extra}


def test_mean_sd_is_the_sample_sd():
    assert R.mean_sd([0.5, 0.7]) == f"0.600±{statistics.stdev([0.5, 0.7]):.3f}".replace("±0.", "±.")
    assert R.mean_sd([0.25]) == "0.250"


def test_paired_table_takes_differences_seed_by_seed():
    results = {"mrl": [_fake({8: 0.30}), _fake({8: 0.40})], "tricl": [_fake({8: 0.20}), _fake({8: 0.45})]}
    table = R.paired_table(results, ("mrl", "first"), ("tricl", "importance"), [8])
    row = table.splitlines()[-1]
    diffs = [0.10, -0.05]
    assert row == f"| 8 | {R.mean_sd(diffs)} | -0.050 | +0.100 |"


def test_compact_table_has_one_row_per_known_variant_and_ordering():
    results = {"infonce": [_fake({4: 0.1, 8: 0.2})] * 2, "tricl": [_fake({4: 0.3, 8: 0.4})] * 2}
    lines = R.compact_table(results, [4, 8]).splitlines()
    assert lines[0] == "| model, ordering | m=4 | m=8 |"
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| infonce, first m", "| infonce, random m", "| infonce, PCA m", "| tricl (nested=4, importance order)",
        "| tricl, PCA m (w ignored)",
    ]  # fmt: skip
    assert lines[-1].endswith("| 0.300±.000 | 0.400±.000 |")


def test_prepare_tuxpaint_reads_pngs_with_their_english_line(tmp_path):
    root = tmp_path / "stamps"
    for folder, name, text in [("animals", "cat", "A cat.\nfr.utf8=Un chat."), ("food", "pie", "A pie."),
                               ("food", "notext", None), ("food", "empty", "")]:  # fmt: skip
        (root / folder).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(root / folder / f"{name}.png")
        if text is not None:
            (root / folder / f"{name}.txt").write_text(text)
    counts = R.prepare_tuxpaint(str(tmp_path / "out"), root=str(root))
    assert counts["train"] + counts["val"] == 2
    rows = [json.loads(line) for s in ("train", "val") for line in (tmp_path / "out" / f"{s}.jsonl").read_text().splitlines()]
    assert sorted((r["captions"], r["label"]) for r in rows) == [(["A cat."], "animals"), (["A pie."], "food")]


@pytest.fixture(scope="module")
def small_experiment(tmp_path_factory):
    """tiny (locked, cached random towers: fast), 3 steps, two seeds, three variants."""
    from triclip.data.builtin import prepare

    root = tmp_path_factory.mktemp("results")
    prepare("shapes", str(root / "data"), num=160, seed=1)
    cfg = R.ResultsConfig(
        data=str(root / "data"), out=str(root / "runs"), seeds=[0, 1], variants=["infonce", "mrl", "tricl"],
        model="tiny", embed_dim=32, steps=3, batch_size=32, png=str(root / "curve.png"),
    )  # fmt: skip
    return cfg


@pytest.mark.slow
def test_compact_experiment_end_to_end(small_experiment, capsys):
    cfg = small_experiment
    R.compact(cfg)
    out = capsys.readouterr().out
    assert "| MRL (infonce + prefix nesting) |" in out and "mrl − tricl: mean±sd" in out
    assert "| MRL, PCA m |" in out and "mrl pca − mrl: mean±sd" in out and "mrl pca − infonce pca: mean±sd" in out
    assert Image.open(cfg.png).size[0] > 100
    saved = json.loads((R.run_dir(cfg, "mrl", 1) / "result.json").read_text())
    assert {"t2i_r10", "align", "uniform", "curve", "class_map_i2i"} <= set(saved)
    assert set(saved["curve"]["first"]) == {str(m) for m in R.dims_for(32)}
    config = json.loads((R.run_dir(cfg, "mrl", 1) / "config.json").read_text())
    assert config["loss"] == "mrl" and config["loss_options"] == {"nested": 4, "nested_order": "prefix"}  # MRL_STEP
    assert {"t2i_r1", "class_map"} <= set(saved["curves"]) and saved["weights"] == "last"
    assert set(saved["curves"]["class_map"]["pca"]) == {str(m) for m in R.dims_for(32)}
    R.compact(R.ResultsConfig(**{**cfg.__dict__, "variants": ["mrl"], "curve_metric": "class_map", "png": None}))
    assert "class mAP, image -> image against m, last weights" in capsys.readouterr().out
    R.compact(R.ResultsConfig(**{**cfg.__dict__, "variants": ["infonce"], "per_epoch": True, "png": None}))
    out = capsys.readouterr().out
    assert "against m, kept weights" in out and "best epoch: infonce 1.000±.000" in out
    run = R.Path(cfg.out) / "epochs" / "infonce" / "seed0"
    kept = json.loads((run / "selection.json").read_text())["kept"]
    assert json.loads((run / "result.json").read_text())["weights"] == kept  # what load_run loaded, as training decided
    R.identifiability(R.ResultsConfig(**{**cfg.__dict__, "variants": ["infonce", "tricl"]}))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| infonce") or line.startswith("| tricl")]
    assert len(lines) == 2 and all(0.0 <= float(cell) <= 1.0 for cell in lines[0].strip("| ").split(" | ")[-1:])


@pytest.mark.slow
def test_spectral_variants_evaluated_on_another_split(small_experiment, capsys):
    """--eval-split test: evaluated on DIR/test.jsonl, saved as result.test.json beside the run (not result.json)."""
    cfg = small_experiment
    data = R.Path(cfg.data)
    (data / "test.jsonl").write_text((data / "val.jsonl").read_text())  # same records: same numbers as val
    spectral = ["spectral", "tricl_spectral", "tricl_spectral_mean1", "solve", "solve_eq6_nested", "mrl", "mrl_affine", "mrl_solved", "mrl_solved_tricl"]
    R.compact(R.ResultsConfig(**{**cfg.__dict__, "variants": spectral, "eval_split": "test", "png": None}))
    out = capsys.readouterr().out
    assert "| MRL, then Eq. 6 solved on its embeddings, S order |" in out and "mrl_solved (S order) − MRL (first m)" in out
    solved = json.loads((R.run_dir(cfg, "mrl_solved", 0) / "config.json").read_text())  # solve --run on the same seed's MRL
    assert solved["solver"]["run"] == str(R.run_dir(cfg, "mrl", 0).resolve()) and solved["model"]["post_affine"]
    tuned = json.loads((R.run_dir(cfg, "mrl_solved_tricl", 0) / "config.json").read_text())  # trained on from it
    assert tuned["train"]["init"] == str(R.run_dir(cfg, "mrl_solved", 0)) and tuned["model"]["post_affine"]
    assert (tuned["loss"], tuned["train"]["epochs"], tuned["train"]["lr"], tuned["train"]["max_steps"]) == ("tricl", 10, 1e-4, None)
    assert "mrl_solved_tricl − mrl_solved (both S order)" in out
    assert "| MRL, affine heads (prefix) |" in out and "| MRL, affine heads, PCA m |" in out
    assert "solve (S order) − MRL (first m)" in out and "solve (S order) − MRL with affine heads (first m)" in out
    affine = json.loads((R.run_dir(cfg, "mrl_affine", 0) / "config.json").read_text())
    assert affine["model"]["head"] == "affine" and affine["loss_options"] == {"nested": 4, "nested_order": "prefix"}
    assert json.loads((R.run_dir(cfg, "mrl", 0) / "config.json").read_text())["model"]["head"] != "affine"
    assert "| tricl_spectral, S order |" in out and "| spectral, PCA m |" in out
    assert "| closed form (CCA), S order |" in out and "| closed form + Eq. 6 + nesting on S order, S order |" in out
    assert R.train_run(cfg, "solve", 1) == R.train_run(cfg, "solve", 0) == R.run_dir(cfg, "solve", 0)  # one solve
    warm = json.loads((R.run_dir(cfg, "solve_eq6_nested", 0) / "config.json").read_text())
    assert warm["train"]["init"] == str(R.run_dir(cfg, "solve", 0)) and warm["model"]["head"] == "affine"
    assert warm["loss_options"] == {"nested": 4, "nested_order": "importance"}
    run = R.run_dir(cfg, "tricl_spectral", 0)
    assert (run / "result.test.json").exists() and not (run / "result.json").exists()
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["importance"] == "softplus" and config["model"]["importance_spread"] == 1.0
    mean1 = json.loads((R.run_dir(cfg, "tricl_spectral_mean1", 0) / "config.json").read_text())
    assert mean1["model"]["importance"] == "softplus_mean1"  # a variant's setting wins over the objective's default
    test = json.loads((run / "result.test.json").read_text())
    val = R.run_results(run, str(data / "val.jsonl"))
    assert (run / "result.json").exists() and val["t2i_r10"] == test["t2i_r10"]
    assert len(set(test["w"])) > 1  # S moved from flat


def test_scales_table_one_row_per_objective_and_scale():
    run = lambda s, r10: {"logit_scale": s, "align": 1.0, "uniform": -3.0, "t2i_r1": 0.2, "t2i_r10": r10}  # noqa: E731
    results = {("infonce", "10"): [run(10.0, 0.5), run(10.0, 0.7)], ("infonce", "learned"): [run(30.0, 0.6)] * 2}
    lines = R.scales_table(results).splitlines()
    assert lines[0] == "| objective | s | final s | align | uniform | t2i R@1 | t2i R@10 |"
    assert lines[2] == f"| infonce | 10 | 10±0 | 1.000±.000 | -3.000±.000 | 0.200±.000 | {R.mean_sd([0.5, 0.7])} |"
    assert lines[3].startswith("| infonce | learned | 30±0 |")


def test_epochs_table_averages_the_same_epoch_over_seeds_and_skips_missing_ones():
    rec = lambda e, r10: {"epoch": e, "align": 1.0, "uniform": -3.0, "t2i_r10": r10, "logit_scale": 14.0}  # noqa: E731
    curves = {"mrl": [[rec(1, 0.2), rec(2, 0.4)], [rec(1, 0.4)]]}  # seed 1 stopped after epoch 1
    lines = R.epochs_table(curves, shown=(1, 2)).splitlines()
    assert len(lines) == 3  # header, rule, epoch 1 only
    assert lines[2] == f"| mrl | 1 | 1.000±.000 | -3.000±.000 | {R.mean_sd([0.2, 0.4])} | 14.00 |"


def test_scales_table_adds_the_best_epoch_only_when_every_run_has_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e, "t2i_r10": v}) + "\n" for e, v in ((1, 0.5), (2, 0.8), (3, 0.8))))
    base = {"logit_scale": 2.0, "align": 1.0, "uniform": -3.0, "t2i_r1": 0.2, "t2i_r10": 0.6}
    with_best = R._with_best_epoch(base, run)
    assert (with_best["best_t2i_r10"], with_best["best_epoch"]) == (0.8, 2)  # the first of equals
    assert R._with_best_epoch(base, tmp_path) == base  # no metrics.jsonl: unchanged
    assert R.scales_table({("infonce", "2"): [with_best] * 2}).splitlines()[0].endswith("| best-epoch t2i R@10 | best epoch |")
    assert "best" not in R.scales_table({("infonce", "2"): [with_best, base]}).splitlines()[0]


def test_metric_curves_recall_at_1_and_class_map_against_m():
    import torch

    torch.manual_seed(0)
    labels = torch.arange(12) % 3
    centres = torch.nn.functional.normalize(torch.randn(3, 8), dim=1) * 4
    image = torch.nn.functional.normalize(centres[labels] + 0.1 * torch.randn(12, 8), dim=1)  # (12, 8)
    text = image.clone()  # one caption per image, identical embedding: t2i R@1 = 1 at full D
    curves = R.metric_curves(image, text, torch.arange(12), torch.ones(8), [2, 8], [f"c{i}" for i in range(12)], labels)
    assert set(curves) == {"t2i_r1", "class_map"} and set(curves["t2i_r1"]) == {"importance", "first", "random", "pca"}
    assert curves["t2i_r1"]["first"][8] == 1.0 and curves["class_map"]["pca"][8] == 1.0  # well separated classes
    assert all(0.0 <= v <= 1.0 for c in curves.values() for o in c.values() for v in o.values())
    assert "class_map" not in R.metric_curves(image, text, torch.arange(12), torch.ones(8), [8], [str(i) for i in range(12)])


def test_curve_values_and_table_of_another_metric():
    result = {"curve": {"first": {"8": 0.9}}, "curves": {"t2i_r1": {"first": {"8": 0.4}}}}
    assert R.curve_values(result, "first", 8) == 0.9 and R.curve_values(result, "first", 8, "t2i_r1") == 0.4
    table = R.compact_table({"mrl": [result, result]}, [8], "t2i_r1")
    assert table.splitlines()[-1] == "| MRL (infonce + prefix nesting) | 0.400±.000 |"


def test_mrl_pca_row_and_paired_tables_against_its_prefix_and_infonce_pca():
    def run(first: float, pca: float) -> dict:
        return {"curve": {"first": {"8": first}, "pca": {"8": pca}, "importance": {"8": first}}}

    results = {"mrl": [run(0.50, 0.60), run(0.40, 0.45)], "infonce": [run(0.1, 0.70), run(0.1, 0.40)]}
    rows = {line.split(" | ")[0]: line for line in R.compact_table(results, [8]).splitlines()[2:]}
    assert rows["| MRL, PCA m"] == f"| MRL, PCA m | {R.mean_sd([0.60, 0.45])} |"
    assert rows["| MRL (infonce + prefix nesting)"].endswith(f"| {R.mean_sd([0.50, 0.40])} |")
    assert "| infonce, random m" not in rows  # an ordering the results lack is left out, not an error
    own = R.paired_table(results, ("mrl", "pca"), ("mrl", "first"), [8]).splitlines()
    assert own[0].startswith("| m | mrl pca − mrl: mean±sd")
    assert own[-1] == f"| 8 | {R.mean_sd([0.10, 0.05])} | +0.050 | +0.100 |"
    other = R.paired_table(results, ("mrl", "pca"), ("infonce", "pca"), [8]).splitlines()
    assert other[0].startswith("| m | mrl pca − infonce pca") and other[-1].endswith("| -0.100 | +0.050 |")
