"""The experiments of docs/results.md and docs/results_archive.md: one command each, mean ± sd over seeds, PNG plots.

    .venv/bin/python -m benchmarks.results EXPERIMENT --data DIR --seeds 0,1,2 [--out runs/results/NAME] [--png P]

EXPERIMENT:

- ``compact``: one model per variant and seed (``lite``, both towers locked and cached, MLP
  heads: only the heads, the logit scale and ``w`` train), evaluated on ``DIR/val.jsonl``:
  full recall (over distinct texts, docs/CONTRACT.md "Metrics") and the compact curve (t2i R@10 against
  m) of ``infonce`` (first / random / PCA), MRL (``infonce`` + prefix nesting; prefix and PCA), ``tricl``
  with and without nesting, ``tricl`` started flat, and the ``contrastive`` / ``triplet`` /
  ``sigmoid`` baselines; paired by seed: MRL minus ``tricl``. ``--curve-metric t2i_r1`` or
  ``class_map`` (image -> image, labelled data) plots that metric against m instead;
  ``--per-epoch`` trains runs that validate every epoch (``OUT/epochs/VARIANT/seedN``) and
  evaluates their best epoch (``RUN/best``, picked on the same validation data: optimistic);
  ``--model tiny --no-lock`` trains both towers from scratch.
- ``falseneg``: ``infonce`` vs ``debiased`` (tau_plus 0.05 / 0.1 / 0.2) vs ``hard_negative``
  on labelled data (``fashion-mnist``): class mAP image -> image, zero-shot accuracy, t2i recall.
- ``identifiability``: the ``compact`` runs of two seeds, features in each model's own order
  (importance for ``tricl``, the index order for the others) after the sign fix, correlated
  dimension by dimension; and after the best one-to-one matching of dimensions.
- ``align_uniform``: ``align`` / ``uniform`` (Wang & Isola) against t2i R@10 for every
  ``compact`` and ``falseneg`` run found under ``--out`` (a scatter plot).
- ``scales``: ``infonce`` and MRL (``--variants``) trained with the logit scale held at each
  of ``--scales`` (``--fixed-logit-scale``; runs in ``OUT/scales/sS/VARIANT/seedN``) beside the
  learned one (the ``compact`` runs, ``OUT/VARIANT/seedN``): align, uniform, t2i R@1 / R@10.
  ``--per-epoch``: runs that validate every epoch instead, evaluated with their best epoch's
  weights (picked on the same validation data: optimistic, alike for every scale).
- ``epochs``: ``infonce`` / MRL / ``tricl`` (``--variants``) trained with per-epoch validation
  (runs in ``OUT/epochs/VARIANT/seedN``); align, uniform, t2i R@10 and the logit scale against
  the epoch, from each run's ``metrics.jsonl``.
- ``prepare-tuxpaint``: writes ``DIR/{train,val}.jsonl`` from the Debian package
  ``tuxpaint-stamps-default`` (photos and drawings, each with a human-written English
  description; label = top-level folder; split by a hash of the file name).

Runs that exist are evaluated again, not retrained; each run's evaluation is saved beside it
(``result.json``). Use ``OMP_NUM_THREADS=1`` on a shared machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from triclip.training.config import MRL_STEP, TUNE_STEP

# name -> TrainConfig overrides. Objective options beyond the objective's own defaults (triclip.losses) are spelled out.
VARIANTS: dict[str, dict] = {
    "infonce": dict(loss="infonce", loss_options={"nested": 0}),  # plain CLIP, whatever the trainer defaults
    "mrl": dict(MRL_STEP),  # the demo's first step (triclip.training.config)
    # MRL with the closed form's head kind (affine, not MLP): separates the heads from the order in solve vs mrl
    "mrl_affine": dict(loss="infonce", loss_options={"nested": 4, "nested_order": "prefix"}, head="affine"),
    "tricl": dict(loss="tricl", loss_options={"nested": 4, "nested_order": "importance"}),
    "tricl_nonest": dict(loss="tricl", loss_options={"nested": 0}),
    "tricl_flat": dict(loss="tricl", loss_options={"nested": 4, "nested_order": "importance"}, importance_spread=1.0),
    "contrastive": dict(loss="contrastive", loss_options={}),
    "triplet": dict(loss="triplet", loss_options={}),
    "sigmoid": dict(loss="sigmoid", loss_options={}),
    "debiased_0.05": dict(loss="debiased", loss_options={"tau_plus": 0.05}),
    "debiased_0.1": dict(loss="debiased", loss_options={"tau_plus": 0.1}),
    "debiased_0.2": dict(loss="debiased", loss_options={"tau_plus": 0.2}),
    "hard_negative": dict(loss="hard_negative", loss_options={}),
    # Eq. 6 (docs/results_archive.md, "Eq. 6: tri-factor spectral objective (trained)"): S flat, paper's softplus form
    "spectral": dict(loss="spectral", loss_options={}),
    "tricl_spectral": dict(loss="tricl_spectral", loss_options={}, importance="softplus", importance_spread=1.0),
    "tricl_spectral_mean1": dict(
        loss="tricl_spectral", loss_options={}, importance="softplus_mean1", importance_spread=1.0
    ),
    "tricl_spectral_lr10": dict(
        loss="tricl_spectral", loss_options={}, importance="softplus", importance_spread=1.0, importance_lr_scale=10.0
    ),
    "tricl_spectral_nested": dict(
        loss="tricl_spectral", loss_options={"nested": 4, "nested_order": "importance"}, importance="softplus",
        importance_spread=1.0,
    ),
    # the closed form (triclip solve: regularised CCA, ridge picked on val; deterministic, one run for every seed),
    # and Eq. 6 trained from it (train --init: its affine heads, S = the canonical correlations), plain or nested on S
    "solve": dict(solve=True),
    "solve_eq6": dict(init_from="solve", loss="tricl_spectral", loss_options={}),
    "solve_eq6_nested": dict(
        init_from="solve", loss="tricl_spectral", loss_options={"nested": 4, "nested_order": "importance"}
    ),
    # MRL's loss (InfoNCE + nesting) from the closed form, nested on S's order
    "solve_mrl": dict(init_from="solve", loss="infonce", loss_options={"nested": 4, "nested_order": "importance"}),
    # the closed form as the start of a non-linear head (residual: the solved affine map + an MLP branch
    # starting at 0) trained under the tri-factor InfoNCE (section 5.2, S = the canonical correlations, nested on S)
    "solve_tricl_res": dict(
        init_from="solve", head="residual", loss="tricl", loss_options={"nested": 4, "nested_order": "importance"}
    ),
    # its controls: the same heads from scratch, under MRL's loss and under tricl's (S started as the ramp)
    "mrl_res": dict(loss="infonce", loss_options={"nested": 4, "nested_order": "prefix"}, head="residual"),
    "tricl_res": dict(loss="tricl", loss_options={"nested": 4, "nested_order": "importance"}, head="residual"),
    # Eq. 6 solved on a trained run's embeddings (triclip solve --run): MRL's run of the same seed, then the
    # canonical directions and correlations of its served embeddings as affine maps after its heads and as S
    "mrl_solved": dict(solve_on="mrl"),
    "infonce_solved": dict(solve_on="infonce"),
    # and trained on from there (train --init: heads and maps train, S starts at the canonical correlations) under
    # the tri-factor InfoNCE nested on S's order: a short, gentle pass (10 epochs at lr 1e-4, whatever --steps says)
    "mrl_solved_tricl": dict(init_from="mrl_solved", **TUNE_STEP, max_steps=None),  # the demo's third step
    # the same step nested the other way: tricl's own terms at each prefix (MatryoshkaLoss), not InfoNCE's
    "mrl_solved_tricl_inner": dict(
        init_from="mrl_solved", **{**TUNE_STEP, "loss_options": {**TUNE_STEP["loss_options"], "nested_by": "inner"}},
        max_steps=None,
    ),
}
EXPERIMENTS = {
    "compact": ["infonce", "mrl", "tricl", "tricl_nonest", "tricl_flat", "contrastive", "triplet", "sigmoid"],
    "falseneg": ["infonce", "debiased_0.05", "debiased_0.1", "debiased_0.2", "hard_negative"],
}
# (variant, ordering) rows of the compact table, with the label a reader sees; every cached
# result holds all four orderings (``compact_curve``), so a row added here needs no re-evaluation
CURVE_ROWS = [
    ("infonce", "first", "infonce, first m"),
    ("infonce", "random", "infonce, random m"),
    ("infonce", "pca", "infonce, PCA m"),
    ("mrl", "first", "MRL (infonce + prefix nesting)"),
    ("mrl", "pca", "MRL, PCA m"),
    ("mrl_affine", "first", "MRL, affine heads (prefix)"),
    ("mrl_affine", "pca", "MRL, affine heads, PCA m"),
    ("tricl", "importance", "tricl (nested=4, importance order)"),
    ("tricl", "pca", "tricl, PCA m (w ignored)"),
    ("tricl_nonest", "importance", "tricl without nesting"),
    ("tricl_flat", "importance", "tricl nested, w started flat"),
    ("contrastive", "pca", "contrastive, PCA m"),
    ("triplet", "pca", "triplet, PCA m"),
    ("sigmoid", "pca", "sigmoid, PCA m"),
    ("spectral", "first", "spectral, first m"),
    ("spectral", "random", "spectral, random m"),
    ("spectral", "pca", "spectral, PCA m"),
    ("tricl_spectral", "importance", "tricl_spectral, S order"),
    ("tricl_spectral", "first", "tricl_spectral, first m"),
    ("tricl_spectral", "random", "tricl_spectral, random m"),
    ("tricl_spectral", "pca", "tricl_spectral, PCA m (S ignored)"),
    ("tricl_spectral_mean1", "importance", "tricl_spectral, mean-1 S, S order"),
    ("tricl_spectral_lr10", "importance", "tricl_spectral, theta lr x10, S order"),
    ("tricl_spectral_nested", "importance", "tricl_spectral + nesting on S order, S order"),
    ("solve", "importance", "closed form (CCA), S order"),
    ("solve_eq6", "importance", "closed form + Eq. 6 trained (warm start), S order"),
    ("solve_eq6_nested", "importance", "closed form + Eq. 6 + nesting on S order, S order"),
    ("solve_mrl", "importance", "closed form + InfoNCE + nesting on S order, S order"),
    ("solve_tricl_res", "importance", "closed form -> residual heads + tricl (5.2), S order"),
    ("solve_tricl_res", "pca", "closed form -> residual heads + tricl (5.2), PCA m"),
    ("mrl_res", "first", "MRL, residual heads (prefix)"),
    ("tricl_res", "importance", "tricl, residual heads, importance order"),
    ("mrl_solved", "importance", "MRL, then Eq. 6 solved on its embeddings, S order"),
    ("mrl_solved", "first", "MRL, then solved, first m (S order without its weights)"),
    ("mrl_solved", "random", "MRL, then solved, random m"),
    ("mrl_solved", "pca", "MRL, then solved, PCA m (S ignored)"),
    ("infonce_solved", "importance", "infonce, then Eq. 6 solved on its embeddings, S order"),
    ("mrl_solved_tricl", "importance", "MRL, then solved, then tricl nested on S (10 epochs), S order"),
    ("mrl_solved_tricl", "pca", "MRL, then solved, then tricl nested on S, PCA m"),
    ("mrl_solved_tricl_inner", "importance", "the same, nested by tricl's own terms (nested_by=inner), S order"),
]


@dataclass
class ResultsConfig:
    data: str  # folder with train.jsonl and val.jsonl
    out: str  # runs go to OUT/VARIANT/seedS
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    variants: list[str] = field(default_factory=list)  # empty: the experiment's list
    model: str = "lite"  # preset
    embed_dim: int = 256  # D
    steps: int = 1500  # optimizer steps
    batch_size: int = 256
    lr: float = 1e-3
    lock: bool = True  # both towers locked (and cached)
    png: str | None = None  # plot path
    title: str = ""  # plot title
    scales: list[float] = field(default_factory=lambda: [2.0, 5.0, 10.0, 20.0, 50.0, 100.0])  # ``scales``: fixed s
    per_epoch: bool = False  # ``scales`` / ``compact``: validate every epoch (runs in OUT/scales_val, OUT/epochs); evaluates RUN/best
    curve_metric: str = "t2i_r10"  # ``compact``: the metric against m: t2i_r10, t2i_r1 or class_map (image -> image)
    eval_split: str = "val"  # evaluated on DIR/<split>.jsonl (test: a held-out split never used to pick anything)


# ---------------------------------------------------------------------------- train and evaluate one run


def run_dir(cfg: ResultsConfig, variant: str, seed: int) -> Path:
    return Path(cfg.out) / variant / f"seed{seed}"


def train_run(cfg: ResultsConfig, variant: str, seed: int, run: Path | None = None, **overrides) -> Path:
    """Train one variant at one seed unless its weights (or its evaluation) exist; returns the run folder.

    Args:
        run: the run folder (None: ``run_dir``).
        overrides: further ``TrainConfig`` fields (``fixed_logit_scale``, ``val_data``).
    """
    from triclip.training.train import TrainConfig, train

    spec = dict(VARIANTS[variant])
    if spec.pop("solve", False):  # deterministic: the same run for every seed
        return solve_run(cfg)
    if "solve_on" in spec:
        return solve_run(cfg, on=train_run(cfg, spec["solve_on"], seed), out=run or run_dir(cfg, variant, seed))
    if "init_from" in spec:  # another variant's run of the same seed (solve: the one run of every seed)
        spec["init"] = str(train_run(cfg, spec.pop("init_from"), seed))
    run = run or run_dir(cfg, variant, seed)
    if (run / "model.safetensors").exists() or (run / "result.json").exists():  # weights of some deleted (disk)
        return run
    start = time.perf_counter()
    common = measured_run(cfg, run, seed)
    config = TrainConfig(**{**common, **spec, **overrides})  # a variant's epochs / lr / max_steps win over --steps
    train(config, given={*common, *spec, *overrides})  # what a variant sets wins over per-objective defaults
    (run / "train_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
    return run


def measured_run(cfg, run: Path, seed: int) -> dict:
    """The TrainConfig fields of a measured run of ``cfg`` (a ResultsConfig, or benchmarks.ablate_importance's):
    DIR/train.jsonl, the preset, D, batch, lr and locks, and ``cfg.steps`` steps (as many epochs as they take)."""
    data = Path(cfg.data)
    n_train = sum(1 for line in open(data / "train.jsonl") if line.strip())
    return dict(
        train_data=str(data / "train.jsonl"),
        out=str(run),
        model=cfg.model,
        embed_dim=cfg.embed_dim,
        epochs=math.ceil(cfg.steps / max(1, n_train // cfg.batch_size)),
        max_steps=cfg.steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        lock_image=cfg.lock,
        lock_text=cfg.lock,
        seed=seed,
        patience=0,  # the measured runs train their given steps (docs/results.md predates early stopping)
    )


def solve_run(cfg: ResultsConfig, on: Path | None = None, out: Path | None = None) -> Path:
    """``triclip solve`` on DIR/train.jsonl (ridge picked on DIR/val.jsonl) into OUT/solve/seed0, unless it
    exists; ``on``: ``solve --run ON`` (Eq. 6 on that run's embeddings) into ``out``."""
    from triclip.training.config import SolveConfig
    from triclip.training.solve import solve

    run = out or run_dir(cfg, "solve", 0)
    if not (run / "model.safetensors").exists():
        data = Path(cfg.data)
        start = time.perf_counter()
        model = dict(run=str(on)) if on else dict(model=cfg.model, embed_dim=cfg.embed_dim)
        solve(SolveConfig(train_data=str(data / "train.jsonl"), val_data=str(data / "val.jsonl"), out=str(run), **model))
        (run / "train_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
    return run


def _has_s(variant: str) -> bool:
    """An Eq. 6 variant: its S order is what the tables compare with MRL's prefix."""
    return variant.startswith(("tricl_spectral", "solve")) or "_solved" in variant


def dims_for(dim: int) -> list[int]:
    """D/32 ... D/2 and D."""
    return sorted({m for m in (dim // 32, dim // 16, dim // 8, dim // 4, dim // 2) if m >= 1} | {dim})


@torch.no_grad()
def run_results(run: Path, val: str, zero_shot: dict | None = None, curve_metric: str = "t2i_r10") -> dict:
    """Every number the tables need, for one run (cached in ``run/result.json``): ``triclip eval``'s
    metrics (:func:`triclip.training.evaluate.metrics`, its compact curve as ``curve``) and the tables' extras.

    Args:
        curve_metric: a cached result without this compact curve is evaluated again.
    """
    from triclip.model.cache import locked_tower_outputs
    from triclip.compact.features import topm_embed
    from triclip.data import load_pairs
    from triclip.model.embed import embed_texts
    from triclip.core.io import write_text_atomic
    from triclip.compact.metrics import class_map, zero_shot_accuracy
    from triclip.model.run import load_run, weights_path
    from triclip.training.evaluate import embed_for_eval, metrics

    split = Path(val).stem
    saved = run / ("result.json" if split == "val" else f"result.{split}.json")  # one evaluation per split
    if saved.exists():
        cached = json.loads(saved.read_text())
        if curve_metric == "t2i_r10" or curve_metric in cached.get("curves", {}):
            return cached
    device = torch.device("cpu")
    model, _ = load_run(run, device)
    pairs = load_pairs(val)
    e = embed_for_eval(model, pairs, device, 256, locked_tower_outputs(model, pairs, device))
    w, dim = e.w, e.image.shape[1]
    out = metrics(model, pairs, e, dims_for(dim))
    out["curve"] = out.pop("compact")
    order = torch.argsort(w, descending=True, stable=True)
    out["w"] = w.tolist()
    out["w_mass"] = {m: float(w[order[:m]].sum() / w.sum()) for m in dims_for(dim)}  # share of w in the top m
    out["w_prefix_overlap"] = {m: len(set(order[:m].tolist()) & set(range(m))) / m for m in dims_for(dim)}
    ids = e.labels(pairs)  # class id of each val image, where the data has labels
    if ids is not None:
        out["class_map_i2i"] = class_map(e.image_scored, e.image_scored, ids, ids, exclude_self=True)
        if zero_shot:
            labels = [pairs.records[i].label for i in e.keep.tolist()]
            prompts = [t.format(noun) for noun in zero_shot["nouns"] for t in zero_shot["templates"]]
            emb = embed_texts(model, prompts, device)  # (C*T, D)
            every = torch.arange(dim)
            emb = topm_embed(emb, w, every, dim).reshape(len(zero_shot["nouns"]), len(zero_shot["templates"]), dim)
            classes = torch.nn.functional.normalize(emb.mean(dim=1), dim=1)  # (C, D)
            target = torch.tensor([zero_shot["labels"].index(str(label)) for label in labels])
            out["zero_shot"] = zero_shot_accuracy(e.image_scored, classes, target)
    out["curves"] = metric_curves(e.image, e.text, e.owner, w, dims_for(dim), e.texts, ids)
    seconds = run / "train_seconds.txt"
    out["train_seconds"] = float(seconds.read_text()) if seconds.exists() else None
    out["weights"] = "best" if weights_path(run).parent.name == "best" else "last"  # what load_run loaded (selection.json)
    write_text_atomic(saved, json.dumps(out))
    return json.loads(saved.read_text())  # string keys, as a re-read gives


def metric_curves(image, text, owner, w, dims: list[int], texts: list[str], labels=None) -> dict:
    """``{metric: {ordering: {m: value}}}`` for t2i R@1 and, with ``labels``, class mAP image -> image.

    Args:
        image: val image embeddings. Shape: (N, D).
        text: val caption embeddings. Shape: (M, D).
        owner: image row of each caption. Shape: (M,).
        w: the importance. Shape: (D,).
        labels: class id of each image (N,), or None.
    """
    from triclip.compact.features import compact_embeddings, fit_pca
    from triclip.compact.metrics import class_map, retrieval_recall

    basis = fit_pca(torch.cat([image, text]))  # one fit for every m, as compact_curve does
    curves: dict = {"t2i_r1": {}, **({"class_map": {}} if labels is not None else {})}
    for ordering in ("importance", "first", "random", "pca"):
        for metric in curves:
            curves[metric][ordering] = {}
        for m in dims:
            img, txt = compact_embeddings(image, text, ordering, m, w, 0, basis)  # (N, m), (M, m)
            curves["t2i_r1"][ordering][m] = float(retrieval_recall(img, txt, owner, texts=texts)["t2i_r1"])
            if labels is not None:
                curves["class_map"][ordering][m] = class_map(img, img, labels, labels, exclude_self=True)
    return curves


def _zero_shot_spec(data: str) -> dict | None:
    """Class names and prompts where the data is fashion-mnist (its labels are its class names)."""
    from triclip.data import fashion_mnist as fm

    first = json.loads(Path(data, "val.jsonl").read_text().splitlines()[0])
    if first.get("label") not in fm.CLASSES:
        return None
    return {"labels": list(fm.CLASSES), "nouns": list(fm.NOUNS), "templates": list(fm.TEMPLATES)}


def collect(cfg: ResultsConfig, variants: list[str]) -> dict[str, list[dict]]:
    """``{variant: [result per seed]}``, training what is missing.

    With ``cfg.per_epoch`` the runs validate every epoch (``OUT/epochs/VARIANT/seedN``) and are
    evaluated with their best epoch's weights (``RUN/best``, picked on the same validation data).
    """
    zero_shot = _zero_shot_spec(cfg.data)
    val = str(Path(cfg.data) / f"{cfg.eval_split}.jsonl")
    results: dict[str, list[dict]] = {}
    for variant in variants:
        for seed in cfg.seeds:
            if cfg.per_epoch:
                picked_on = str(Path(cfg.data) / "val.jsonl")  # RUN/best is picked on val, whatever is evaluated
                run = Path(cfg.out) / "epochs" / variant / f"seed{seed}"
                run = train_run(cfg, variant, seed, run, val_data=picked_on)
            else:
                run = train_run(cfg, variant, seed)
            r = _with_best_epoch(run_results(run, val, zero_shot, cfg.curve_metric), run)
            results.setdefault(variant, []).append(r)
            print(json.dumps({"variant": variant, "seed": seed, "t2i_r10": r["t2i_r10"], "train_s": r["train_seconds"]}))
    return results


# ---------------------------------------------------------------------------- statistics and tables


def mean_sd(values: list[float]) -> str:
    """``0.123±.004`` (sample sd over seeds; ``±nan`` for one seed)."""
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "–"
    sd = statistics.stdev(values)
    if abs(statistics.mean(values)) >= 10:  # seconds
        return f"{statistics.mean(values):.0f}±{sd:.0f}"
    return f"{statistics.mean(values):.3f}±{sd:.3f}".replace("±0.", "±.")


BASELINES = ("contrastive", "triplet", "sigmoid")  # drawn dashed
CURVE_METRICS = {"t2i_r10": "t2i recall@10 (distinct texts)", "t2i_r1": "t2i recall@1 (distinct texts)",
                 "class_map": "class mAP, image -> image"}  # fmt: skip


def curve_values(result: dict, ordering: str, m: int, metric: str = "t2i_r10") -> float:
    """One point of a compact curve: ``metric`` at ``m`` dimensions under ``ordering``."""
    curve = (result["curve"] if metric == "t2i_r10" else result["curves"][metric])[ordering]
    return curve[str(m)] if str(m) in curve else curve[m]


def _has_curve(runs: list[dict], ordering: str, metric: str) -> bool:
    """Whether every run's result has the compact curve of ``metric`` under ``ordering``."""
    return all(ordering in (r["curve"] if metric == "t2i_r10" else r.get("curves", {}).get(metric, {})) for r in runs)


def compact_table(results: dict[str, list[dict]], dims: list[int], metric: str = "t2i_r10") -> str:
    lines = ["| model, ordering | " + " | ".join(f"m={m}" for m in dims) + " |", "|---|" + "---:|" * len(dims)]
    for variant, ordering, label in CURVE_ROWS:
        if variant in results and _has_curve(results[variant], ordering, metric):
            cells = [mean_sd([curve_values(r, ordering, m, metric) for r in results[variant]]) for m in dims]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def full_table(results: dict[str, list[dict]], keys: list[tuple[str, str]]) -> str:
    lines = ["| objective | " + " | ".join(label for _, label in keys) + " |", "|---|" + "---:|" * len(keys)]
    for variant, runs in results.items():
        cells = [mean_sd([r[k] for r in runs]) if all(k in r and r[k] is not None for r in runs) else "–" for k, _ in keys]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_table(
    results: dict[str, list[dict]], a: tuple[str, str], b: tuple[str, str], dims: list[int], metric: str = "t2i_r10"
) -> str:
    """Per m: mean ± sd and the range over seeds of ``a - b`` (same seed); ``a``, ``b``: (variant, ordering)."""
    def name(row: tuple[str, str]) -> str:  # the ordering is named unless it is the variant's own
        return row[0] if row[1] in ("first", "importance") else f"{row[0]} {row[1]}"

    lines = ["| m | " + f"{name(a)} − {name(b)}: mean±sd | min | max |", "|---:|---:|---:|---:|"]
    for m in dims:
        pairs = zip(results[a[0]], results[b[0]])
        diffs = [curve_values(ra, a[1], m, metric) - curve_values(rb, b[1], m, metric) for ra, rb in pairs]
        lines.append(f"| {m} | {mean_sd(diffs)} | {min(diffs):+.3f} | {max(diffs):+.3f} |")
    return "\n".join(lines)


def plot_curves(results: dict[str, list[dict]], dims: list[int], path: str, title: str, metric: str = "t2i_r10") -> None:
    """Mean ± sd over seeds against m; the baselines' PCA curves dashed, PCA of MRL / ``tricl`` dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4), dpi=120)
    for n, (variant, ordering, label) in enumerate(CURVE_ROWS):
        if variant not in results or not _has_curve(results[variant], ordering, metric):
            continue
        runs = results[variant]
        means = [statistics.mean(curve_values(r, ordering, m, metric) for r in runs) for m in dims]
        sds = [statistics.stdev([curve_values(r, ordering, m, metric) for r in runs]) if len(runs) > 1 else 0 for m in dims]
        ls = "--" if variant in BASELINES else ":" if ordering == "pca" and variant != "infonce" else "-"
        ax.errorbar(dims, means, yerr=sds, marker="o", ms=3, capsize=2, label=label, ls=ls,
                    color=plt.get_cmap("tab20")(2 * n % 20 + (n >= 10)))  # fmt: skip; 10 dark hues, then light
    ax.set_xscale("log", base=2)
    ax.set_xticks(dims, [str(m) for m in dims])
    ax.set_xlabel("m (dimensions kept)")
    ax.set_ylabel(CURVE_METRICS[metric])
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp)
    tmp.replace(out)  # atomic
    plt.close(fig)


# ---------------------------------------------------------------------------- experiments


def compact(cfg: ResultsConfig) -> None:
    results = collect(cfg, cfg.variants or EXPERIMENTS["compact"])
    dims = dims_for(cfg.embed_dim)
    metric = cfg.curve_metric
    kept = "kept weights (the best epoch on val when beyond noise, else the last: RUN/selection.json)"
    weights = kept if cfg.per_epoch else "last weights"
    print(f"\n{CURVE_METRICS[metric]} against m, {weights}, mean ± sd over seeds {cfg.seeds}:\n")
    print(compact_table(results, dims, metric))
    keys = [("t2i_r1", "t2i R@1"), ("t2i_r10", "t2i R@10"), ("i2t_r1", "i2t R@1"), ("i2t_r10", "i2t R@10"),
            ("align", "align"), ("uniform", "uniform"), ("train_seconds", "train s")]  # fmt: skip
    if all("class_map_i2i" in r for runs in results.values() for r in runs):
        keys[4:4] = [("class_map_i2i", "class mAP i→i")]
    if all("zero_shot" in r for runs in results.values() for r in runs):
        keys[4:4] = [("zero_shot", "zero-shot acc")]
    print("\nFull dimension (the model's own score):\n")
    print(full_table(results, keys))
    if "mrl" in results and "tricl" in results:
        print(f"\nPaired by seed, MRL (first m) − tricl (importance order), {CURVE_METRICS[metric]}:\n")
        print(paired_table(results, ("mrl", "first"), ("tricl", "importance"), dims, metric))
    for base, label in (("mrl", "MRL"), ("mrl_affine", "MRL with affine heads"), ("mrl_res", "MRL with residual heads")):
        for variant in (v for v in results if _has_s(v) and base in results):
            print(f"\nPaired by seed, {variant} (S order) − {label} (first m), {CURVE_METRICS[metric]}:\n")
            print(paired_table(results, (variant, "importance"), (base, "first"), dims, metric))
    if "mrl_solved_tricl" in results and "mrl_solved" in results:  # what training on from the solve adds
        print(f"\nPaired by seed, mrl_solved_tricl − mrl_solved (both S order), {CURVE_METRICS[metric]}:\n")
        print(paired_table(results, ("mrl_solved_tricl", "importance"), ("mrl_solved", "importance"), dims, metric))
    if "mrl" in results:  # the index ordering of an MRL model: its prefix or a PCA after training
        print(f"\nPaired by seed, MRL (PCA m) − MRL (first m), {CURVE_METRICS[metric]}:\n")
        print(paired_table(results, ("mrl", "pca"), ("mrl", "first"), dims, metric))
        if "infonce" in results:
            print(f"\nPaired by seed, MRL (PCA m) − infonce (PCA m), {CURVE_METRICS[metric]}:\n")
            print(paired_table(results, ("mrl", "pca"), ("infonce", "pca"), dims, metric))
    if cfg.per_epoch:
        print("\nbest epoch: " + " / ".join(f"{v} {mean_sd([float(r['best_epoch']) for r in runs])}"
                                           for v, runs in results.items() if all("best_epoch" in r for r in runs)))  # fmt: skip
    spectral = [v for v in VARIANTS if _has_s(v)]
    for variant in ("tricl", "tricl_flat", "tricl_nonest", *spectral):
        if variant in results:
            overlap = " / ".join(
                f"m={m}: {mean_sd([r['w_prefix_overlap'][str(m)] for r in results[variant]])}" for m in dims[:-1]
            )
            mass = " / ".join(f"m={m}: {mean_sd([r['w_mass'][str(m)] for r in results[variant]])}" for m in dims[:-1])
            print(f"\n{variant}: top-m by w ∩ first m, share of m: {overlap}")
            print(f"{variant}: share of sum(w) in the top m: {mass}")
    if cfg.png:
        plot_curves(results, dims, cfg.png, cfg.title or cfg.data, metric)
        print(f"\nplot: {cfg.png}")


def falseneg(cfg: ResultsConfig) -> None:
    results = collect(cfg, cfg.variants or EXPERIMENTS["falseneg"])
    keys = [("class_map_i2i", "class mAP i→i"), ("zero_shot", "zero-shot acc"), ("t2i_r1", "t2i R@1"),
            ("t2i_r10", "t2i R@10"), ("i2t_r1", "i2t R@1"), ("align", "align"), ("uniform", "uniform")]  # fmt: skip
    print(f"\nmean ± sd over seeds {cfg.seeds}:\n")
    print(full_table(results, keys))


def identifiability(cfg: ResultsConfig) -> None:
    """Dimension-wise correlation of two seeds' val image features (own order, sign fix), and best matching."""
    from scipy.optimize import linear_sum_assignment

    from triclip.model.cache import locked_tower_outputs
    from triclip.compact.features import sign_flips
    from triclip.data import load_pairs
    from triclip.model.embed import embed_pairs
    from triclip.model.run import load_run

    pairs = load_pairs(str(Path(cfg.data) / "val.jsonl"))
    device = torch.device("cpu")
    seeds = cfg.seeds[:2]
    dims = dims_for(cfg.embed_dim)
    lines = ["| model | " + " | ".join(f"own order, first {m}" for m in dims) + " | own order, mean abs, all | best matching, all |",
             "|---|" + "---:|" * (len(dims) + 2)]  # fmt: skip
    for variant in cfg.variants or ["infonce", "mrl", "tricl", "tricl_nonest", "tricl_flat"]:
        feats = []
        for seed in seeds:
            model, _ = load_run(run_dir(cfg, variant, seed), device)
            with torch.no_grad():
                image = embed_pairs(model, pairs, device, 256, locked_tower_outputs(model, pairs, device)).image
                w = model.importance().detach().float()
            order = torch.argsort(w, descending=True, stable=True)
            z = image[:, order] * w[order].sqrt()  # (N, D) the served embedding, before normalising
            feats.append(z * sign_flips(z))
        a, b = (f - f.mean(0) for f in feats)
        a, b = a / a.norm(dim=0).clamp_min(1e-12), b / b.norm(dim=0).clamp_min(1e-12)
        corr = a.t() @ b  # (D, D) correlation of dim i (seed A) with dim j (seed B)
        diag = corr.diagonal()
        rows, cols = linear_sum_assignment(-corr.abs().numpy())
        matched = float(corr.abs()[rows, cols].mean())
        cells = [f"{float(diag[:m].mean()):.3f}" for m in dims]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {float(diag.abs().mean()):.3f} | {matched:.3f} |")
    print(f"\nMean correlation per dimension between seeds {seeds[0]} and {seeds[1]} (val images):\n")
    print("\n".join(lines))


def align_uniform_plot(cfg: ResultsConfig) -> None:
    """Scatter of align / uniform of every evaluated run under ``--out``, coloured by t2i R@10."""
    points = []
    for saved in sorted(Path(cfg.out).glob("*/seed*/result.json")):
        r = json.loads(saved.read_text())
        points.append((saved.parent.parent.name, r["align"], r["uniform"], r["t2i_r10"]))
    if not points:
        raise SystemExit(f"no evaluated runs under {cfg.out}")
    by_variant: dict[str, list] = {}
    for name, align, uniform, recall in points:
        by_variant.setdefault(name, []).append((align, uniform, recall))
    lines = ["| objective | align | uniform | t2i R@10 |", "|---|---:|---:|---:|"]
    for name, rows in by_variant.items():
        lines.append(f"| {name} | " + " | ".join(mean_sd([row[k] for row in rows]) for k in range(3)) + " |")
    print("\n".join(lines))
    recalls = [p[3] for p in points]
    for k, label in ((1, "align"), (2, "uniform")):
        xs = [p[k] for p in points]
        print(f"Spearman rank correlation of {label} with t2i R@10 over {len(points)} runs: {_spearman(xs, recalls):+.2f}")
    if cfg.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
        sc = ax.scatter([p[2] for p in points], [p[1] for p in points], c=recalls, cmap="viridis", s=25)
        for name, rows in by_variant.items():
            ax.annotate(name, (statistics.mean(r[1] for r in rows), statistics.mean(r[0] for r in rows)), fontsize=6)
        fig.colorbar(sc, label="t2i recall@10")
        ax.set_xlabel("uniform (lower: more uniform)")
        ax.set_ylabel("align (lower: better aligned)")
        ax.set_title(cfg.title or cfg.out, fontsize=9)
        ax.grid(alpha=0.3)
        _save(fig, cfg.png)
        print(f"plot: {cfg.png}")


def scale_dir(cfg: ResultsConfig, scale: float | None, variant: str, seed: int) -> Path:
    """Fixed-scale runs (None: the learned one); with ``per_epoch`` separate runs that validate every epoch."""
    if scale is None:
        return Path(cfg.out) / "epochs" / variant / f"seed{seed}" if cfg.per_epoch else run_dir(cfg, variant, seed)
    return Path(cfg.out) / ("scales_val" if cfg.per_epoch else "scales") / f"s{scale:g}" / variant / f"seed{seed}"


def _with_best_epoch(result: dict, run: Path) -> dict:
    """``result`` plus ``best_t2i_r10`` / ``best_epoch`` from the run's metrics.jsonl (when it has one)."""
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return result
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    best = max(records, key=lambda r: r["t2i_r10"])  # the first of equals, as the trainer keeps it
    return {**result, "best_t2i_r10": best["t2i_r10"], "best_epoch": best["epoch"]}


def scales(cfg: ResultsConfig) -> None:
    """align / uniform / recall with the logit scale held at each of ``cfg.scales``, and learned."""
    val = str(Path(cfg.data) / "val.jsonl")
    results: dict[tuple[str, str], list[dict]] = {}  # (variant, scale label) -> result per seed
    extra = {"val_data": val} if cfg.per_epoch else {}
    for variant in cfg.variants or ["infonce", "mrl"]:
        for scale in [*cfg.scales, None]:
            for seed in cfg.seeds:
                run = scale_dir(cfg, scale, variant, seed)
                run = train_run(cfg, variant, seed, run, **extra, **({} if scale is None else {"fixed_logit_scale": scale}))
                label = "learned" if scale is None else f"{scale:g}"
                results.setdefault((variant, label), []).append(_with_best_epoch(run_results(run, val), run))
        print(json.dumps({"variant": variant, "runs": len(cfg.scales) * len(cfg.seeds) + len(cfg.seeds)}))
    print(f"\nmean ± sd over seeds {cfg.seeds}:\n")
    print(scales_table(results))
    if cfg.png:
        plot_scales(results, cfg.png, cfg.title or cfg.data)
        print(f"\nplot: {cfg.png}")


def scales_table(results: dict[tuple[str, str], list[dict]]) -> str:
    keys = ["logit_scale", "align", "uniform", "t2i_r1", "t2i_r10"]
    header = "| objective | s | final s | align | uniform | t2i R@1 | t2i R@10 |"
    best = all("best_t2i_r10" in r for runs in results.values() for r in runs)
    if best:
        keys, header = keys + ["best_t2i_r10", "best_epoch"], header + " best-epoch t2i R@10 | best epoch |"
    lines = [header, "|---|---|" + "---:|" * len(keys)]
    for (variant, label), runs in results.items():
        lines.append(f"| {variant} | {label} | " + " | ".join(mean_sd([r[k] for r in runs]) for k in keys) + " |")
    return "\n".join(lines)


def plot_scales(results: dict[tuple[str, str], list[dict]], path: str, title: str) -> None:
    """Left: align and uniform against s; right: t2i R@10 against s; learned runs at their final s (hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.0), dpi=120)
    for n, variant in enumerate(dict.fromkeys(v for v, _ in results)):
        fixed = [(float(lab), runs) for (v, lab), runs in results.items() if v == variant and lab != "learned"]
        xs = [x for x, _ in fixed]
        for ax, key, style in ((left, "align", "-"), (left, "uniform", "--"), (right, "t2i_r10", "-")):
            means = [statistics.mean(r[key] for r in runs) for _, runs in fixed]
            sds = [statistics.stdev([r[key] for r in runs]) if len(runs) > 1 else 0.0 for _, runs in fixed]
            line = ax.errorbar(xs, means, yerr=sds, ls=style, marker="o", ms=3, capsize=2, color=f"C{n}",
                               label=f"{variant} {key}")  # fmt: skip
            learned = results.get((variant, "learned"))
            if learned:
                ax.errorbar([statistics.mean(r["logit_scale"] for r in learned)],
                            [statistics.mean(r[key] for r in learned)], marker="s", ms=7, mfc="none",
                            color=line[0].get_color())  # fmt: skip
    for ax, ylabel in ((left, "align (solid), uniform (dashed)"), (right, "t2i recall@10 (distinct texts)")):
        ax.set_xscale("log")
        ax.set_xticks([2, 5, 10, 20, 50, 100], ["2", "5", "10", "20", "50", "100"])
        ax.set_xlabel("logit scale s (held fixed; hollow square: learned, at its final s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    _save(fig, path)


EPOCH_KEYS = [("align", "align"), ("uniform", "uniform"), ("t2i_r10", "t2i R@10"), ("logit_scale", "s")]


def epochs(cfg: ResultsConfig) -> None:
    """align / uniform / t2i R@10 / s after every epoch, from runs trained with validation data."""
    val = str(Path(cfg.data) / "val.jsonl")
    curves: dict[str, list[list[dict]]] = {}  # variant -> per seed, the metrics.jsonl records
    for variant in cfg.variants or ["infonce", "mrl", "tricl"]:
        for seed in cfg.seeds:
            run = train_run(cfg, variant, seed, Path(cfg.out) / "epochs" / variant / f"seed{seed}", val_data=val)
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            curves.setdefault(variant, []).append(records)
    print(f"\nmean ± sd over seeds {cfg.seeds}, validation after each epoch:\n")
    print(epochs_table(curves))
    if cfg.png:
        plot_epochs(curves, cfg.png, cfg.title or cfg.data)
        print(f"\nplot: {cfg.png}")


def epochs_table(curves: dict[str, list[list[dict]]], shown: tuple[int, ...] = (1, 2, 3, 4, 5, 10, 20, 30, 40)) -> str:
    lines = ["| objective | epoch | " + " | ".join(label for _, label in EPOCH_KEYS) + " |",
             "|---|---:|" + "---:|" * len(EPOCH_KEYS)]  # fmt: skip
    for variant, per_seed in curves.items():
        for epoch in shown:
            rows = [next((r for r in recs if r["epoch"] == epoch), None) for recs in per_seed]
            if any(r is None for r in rows):
                continue
            cells = [mean_sd([r[k] for r in rows]) for k, _ in EPOCH_KEYS[:-1]]
            cells.append(f"{statistics.mean(r['logit_scale'] for r in rows):.2f}")  # s moves little: 2 decimals
            lines.append(f"| {variant} | {epoch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_epochs(curves: dict[str, list[list[dict]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(EPOCH_KEYS), figsize=(3.2 * len(EPOCH_KEYS), 3.4), dpi=120)
    for n, (variant, per_seed) in enumerate(curves.items()):
        count = min(len(recs) for recs in per_seed)
        xs = [per_seed[0][i]["epoch"] for i in range(count)]
        for ax, (key, label) in zip(axes, EPOCH_KEYS):
            means = [statistics.mean(recs[i][key] for recs in per_seed) for i in range(count)]
            ax.plot(xs, means, color=f"C{n}", label=variant)
            if len(per_seed) > 1:
                sds = [statistics.stdev([recs[i][key] for recs in per_seed]) for i in range(count)]
                ax.fill_between(xs, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)],
                                color=f"C{n}", alpha=0.2)  # fmt: skip
            ax.set_xlabel("epoch")
            ax.set_title(label, fontsize=9)
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    _save(fig, path)


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    rx, ry = ranks(xs), ranks(ys)
    return statistics.correlation(rx, ry) if len(xs) > 2 else float("nan")


def prepare_tuxpaint(out: str, root: str = "/usr/share/tuxpaint/stamps", val_share: float = 0.15) -> dict:
    """Manifests of the Tux Paint stamps: each PNG with its English description (first line of the .txt)."""
    from triclip.core.io import write_text_atomic

    base = Path(root)
    if not base.is_dir():
        raise SystemExit(f"{root} not found: apt-get install tuxpaint-stamps-default")
    rows: dict[str, list[str]] = {"train": [], "val": []}
    for png in sorted(base.rglob("*.png")):
        txt = png.with_suffix(".txt")
        if not txt.exists():
            continue
        caption = txt.read_text(encoding="utf-8", errors="replace").splitlines()[0].strip() if txt.stat().st_size else ""
        if not caption or "=" in caption.split(" ")[0]:
            continue
        rel = png.relative_to(base)
        split = "val" if int(hashlib.sha256(str(rel).encode()).hexdigest()[:8], 16) / 2**32 < val_share else "train"
        row = {"image": str(png), "captions": [caption], "label": rel.parts[0]}
        rows[split].append(json.dumps(row, ensure_ascii=False))
    for split, lines in rows.items():
        write_text_atomic(Path(out) / f"{split}.jsonl", "".join(line + "\n" for line in lines))
    return {split: len(lines) for split, lines in rows.items()}


# ---------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("experiment", choices=["compact", "falseneg", "identifiability", "align_uniform", "scales", "epochs",
                                          "prepare-tuxpaint"])  # fmt: skip
    p.add_argument("--data", required=True)
    p.add_argument("--out", default=None, help="run folder root (default runs/results/<data folder name>)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", nargs="+", default=[], choices=list(VARIANTS))
    p.add_argument("--model", default="lite")
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-lock", action="store_true", help="train the towers too (slow)")
    p.add_argument("--png", default=None)
    p.add_argument("--title", default="")
    p.add_argument("--scales", default="2,5,10,20,50,100", help="scales: the fixed logit scales")
    p.add_argument("--per-epoch", action="store_true",
                   help="scales, compact: validate every epoch; evaluate the best epoch (RUN/best)")
    p.add_argument("--curve-metric", default="t2i_r10", choices=["t2i_r10", "t2i_r1", "class_map"],
                   help="compact: the metric of the curve against m")  # fmt: skip
    p.add_argument("--eval-split", default="val", help="evaluate on DIR/<split>.jsonl (e.g. test)")
    ns = p.parse_args(argv)
    start = time.perf_counter()
    if ns.experiment == "prepare-tuxpaint":
        print(json.dumps(prepare_tuxpaint(ns.data)))
        return 0
    cfg = ResultsConfig(
        data=ns.data, out=ns.out or str(Path("runs/results") / Path(ns.data).name),
        seeds=[int(s) for s in ns.seeds.split(",") if s.strip()], variants=ns.variants, model=ns.model,
        embed_dim=ns.embed_dim, steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr, lock=not ns.no_lock,
        png=ns.png, title=ns.title, scales=[float(s) for s in ns.scales.split(",") if s.strip()],
        per_epoch=ns.per_epoch, curve_metric=ns.curve_metric, eval_split=ns.eval_split,
    )  # fmt: skip
    {"compact": compact, "falseneg": falseneg, "identifiability": identifiability, "align_uniform": align_uniform_plot,
     "scales": scales, "epochs": epochs}[
        ns.experiment
    ](cfg)
    print(f"\nwall time: {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
