"""``triclip.training.resolve.resolve_config``: the settings of a run from everything that decides them, by a table.

Also: ``build_loss(name)`` is exactly the objective ``train --loss name`` trains, for every registered loss.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from triclip.core.errors import UserError
from triclip.losses import available_losses, build_loss
from triclip.training.config import MRL_STEP, TUNE_STEP, TrainConfig
from triclip.training.resolve import resolve_config

INIT = {"preset": "tiny", "head": "affine", "embed_dim": 24, "importance": "softplus", "text_max_length": 32,
        "post_affine": True}  # the model section of an --init run's config.json (solve --run writes post_affine)


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(train_data="train.jsonl", out="run", **kw)


def _resumed(**train) -> tuple[Path, dict]:
    """A run's config.json as --resume reads it: its train section holds settled values."""
    saved = resolve_config(_cfg(**train), set(train))
    return Path("run/config.json"), {"train": asdict(saved)}


# (case, options given, resumed run, --init model, records, world) -> fields of the TrainConfig
TABLE = [
    ("tiny recipe, the default objective (mrl: nested on the prefix, w not trained)", {}, None, None, None, 1,
     dict(epochs=1, batch_size=64, lr=1e-3, head="linear", lock_image=False, patience=0, loss="mrl",
          loss_options={"nested": 4, "nested_order": "prefix"}, importance_spread=1.0)),
    ("lite recipe", dict(model="lite"), None, None, None, 1,
     dict(epochs=40, batch_size=256, lr=1e-3, head="mlp", lock_image=True, lock_text=True, tower_lr_scale=0.1,
          patience=5, checkpoint_every=20)),
    ("an option given wins over the recipe", dict(model="lite", lr=5e-4, head="linear"), None, None, None, 1,
     dict(lr=5e-4, head="linear", epochs=40)),
    ("tricl's own defaults: nested on the importance order, w starts as a ramp to 1/100", dict(loss="tricl"),
     None, None, None, 1, dict(loss_options={"nested": 4}, importance_spread=100.0)),
    ("an objective option given is kept, the rest of its defaults filled", dict(loss="tricl", loss_options={"nested": 0}),
     None, None, None, 1, dict(loss_options={"nested": 0}, importance_spread=100.0)),
    ("tricl_spectral's own importance: softplus started flat", dict(loss="tricl_spectral"), None, None, None, 1,
     dict(importance="softplus", importance_spread=1.0, loss_options={})),
    ("an importance form given wins over the objective's", dict(loss="tricl_spectral", importance="softplus_mean1"),
     None, None, None, 1, dict(importance="softplus_mean1", importance_spread=1.0)),
    ("the data size shrinks a recipe's batch to two full batches an epoch", dict(model="lite"), None, None, 300, 1,
     dict(batch_size=150)),
    ("... per rank", dict(model="lite"), None, None, 300, 2, dict(batch_size=75)),
    ("a batch that fits is left alone", dict(model="lite"), None, None, 5000, 2, dict(batch_size=256)),
    ("--init: D, heads, importance form, caption length and the affine maps are its own", dict(init="solved"), None,
     INIT, None, 1, dict(embed_dim=24, head="affine", importance="softplus", text_max_length=32, post_affine=True)),
    ("--init with residual heads (from affine ones)", dict(init="solved", head="residual"), None, INIT, None, 1,
     dict(head="residual", embed_dim=24)),
    ("--resume: the run's settings, epochs may grow", dict(epochs=5), _resumed(lr=0.01, loss="tricl"), None, None, 1,
     dict(lr=0.01, loss="tricl", epochs=5, loss_options={"nested": 4})),
    ("the demo's third step", dict(TUNE_STEP, model="lite", init="solved"), None, dict(INIT, preset="lite"), None, 1,
     dict(loss="tricl", epochs=10, lr=1e-4, head="affine", loss_options={"nested": 4, "nested_order": "importance"})),
]


@pytest.mark.parametrize("case, options, resumed, init, records, world, want", TABLE, ids=[row[0] for row in TABLE])
def test_resolve_config(case, options, resumed, init, records, world, want):
    cfg = resolve_config(_cfg(**options), set(options), resumed, init, records, world)
    assert {name: getattr(cfg, name) for name in want} == want


REFUSED = [
    ("a batch given that no epoch fills", dict(batch_size=512), None, None, 300, 1, "larger than the 300"),
    ("--init of another preset", dict(init="solved", model="lite"), None, INIT, None, 1, "give --model tiny"),
    ("--init with heads it cannot start", dict(init="solved", head="mlp"), None, INIT, None, 1, "cannot start"),
    ("--init with another D", dict(init="solved", embed_dim=8), None, INIT, None, 1, "has D=24"),
    ("--resume with an option that disagrees", dict(lr=0.5), _resumed(lr=0.01), None, None, 1, "--lr 0.5"),
    ("an unknown objective", dict(loss="nope"), None, None, None, 1, "unknown loss 'nope'"),
    ("an objective option it does not take", dict(loss="infonce", loss_options={"tau_plus": 0.1}), None, None,
     None, 1, "has no option tau_plus"),
]


@pytest.mark.parametrize("case, options, resumed, init, records, world, needle", REFUSED, ids=[r[0] for r in REFUSED])
def test_resolve_config_refuses(case, options, resumed, init, records, world, needle):
    with pytest.raises(UserError, match=needle):
        resolve_config(_cfg(**options), set(options), resumed, init, records, world)


def test_the_default_objective_is_the_demos_first_step():
    assert TrainConfig(train_data="", out="").loss == MRL_STEP["loss"]


@pytest.mark.parametrize("name", available_losses())
def test_build_loss_is_what_train_trains(name):
    """The objective of ``train --loss name`` (options settled, then built as train() builds it) is build_loss(name)."""
    cfg = resolve_config(_cfg(loss=name), {"loss"})
    trained, plain = build_loss(cfg.loss, **cfg.loss_options), build_loss(name)
    assert type(trained) is type(plain) and repr(trained) == repr(plain)
    torch.manual_seed(0)
    image, text = torch.nn.functional.normalize(torch.randn(2, 8, 16), dim=-1)  # (B, D) each
    w = torch.linspace(1.0, 0.1, 16)
    args = (image, text, torch.tensor(10.0), w)
    assert {k: float(v.detach()) for k, v in trained(*args).items()} == {k: float(v.detach()) for k, v in plain(*args).items()}


@pytest.mark.parametrize("name", ["tricl", "tricl_spectral"])
def test_train_builds_the_objective_build_loss_builds(name, shapes_data, tmp_path, monkeypatch):
    import triclip.training.train as train_mod

    built = []
    monkeypatch.setattr(train_mod, "build_loss", lambda *a, **kw: built.append(build_loss(*a, **kw)) or built[-1])
    train_mod.train(TrainConfig(train_data=str(shapes_data / "train.jsonl"), out=str(tmp_path / "run"), loss=name,
                                embed_dim=16, max_steps=1))
    assert repr(built[-1]) == repr(build_loss(name))
