"""The settings of ``triclip train`` and ``triclip eval``, one field each.

Torch-free on purpose: the command line builds its options from these classes
(``triclip.app.options``) without loading torch. A field's comment is its ``--help`` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from triclip.core.config import bounded, check_fields, check_device
from triclip.core.errors import UserError
from triclip.data.config import check_data
from triclip.data.records import DataConfig

WEIGHTS = ("best", "last")  # which weights of a run eval / index use (triclip.model.run)


# ---------------------------------------------------------------------------- preset recipes


@dataclass(frozen=True)
class Recipe:
    """What a preset trains with unless an option says otherwise (``triclip train --help`` lists them)."""

    epochs: int  # passes over the training data
    batch_size: int  # pairs per step, per rank
    lr: float  # peak learning rate
    head: str  # projection heads
    lock_image: bool  # image tower frozen, its outputs cached
    lock_text: bool  # text tower frozen, its outputs cached
    tower_lr_scale: float  # a tower that trains: lr * this
    patience: int  # with validation data: stop after this many epochs without a gain beyond noise (0: never)


# lite*: the measured recipe (docs/results.md, "Earlier evidence"; the demo): pretrained towers locked and cached,
# MLP heads, batch 256, lr 1e-3, 40 epochs; a tower unlocked trains at lr/10 (the same section: partly unlocked towers);
# stops after 5 epochs without a validation gain beyond noise (docs/results.md, "Early stopping").
_LITE = Recipe(epochs=40, batch_size=256, lr=1e-3, head="mlp", lock_image=True, lock_text=True, tower_lr_scale=0.1, patience=5)
RECIPES: dict[str, Recipe] = {
    "tiny": Recipe(epochs=1, batch_size=64, lr=1e-3, head="linear", lock_image=False, lock_text=False, tower_lr_scale=1.0, patience=0),
    "lite": _LITE,
    "lite1": _LITE,
    "lite2": _LITE,
}
OPEN_CLIP_RECIPE = Recipe(
    epochs=1, batch_size=64, lr=5e-4, head="linear", lock_image=False, lock_text=False, tower_lr_scale=1.0, patience=0
)
LOCKED_CHECKPOINT_EVERY = 20  # epochs between checkpoints when both towers are locked (an epoch takes seconds: a kill loses about a minute)


# The demo's recipe, defined once: triclip/app/demo.py runs it, benchmarks.results names its steps (variants mrl,
# mrl_solved, mrl_solved_tricl) and tests/test_readme.py checks the README's commands against it. Each step's
# TrainConfig fields beside the lite preset's recipe (the objectives' own defaults: triclip.losses).
MRL_STEP = {"loss": "mrl"}  # 1. train: InfoNCE nested on the first m of D (the default objective)
DEMO_MRL_EPOCHS = 20  # the demo's step 1: level with 40 on the test split after all three steps (docs/results.md)
# 2. solve --run (step 1's run): Eq. 6 solved on the embeddings it serves (triclip.training.solve; no options)
# 3. train --init (step 2's run): tricl nested on S's order, spelled out (the same as tricl's own defaults)
TUNE_STEP = {"loss": "tricl", "loss_options": {"nested": 4, "nested_order": "importance"}, "epochs": 10, "lr": 1e-4}


def recipe_for(model: str) -> Recipe:
    """The recipe of preset ``model`` (an open_clip architecture name gets OPEN_CLIP_RECIPE)."""
    return RECIPES.get(model, OPEN_CLIP_RECIPE)


def _per_preset(name: str, what: str) -> str:
    """Help text of a recipe field: ``what`` and each preset's value."""
    groups: dict[str, list[str]] = {}
    for preset, recipe in [*RECIPES.items(), ("open_clip names", OPEN_CLIP_RECIPE)]:
        groups.setdefault(str(getattr(recipe, name)), []).append(preset)
    values = "; ".join(f"{'/'.join(presets)} {value}" for value, presets in groups.items())
    return f"{what} (default: the preset's: {values})"


