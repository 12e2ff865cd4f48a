"""Ablation: what makes the tri-factor importance order the dimensions (for compact retrieval).

Trains one model per variant on the same data (default: the calibrated set-up:
``lite`` with both towers locked and cached, linear heads to D = 256,
1,500 steps of 256) and prints the compact curve (t2i recall@10 against m) for
the importance order and the baselines, plus how unequal the learned ``w`` is.

    .venv/bin/python -m benchmarks.ablate_importance --data DIR --out runs/ablate [--variants a b ...]

DIR holds ``train.jsonl`` and ``val.jsonl`` (e.g. ``triclip data prepare openclipart --out DIR``).
Runs that already exist in ``--out`` are evaluated again, not retrained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.results import measured_run
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
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))  # the variants to train, space-separated
    model: str = "lite"  # preset
    embed_dim: int = 256  # D
    steps: int = 1500  # optimizer steps per variant
    batch_size: int = 256  # pairs per step
    lr: float = 1e-3  # peak learning rate
    lock: bool = True  # both towers locked (heads, logit scale and importance train; --no-lock: the towers train too)
    dims: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128])  # m's of the compact curve
    seed: int = 0  # seed of every run


def run_variant(cfg: AblationConfig, name: str) -> dict:
    run = Path(cfg.out) / name
    data = Path(cfg.data)
    if not (run / "model.safetensors").exists():
        train(TrainConfig(**{**measured_run(cfg, run, cfg.seed), **_overrides(name)}))  # a variant wins
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
    from triclip.app.options import parse_config

    variants = {"nargs": "+", "type": str, "choices": list(VARIANTS), "metavar": "VARIANT"}
    cfg = parse_config(AblationConfig, argv, __doc__.splitlines()[0], overrides={"variants": variants})
    results = {}
    for name in cfg.variants:
        results[name] = run_variant(cfg, name)
        print(json.dumps({"variant": name, "t2i_r10": results[name]["t2i_r10"], "compact": results[name]["compact"]}))
    print(table(results, cfg.dims))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
