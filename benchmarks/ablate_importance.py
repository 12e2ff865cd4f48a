"""Ablation: what makes the tri-factor importance order the dimensions (issue: compact retrieval).

Trains one model per variant on the same data (default: the calibration of the
issue: ``lite`` with both towers locked and cached, linear heads to D = 256,
1,500 steps of 256) and prints the compact curve (t2i recall@10 against m) for
the importance order and the baselines, plus how unequal the learned ``w`` is.

    .venv/bin/python -m benchmarks.ablate_importance --data DIR --out runs/ablate [--variants a b ...]

DIR holds ``train.jsonl`` and ``val.jsonl`` (e.g. ``triclip data prepare openclipart --out DIR``).
Runs that already exist in ``--out`` are evaluated again, not retrained.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from triclip.training.evaluate import evaluate_run
from triclip.training.train import TrainConfig, train

# Every variant starts from the paper's importance (w = softplus(theta), all ones at the start), linear heads.
PAPER = dict(importance="softplus", importance_spread=1.0, head="linear")

# name -> TrainConfig overrides of PAPER. "naive" is a straight port of the paper's loss.
VARIANTS: dict[str, dict] = {
    "infonce": dict(loss="infonce"),
    "infonce_mlp": dict(loss="infonce", head="mlp"),
    "naive": dict(loss="tricl", loss_options={"dec_weight": 1.0}),
    "dec10": dict(loss="tricl", loss_options={"dec_weight": 10.0}),
    "mean1": dict(loss="tricl", importance="softplus_mean1", loss_options={"dec_weight": 1.0}),
    "lr100": dict(loss="tricl", importance_lr_scale=100.0, loss_options={"dec_weight": 1.0}),
    "mean1_lr100": dict(loss="tricl", importance="softplus_mean1", importance_lr_scale=100.0, loss_options={"dec_weight": 1.0}),
    "mean1_lr100_dec10": dict(
        loss="tricl", importance="softplus_mean1", importance_lr_scale=100.0, loss_options={"dec_weight": 10.0}
    ),
    "block": dict(loss="tricl", importance_block=True, importance_lr_scale=10.0, loss_options={"dec_weight": 1.0}),
    "mean1_block": dict(
        loss="tricl", importance="softplus_mean1", importance_block=True, importance_lr_scale=10.0,
        loss_options={"dec_weight": 1.0},
    ),
    "mean1_block100": dict(
        loss="tricl", importance="softplus_mean1", importance_block=True, importance_lr_scale=100.0,
        loss_options={"dec_weight": 1.0},
    ),
    "mean1_block100_dec10": dict(
        loss="tricl", importance="softplus_mean1", importance_block=True, importance_lr_scale=100.0,
        loss_options={"dec_weight": 10.0},
    ),
    # Symmetry breaking: w starts as a ramp 1 ... 1/100, so the heads learn where to put what matters.
    "mean1_spread100": dict(
        loss="tricl", importance="softplus_mean1", importance_spread=100.0, loss_options={"dec_weight": 1.0}
    ),
    "mean1_spread100_dec10": dict(
        loss="tricl", importance="softplus_mean1", importance_spread=100.0, loss_options={"dec_weight": 10.0}
    ),
    "mean1_spread10_dec10": dict(
        loss="tricl", importance="softplus_mean1", importance_spread=10.0, loss_options={"dec_weight": 10.0}
    ),
    "mean1_spread1000_dec10": dict(
        loss="tricl", importance="softplus_mean1", importance_spread=1000.0, loss_options={"dec_weight": 10.0}
    ),
    "mean1_spread100_dec10_mlp": dict(
        loss="tricl", importance="softplus_mean1", importance_spread=100.0, head="mlp", loss_options={"dec_weight": 10.0}
    ),
    "naive_mlp": dict(loss="tricl", head="mlp", loss_options={"dec_weight": 1.0}),
    "mean1_dec10_mlp": dict(loss="tricl", importance="softplus_mean1", head="mlp", loss_options={"dec_weight": 10.0}),
    "mean1_spread100_mlp": dict(
        loss="tricl", importance="softplus_mean1", importance_spread=100.0, head="mlp", loss_options={"dec_weight": 1.0}
    ),
    "mean1_spread100_lr100_dec10": dict(
        loss="tricl", importance="softplus_mean1", importance_spread=100.0, importance_lr_scale=100.0,
        loss_options={"dec_weight": 10.0},
    ),
    # Cosine of sqrt(w) * z in the loss, as the top-m embedding scores: w cannot act as a temperature.
    "renorm_dec10": dict(loss="tricl", loss_options={"dec_weight": 10.0, "renormalize": True}),
    "renorm_lr100_dec10": dict(
        loss="tricl", importance_lr_scale=100.0, loss_options={"dec_weight": 10.0, "renormalize": True}
    ),
    "renorm_spread100_dec10": dict(
        loss="tricl", importance_spread=100.0, loss_options={"dec_weight": 10.0, "renormalize": True}
    ),
}

# Nested top-m terms (Matryoshka-style, on the importance order: nested_loss) on top of the ramp default.
_DEFAULT_MLP = VARIANTS["mean1_spread100_dec10_mlp"]


def _nested(base: dict, **options) -> dict:
    return {**base, "loss_options": {**base["loss_options"], **options}}


VARIANTS.update(
    nested4_mlp=_nested(_DEFAULT_MLP, nested=4),  # m = D/2 ... D/16, weight 1 each: the training default
    nested4_w025_mlp=_nested(_DEFAULT_MLP, nested=4, nested_weight=0.25),
    nested5_w02_mlp=_nested(_DEFAULT_MLP, nested=5, nested_weight=0.2),
    nested4=_nested(VARIANTS["mean1_spread100_dec10"], nested=4),  # linear heads
    nested4_w025=_nested(VARIANTS["mean1_spread100_dec10"], nested=4, nested_weight=0.25),
    nested4_flat_w025_mlp={**_nested(_DEFAULT_MLP, nested=4, nested_weight=0.25), "importance_spread": 1.0},
    nested4_flat_mlp={**_nested(_DEFAULT_MLP, nested=4), "importance_spread": 1.0},  # no ramp: w starts flat
)


@dataclass
class AblationConfig:
    data: str  # folder with train.jsonl and val.jsonl
    out: str  # one run folder per variant under it
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    model: str = "lite"
    embed_dim: int = 256
    steps: int = 1500
    batch_size: int = 256
    lr: float = 1e-3
    lock: bool = True  # both towers locked (heads, logit scale and importance train)
    dims: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128])
    seed: int = 0


def run_variant(cfg: AblationConfig, name: str) -> dict:
    run = Path(cfg.out) / name
    data = Path(cfg.data)
    if not (run / "model.safetensors").exists():
        n_train = sum(1 for _ in open(data / "train.jsonl"))
        epochs = math.ceil(cfg.steps / (n_train // cfg.batch_size))
        train(
            TrainConfig(
                train_data=str(data / "train.jsonl"),
                val_data=None,
                out=str(run),
                model=cfg.model,
                embed_dim=cfg.embed_dim,
                epochs=epochs,
                max_steps=cfg.steps,
                batch_size=cfg.batch_size,
                lr=cfg.lr,
                lock_image=cfg.lock,
                lock_text=cfg.lock,
                seed=cfg.seed,
                **_overrides(name),
            )
        )
    return evaluate_run(str(run), str(data / "val.jsonl"), dims=cfg.dims)


def _overrides(name: str) -> dict:
    """TrainConfig fields of a variant: PAPER, then the variant; tricl without nesting unless it says so."""
    out = {**PAPER, **VARIANTS[name]}
    if out["loss"] == "tricl":
        out["loss_options"] = {"nested": 0, **out.get("loss_options", {})}
    return out


def table(results: dict[str, dict], dims: list[int]) -> str:
    head = "| variant | full R@10 | w max/mean | ordering | " + " | ".join(f"m={m}" for m in dims) + " |"
    lines = [head, "|" + "---|" * (4 + len(dims))]
    for name, r in results.items():
        for ordering, curve in r["compact"].items():
            values = " | ".join(f"{curve[str(m)] if str(m) in curve else curve[m]:.3f}" for m in dims)
            lines.append(
                f"| {name} | {r['t2i_r10']:.3f} | {r['importance']['max_over_mean']:.2f} | {ordering} | {values} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--model", default="lite")
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-lock", action="store_true")
    p.add_argument("--dims", default="8,16,32,64,128")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    cfg = AblationConfig(
        data=ns.data, out=ns.out, variants=ns.variants, model=ns.model, embed_dim=ns.embed_dim, steps=ns.steps,
        batch_size=ns.batch_size, lr=ns.lr, lock=not ns.no_lock, dims=[int(x) for x in ns.dims.split(",")], seed=ns.seed,
    )  # fmt: skip
    results = {}
    for name in cfg.variants:
        results[name] = run_variant(cfg, name)
        print(json.dumps({"variant": name, "t2i_r10": results[name]["t2i_r10"], "compact": results[name]["compact"]}))
    print(table(results, cfg.dims))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