def recipe_table() -> str:
    """The recipes as a table (``triclip train --help``)."""
    names = [f.name for f in fields(Recipe)]
    rows = [["preset", *names]] + [[p, *(str(getattr(r, n)) for n in names)] for p, r in RECIPES.items()]
    rows.append(["open_clip", *(str(getattr(OPEN_CLIP_RECIPE, n)) for n in names)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(names) + 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "preset recipes (an option given overrides its field; config.json records what was used):\n  " + "\n  ".join(lines)


def resolve_recipe(cfg: "TrainConfig") -> "TrainConfig":
    """``cfg`` with every recipe field left None taken from its preset, and the checkpoint interval.

    Idempotent: a resumed run's config.json holds values, which stay. ``head`` stays None with
    ``--init`` (the initialising run's heads decide).
    """
    recipe = recipe_for(cfg.model)
    filled = {
        name: getattr(recipe, name)
        for name in (f.name for f in fields(Recipe))
        if getattr(cfg, name) is None and not (name == "head" and getattr(cfg, "init", None))
    }
    cfg = replace(cfg, **filled)
    if cfg.checkpoint_every is None:
        cached = cfg.lock_image and cfg.lock_text and not cfg.unlock_image_groups and not cfg.unlock_text_layers
        cfg = replace(cfg, checkpoint_every=LOCKED_CHECKPOINT_EVERY if cached else 1)
    return cfg


@dataclass
class TrainConfig:
    train_data: str  # training data source (any format of triclip.data); not needed with --resume (the run's own)
    out: str  # run directory
    val_data: str | None = None  # evaluated after every epoch; the best epoch by t2i_r10 is kept when it beats the last beyond noise (--select-factor)
    model: str = "tiny"  # preset: tiny, lite, lite1, lite2, or an open_clip architecture
    pretrained: str | None = None  # open_clip pretrained tag (needs the weights locally)
    embed_dim: int | None = bounded(None, low=1)  # D (None: per preset)
    head: Literal["linear", "affine", "mlp", "residual"] | None = None  # projection heads (None: --init's, else mlp for lite, else linear); residual = affine + mlp, can start from an affine --init
    text_max_length: int | None = bounded(None, low=2, why=" ([CLS] and [SEP])")  # lite: caption tokens kept (None: 256; 64 bounds memory when the text tower trains)
    importance: str = "softplus_mean1"  # how the model makes w from theta (triclip.model.model.IMPORTANCE_FORMS)
    importance_spread: float | None = bounded(None, low=1)  # w starts as a ramp 1 ... 1/spread (None: 100 if the objective trains w, else 1)
    importance_lr_scale: float = bounded(1.0, low=0)  # theta's learning rate = lr * this (Adam moves theta ~lr per step)
    tower_lr_scale: float | None = bounded(None, low=0, help=_per_preset("tower_lr_scale", "a tower that trains: lr * this"))
    importance_block: bool = False  # one Adam second moment for all of theta (triclip.training.optim): steps keep relative sizes
    loss: str = "mrl"  # objective name (triclip.losses); mrl = infonce + prefix nesting (docs/results.md)
    loss_options: dict = field(default_factory=dict)  # options of the objective, e.g. tau_plus=0.1 (default: the objective's own, triclip.losses: mrl and tricl nested=4, mrl nested_order=prefix; others none)
    fixed_logit_scale: float | None = bounded(None, low=1, high=100, why=" (the trainer's clamp)")  # hold the logit scale s at this value, 1-100 (not trained); None: learned, clamped to 100
    epochs: int | None = bounded(None, low=1, help=_per_preset("epochs", "passes over the training data"))
    batch_size: int | None = bounded(None, low=2, why=" (contrastive losses need negatives)",
                                     help=_per_preset("batch_size", "pairs per step, per rank"))
    lr: float | None = bounded(None, above=0, help=_per_preset("lr", "peak learning rate"))
    weight_decay: float = bounded(0.1, low=0)  # AdamW, on weight matrices only
    warmup_steps: int | None = bounded(None, low=0)  # linear warmup steps (None: 5% of all steps)
    grad_clip: float = bounded(1.0, low=0)  # max global grad norm (0: off)
    resume: bool = False  # continue the run in --out with the settings of its config.json
    init: str | None = None  # start from this run's weights (e.g. triclip solve's): same preset, D and head kind (residual heads also start from affine ones)
    post_affine: bool = False  # set from --init: a run solved on a trained run (solve --run) keeps its heads' affine maps, which train too (not an option)
    overwrite: bool = False  # replace the run already in --out (any other non-empty folder is refused)
    lock_image: bool | None = field(default=None, metadata={"help": _per_preset("lock_image", "freeze the image tower, cache its outputs; --unlock-image trains it")})
    lock_text: bool | None = field(default=None, metadata={"help": _per_preset("lock_text", "freeze the text tower, cache its outputs; --unlock-text trains it")})
    unlock_image_groups: int = bounded(0, low=0)  # train only the top N groups of the image tower; the rest runs once, cached (0: off)
    unlock_text_layers: int = bounded(0, low=0)  # train only the top N layers of the text tower; the rest runs once, cached (0: off)
    cached_views: int = bounded(1, low=1)  # with --unlock-image-groups: augmented views cached per image, one drawn per epoch
    cache_budget: float = bounded(4.0, low=0)  # GB that cached activations below the cut may take; larger is refused
    seed: int = 0  # seeds the model's initialisation, the batch order and the caption choice
    workers: int = bounded(0, low=0)  # DataLoader worker processes for image decoding
    save_every: int = bounded(0, low=0)  # also checkpoint every N steps (0: only per --checkpoint-every epochs)
    checkpoint_every: int | None = bounded(None, low=1)  # epochs between checkpoints, and always the last (None: 20 with both towers locked, else 1)
    select_factor: float = bounded(2.0, low=0)  # keep the best epoch only when it beats the last by this many standard errors of t2i_r10 (0: always the best); also the noise of --patience
    patience: int | None = bounded(None, low=0, help=_per_preset("patience", (
        "with --val-data: stop once this many epochs in a row have not beaten the reference epoch's t2i_r10 by more"
        " than --select-factor standard errors (the reference: the first epoch, then each epoch that did; 0: never stop)"
    )))  # fmt: skip
    max_steps: int | None = bounded(None, low=1)  # stop early after this many steps (benchmarks, smoke runs)
    device: str | None = None  # cpu, cuda, cuda:1 (None: cuda when available)
    data: DataConfig = field(default_factory=DataConfig)  # how to read the sources
    eval_batch_size: int = bounded(256, low=1)  # pairs per batch when evaluating
    log_every: int = bounded(10, low=1)  # TensorBoard scalars every N steps


@dataclass
class EvalConfig:
    run: str  # run directory (triclip train --out)
    data: str  # data source to evaluate on
    dims: list[int] = bounded(default_factory=list, low=1)  # compact curve at these m (empty: D/16, D/8, D/4)
    weights: Literal["best", "last"] = "best"  # best: the weights training kept (its best epoch if that beat the last beyond noise, else the last); last: the last
    batch_size: int = bounded(256, low=1)  # pairs per batch
    workers: int = bounded(0, low=0)  # DataLoader worker processes for image decoding
    seed: int = 0  # seed of the random ordering of the compact curve
    device: str | None = None  # cpu, cuda, cuda:1 (None: cuda when available)
    data_config: DataConfig = field(default_factory=DataConfig)  # how to read the source


@dataclass
class SolveConfig:
    train_data: str  # training data source: the CCA is fitted on its (image, caption) pairs
    out: str  # run directory (an ordinary run: eval, index build, app and train --init read it)
    val_data: str | None = None  # picks the ridge (--ridge auto) by t2i_r10 at full D (with --run: t2i_r10 averaged over m = D/16, D/8, D/4 and full D), ties by t2i_r1; and is evaluated
    model: str | None = None  # preset whose towers are locked: lite, lite1, lite2, tiny, or an open_clip architecture (None: lite; with --run: the run's)
    run: str | None = None  # solve on the embeddings this trained run (on locked towers) serves, not on its towers' outputs; keeps its heads
    embed_dim: int | None = bounded(None, low=1)  # D, canonical directions kept (None: per preset, with --run the run's; at most the smaller tower width)
    ridge: str = "auto"  # r, ridge = r * mean variance of each tower's features; auto: the best of 0.01-10 on --val-data, looking up to 3 steps (x3) beyond an end that wins
    weighting: float = 1.0  # the served score weighs dimension k by rho_k ** this (1: f^T S g; 0: plain cosine)
    text_max_length: int | None = bounded(None, low=2, why=" ([CLS] and [SEP])")  # lite: caption tokens kept (None: 256)
    overwrite: bool = False  # replace the run already in --out
    batch_size: int = bounded(256, low=1)  # pairs per batch when evaluating
    workers: int = bounded(0, low=0)  # DataLoader worker processes for image decoding
    device: str | None = None  # cpu, cuda, cuda:1 (None: cuda when available)
    data: DataConfig = field(default_factory=DataConfig)  # how to read the sources


# ---------------------------------------------------------------------------- checks before anything loads

ALIASES = {  # TrainConfig field -> its other option names (the first names the field in messages)
    "weight_decay": ["--wd"],
    "warmup_steps": ["--warmup"],
    "loss_options": ["--loss-opt"],
    "unlock_image_groups": ["--lock-image-unlocked-groups"],  # open_clip's names
    "unlock_text_layers": ["--lock-text-unlocked-layers"],
}
SHORT_FLAGS = ("weight_decay", "warmup_steps")  # named by their alias in messages (--wd, --warmup)


def flag(name: str) -> str:
    """The command-line flag of a TrainConfig field."""
    return ALIASES[name][0] if name in SHORT_FLAGS else "--" + name.replace("_", "-")


def check_train(cfg: TrainConfig) -> None:
    """UserError (one line naming the option) for settings that cannot work, found without torch or data:
    bounds, options that need another, the device's name, the sources and ``--init`` being there."""
    check_fields(cfg, flag)
    if cfg.cached_views > 1 and not cfg.unlock_image_groups:
        raise UserError("--cached-views needs --unlock-image-groups N (views are cached below the cut)")
    check_device(cfg.device)
    for option, path in (("--train-data", cfg.train_data), ("--val-data", cfg.val_data)):
        check_data(path or None, option)
    if cfg.init and not cfg.resume:  # a resume checks the init it recorded (triclip.training.train)
        from triclip.model.runfile import read_config

        read_config(cfg.init)  # UserError: not a run


def check_eval(cfg: EvalConfig) -> None:
    """UserError (one line) for an evaluation that cannot run, found from the run's ``config.json``: bounds,
    the device's name, the data being there, and every m of ``--dims`` at most the run's D."""
    from triclip.model.runfile import run_dim

    check_fields(cfg)
    check_device(cfg.device)
    dim = run_dim(cfg.run)  # UserError: not a run
    check_data(cfg.data, "--data")
    too_big = [m for m in cfg.dims if dim is not None and m > dim]
    if too_big:
        raise UserError(f"--dims {','.join(map(str, too_big))}: larger than the run's embedding dimension D={dim}")


def check_solve(cfg: SolveConfig) -> None:
    """UserError (one line) for a solve that cannot run, found without torch or data."""
    import math
    from pathlib import Path

    from triclip.model.runfile import CONFIG

    check_fields(cfg)
    check_device(cfg.device)
    if cfg.ridge != "auto":
        try:
            r = float(cfg.ridge)
        except ValueError:
            r = math.nan
        if not (math.isfinite(r) and r >= 0):
            raise UserError(f"--ridge must be auto or a number >= 0, got {cfg.ridge!r}")
    if not math.isfinite(cfg.weighting):
        raise UserError(f"--weighting must be a finite number, got {cfg.weighting}")
    for option, path in (("--train-data", cfg.train_data), ("--val-data", cfg.val_data)):
        check_data(path or None, option)
    if cfg.run:
        if not (Path(cfg.run) / CONFIG).is_file():
            raise UserError(f"--run {cfg.run}: not a run folder (no {CONFIG})")
        if Path(cfg.out).resolve() == Path(cfg.run).resolve():
            raise UserError("--out is --run: a solve writes a new run beside the one it solves on")
