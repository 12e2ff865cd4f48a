"""The settings of ``triclip train`` and ``triclip eval``, one field each.

Torch-free on purpose: the command line builds its options from these classes
(``app.options``) without loading torch. A field's comment is its ``--help`` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from retrieval.data.records import DataConfig

WEIGHTS = ("best", "last")  # which weights of a run eval / index use (retrieval.run)


@dataclass
class TrainConfig:
    train_data: str  # training data source (any format of retrieval.data)
    out: str  # run directory
    val_data: str | None = None  # evaluated after every epoch; the best epoch by t2i_r10 is kept in RUN/best
    model: str = "tiny"  # preset: tiny, lite, lite1, lite2, or an open_clip architecture
    pretrained: str | None = None  # open_clip pretrained tag (needs the weights locally)
    embed_dim: int | None = None  # D (None: per preset)
    head: Literal["linear", "affine", "mlp"] | None = None  # projection heads (None: --init's, else mlp for lite, else linear)
    text_max_length: int | None = None  # lite: caption tokens kept (None: 256; 64 bounds memory when the text tower trains)
    importance: str = "softplus_mean1"  # how the model makes w from theta (retrieval.model.IMPORTANCE_FORMS)
    importance_spread: float | None = None  # w starts as a ramp 1 ... 1/spread (None: 100 if the objective trains w, else 1)
    importance_lr_scale: float = 1.0  # theta's learning rate = lr * this (Adam moves theta ~lr per step)
    tower_lr_scale: float = 1.0  # unlocked towers' learning rate = lr * this (pretrained towers: < 1)
    importance_block: bool = False  # one Adam second moment for all of theta (training.optim): steps keep relative sizes
    loss: str = "mrl"  # objective name (retrieval.losses); mrl = infonce + prefix nesting (docs/results.md)
    loss_options: dict = field(default_factory=dict)  # options of the objective, e.g. tau_plus=0.1
    fixed_logit_scale: float | None = None  # hold the logit scale s at this value, 1-100 (not trained); None: learned, clamped to 100
    epochs: int = 1  # passes over the training data
    batch_size: int = 64  # pairs per step, per rank
    lr: float | None = None  # peak learning rate (None: 1e-3 for tiny, 1e-4 for lite, else 5e-4)
    weight_decay: float = 0.1  # AdamW, on weight matrices only
    warmup_steps: int | None = None  # linear warmup steps (None: 5% of all steps)
    grad_clip: float = 1.0  # max global grad norm (0: off)
    resume: bool = False  # continue the run in --out with the settings of its config.json
    overwrite: bool = False  # replace the run already in --out (any other non-empty folder is refused)
    init: str | None = None  # start from this run's weights (e.g. triclip solve's): same preset, D and head kind
    lock_image: bool = False  # freeze the image tower, cache its outputs
    lock_text: bool = False  # freeze the text tower, cache its outputs
    unlock_image_groups: int = 0  # train only the top N groups of the image tower; the rest runs once, cached (0: off)
    unlock_text_layers: int = 0  # train only the top N layers of the text tower; the rest runs once, cached (0: off)
    cached_views: int = 1  # with --unlock-image-groups: augmented views cached per image, one drawn per epoch
    cache_budget: float = 4.0  # GB that cached activations below the cut may take; larger is refused
    seed: int = 0  # seeds the model's initialisation, the batch order and the caption choice
    workers: int = 0  # DataLoader worker processes for image decoding
    save_every: int = 0  # also checkpoint every N steps (0: only per epoch)
    max_steps: int | None = None  # stop early after this many steps (benchmarks, smoke runs)
    device: str | None = None  # cpu, cuda, cuda:1 (None: cuda when available)
    data: DataConfig = field(default_factory=DataConfig)  # how to read the sources
    eval_batch_size: int = 256  # pairs per batch when evaluating
    log_every: int = 10  # TensorBoard scalars every N steps


@dataclass
class EvalConfig:
    run: str  # run directory (triclip train --out)
    data: str  # data source to evaluate on
    dims: list[int] = field(default_factory=list)  # compact curve at these m (empty: D/16, D/8, D/4)
    weights: Literal["best", "last"] = "best"  # the run's best epoch by validation t2i_r10 (last when none is kept), or its last
    batch_size: int = 256  # pairs per batch
    workers: int = 0  # DataLoader worker processes for image decoding
    seed: int = 0  # seed of the random ordering of the compact curve
    device: str | None = None  # cpu, cuda, cuda:1 (None: cuda when available)
    data_config: DataConfig = field(default_factory=DataConfig)  # how to read the source


@dataclass
class SolveConfig:
    train_data: str  # training data source: the CCA is fitted on its (image, caption) pairs
    out: str  # run directory (an ordinary run: eval, index build, app and train --init read it)
    val_data: str | None = None  # picks the ridge by t2i_r10 (--ridge auto) and is evaluated
    model: str = "lite"  # preset whose towers are locked: lite, lite1, lite2, tiny, or an open_clip architecture
    embed_dim: int | None = None  # D, canonical directions kept (None: per preset; at most the smaller tower width)
    ridge: str = "auto"  # r, ridge = r * mean variance of each tower's features; auto: the best of 0.001-1 on --val-data
    weighting: float = 1.0  # the served score weighs dimension k by rho_k ** this (1: f^T S g; 0: plain cosine)
    text_max_length: int | None = None  # lite: caption tokens kept (None: 256)
    overwrite: bool = False  # replace the run already in --out
    batch_size: int = 256  # pairs per batch when evaluating
    workers: int = 0  # DataLoader worker processes for image decoding
    device: str | None = None  # cpu, cuda, cuda:1 (None: cuda when available)
    data: DataConfig = field(default_factory=DataConfig)  # how to read the sources
