"""Preset recipes: the table, its resolution, overrides, what config.json records, --resume."""

from __future__ import annotations

import json

import pytest

from triclip.app.cli import build_parser
from triclip.app.options import given_fields, to_config
from triclip.core.errors import UserError
from triclip.training.config import OPEN_CLIP_RECIPE, RECIPES, Recipe, TrainConfig, recipe_for, resolve_recipe
from triclip.training.train import train

RECIPE_FIELDS = ("epochs", "batch_size", "lr", "head", "lock_image", "lock_text", "tower_lr_scale", "patience")


def _blank(**kw) -> TrainConfig:
    return TrainConfig(train_data="t.jsonl", out="run", **kw)


@pytest.mark.parametrize(
    "model, expected",
    [
        ("tiny", (1, 64, 1e-3, "linear", False, False, 1.0, 0)),
        ("lite", (40, 256, 1e-3, "mlp", True, True, 0.1, 5)),
        ("lite1", (40, 256, 1e-3, "mlp", True, True, 0.1, 5)),
        ("lite2", (40, 256, 1e-3, "mlp", True, True, 0.1, 5)),
        ("ViT-B-32", (1, 64, 5e-4, "linear", False, False, 1.0, 0)),
    ],
)
def test_each_preset_brings_its_recipe(model, expected):
    cfg = resolve_recipe(_blank(model=model))
    assert tuple(getattr(cfg, name) for name in RECIPE_FIELDS) == expected
    assert recipe_for(model) == (RECIPES.get(model) or OPEN_CLIP_RECIPE)


def test_the_lite_recipe_is_the_measured_one():
    """docs/results_archive.md (set-up, section 7): locked cached towers, MLP heads, batch 256, lr 1e-3, 40 epochs, early stopping after 5."""
    assert RECIPES["lite"] == Recipe(
        epochs=40, batch_size=256, lr=1e-3, head="mlp", lock_image=True, lock_text=True, tower_lr_scale=0.1, patience=5
    )


def test_given_values_override_the_recipe_field_by_field():
    cfg = resolve_recipe(_blank(model="lite", lr=3e-4, lock_image=False, epochs=5, head="linear"))
    assert (cfg.lr, cfg.lock_image, cfg.epochs, cfg.head) == (3e-4, False, 5, "linear")  # given
    assert (cfg.batch_size, cfg.lock_text, cfg.tower_lr_scale) == (256, True, 0.1)  # the recipe's


def test_checkpoint_interval_follows_the_locks():
    assert resolve_recipe(_blank(model="lite")).checkpoint_every == 20  # cheap epochs over cached outputs
    assert resolve_recipe(_blank(model="lite", lock_text=False)).checkpoint_every == 1
    assert resolve_recipe(_blank(model="lite", unlock_image_groups=1)).checkpoint_every == 1
    assert resolve_recipe(_blank(model="tiny")).checkpoint_every == 1
    assert resolve_recipe(_blank(model="lite", checkpoint_every=3)).checkpoint_every == 3


def test_resolution_is_idempotent_and_leaves_the_head_to_init():
    once = resolve_recipe(_blank(model="lite"))
    assert resolve_recipe(once) == once
    assert resolve_recipe(_blank(model="lite", init="solved")).head is None  # --init's heads decide


def _parse(*argv: str) -> tuple[TrainConfig, set[str]]:
    ns = build_parser().parse_args(["train", "--train-data", "t.jsonl", "--out", "run", *argv])
    return to_config(TrainConfig, ns), given_fields(ns)


def test_unlocking_is_an_explicit_flag_and_the_old_flags_work():
    cfg, given = _parse("--model", "lite")
    assert cfg.lock_image is None and cfg.lock_text is None and "lock_image" not in given  # the recipe decides
    cfg, given = _parse("--model", "lite", "--unlock-image", "--no-lock-text")
    assert cfg.lock_image is False and cfg.lock_text is False and {"lock_image", "lock_text"} <= given
    cfg, _ = _parse("--model", "tiny", "--lock-image", "--lock-text")
    assert cfg.lock_image is True and cfg.lock_text is True
    cfg, _ = _parse("--model", "lite", "--epochs", "3", "--lr", "0.01")
    resolved = resolve_recipe(cfg)
    assert (resolved.epochs, resolved.lr, resolved.batch_size, resolved.lock_image) == (3, 0.01, 256, True)


def _cfg(shapes_data, out, **kw) -> TrainConfig:
    base = dict(train_data=str(shapes_data / "train.jsonl"), val_data=None, out=str(out), model="tiny", embed_dim=16)
    return TrainConfig(**{**base, **kw})


def test_config_json_records_the_values_used_and_resume_keeps_them(shapes_data, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, lr=0.002, max_steps=2))
    first = json.loads((run / "config.json").read_text())["train"]
    assert (first["epochs"], first["batch_size"], first["lr"], first["head"]) == (1, 64, 0.002, "linear")
    assert (first["lock_image"], first["lock_text"], first["tower_lr_scale"]) == (False, False, 1.0)
    assert first["checkpoint_every"] == 1 and first["select_factor"] == 2.0
    assert None not in [first[name] for name in RECIPE_FIELDS]

    train(_cfg(shapes_data, run, resume=True, max_steps=4), given={"train_data", "out", "resume", "max_steps"})
    again = json.loads((run / "config.json").read_text())["train"]
    assert again["lr"] == 0.002 and again["max_steps"] == 4  # the run's own lr, not tiny's 1e-3
    same = lambda t: {k: v for k, v in t.items() if k not in ("max_steps", "resume")}  # noqa: E731
    assert same(again) == same(first)

    with pytest.raises(UserError, match=r"--lr 0.001 \(the run's: 0.002\)"):
        train(_cfg(shapes_data, run, resume=True, lr=1e-3), given={"train_data", "out", "resume", "lr"})


def test_resume_of_a_run_written_before_recipes(shapes_data, tmp_path):
    """An older config.json has no checkpoint_every / select_factor: they are filled in."""
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, max_steps=2))
    config = json.loads((run / "config.json").read_text())
    for name in ("checkpoint_every", "select_factor"):
        del config["train"][name]
    (run / "config.json").write_text(json.dumps(config))
    train(_cfg(shapes_data, run, resume=True, max_steps=3), given={"train_data", "out", "resume", "max_steps"})
    assert json.loads((run / "config.json").read_text())["train"]["checkpoint_every"] == 1


def test_a_recipe_batch_shrinks_to_a_small_set_a_given_one_is_refused(shapes_data, tmp_path, capsys):
    lines = (shapes_data / "train.jsonl").read_text().splitlines()[:40]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({**json.loads(x), "image": str(shapes_data / json.loads(x)["image"])}) + "\n" for x in lines))
    train(_cfg(shapes_data, tmp_path / "run", train_data=str(small), max_steps=1))  # tiny's 64 > 40 records
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["batch_size"] == 20
    assert "batch 20 instead of the tiny recipe's 64, so that an epoch holds two full batches" in capsys.readouterr().out
    with pytest.raises(UserError, match="--batch-size 64 is larger than the 40 usable training records"):
        train(_cfg(shapes_data, tmp_path / "run2", train_data=str(small), batch_size=64, max_steps=1))
