"""Small runs: a locked run stores what trained plus a reference to its frozen towers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import triclip.training.train as train_mod
from triclip.core.errors import UserError
from triclip.model.model import ModelConfig, build_model
from triclip.model.run import TOWER_REFERENCE, load_run
from triclip.training import checkpoint as ckpt
from triclip.training.train import TrainConfig, train

TOWER_PREFIXES = ("image_tower.", "text_tower.")


def _cfg(shapes_data, out, **kw) -> TrainConfig:
    base = dict(
        train_data=str(shapes_data / "train.jsonl"), val_data=str(shapes_data / "val.jsonl"), out=str(out),
        model="tiny", embed_dim=16, epochs=3, batch_size=32, lock_image=True, lock_text=True, seed=3,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


@pytest.fixture
def saves(monkeypatch):
    """Every checkpoint written: (epoch of the state, the model's full state_dict then, optimizer kept)."""
    calls, real = [], ckpt.save_checkpoint

    def spy(run, model, extra, optimizer, state, keep_optimizer=True):
        calls.append((state["epoch"], {k: v.clone() for k, v in model.state_dict().items()}, keep_optimizer))
        return real(run, model, extra, optimizer, state, keep_optimizer=keep_optimizer)

    monkeypatch.setattr(ckpt, "save_checkpoint", spy)
    return calls


def _keys(path) -> set[str]:
    return set(load_file(str(path)))


def test_a_locked_run_holds_no_tower_weights_and_reloads_identically(shapes_data, tmp_path, saves):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, select_factor=0))
    for path in (run / "model.safetensors", run / "best" / "model.safetensors", run / "checkpoint" / "model.safetensors"):
        keys = _keys(path)
        assert keys and not any(k.startswith(TOWER_PREFIXES) for k in keys), path
        assert {"logit_scale_param", "theta", "image_head.weight", "text_head.weight"} <= keys
    with safe_open(str(run / "model.safetensors"), framework="pt") as f:
        reference = json.loads(f.metadata()[TOWER_REFERENCE])
    assert reference["seed"] == 3 and set(reference["towers"]) == {"image_tower", "text_tower"}
    assert all(len(t["sha256"]) == 64 and t["tensors"] > 0 for t in reference["towers"].values())

    final_state = saves[-1][1]  # the trained model as it was in memory at the end
    model, _ = load_run(run, which="last")
    loaded = model.state_dict()
    assert loaded.keys() == final_state.keys()
    for key, value in final_state.items():
        assert torch.equal(loaded[key], value), key
    images = torch.randn(4, 3, 64, 64)
    fresh = build_model(ModelConfig(**json.loads((run / "config.json").read_text())["model"]))
    fresh.load_state_dict(final_state)
    fresh.lock(image=True, text=True)  # as trained (a frozen attention layer takes torch's fast path)
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(model.encode_image(images), fresh.encode_image(images))
        assert torch.equal(model.encode_text(["a red circle", "two squares"]), fresh.encode_text(["a red circle", "two squares"]))


def test_a_locked_run_checkpoints_rarely_and_keeps_no_optimizer_when_finished(shapes_data, tmp_path, saves, monkeypatch):
    best_writes = []
    real_best = ckpt.save_best
    monkeypatch.setattr(ckpt, "save_best", lambda *a, **k: (best_writes.append(1), real_best(*a, **k)))
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, epochs=22))  # both towers locked: every 20 epochs and the last
    assert [(epoch, keep) for epoch, _, keep in saves] == [(20, True), (22, False)]
    assert len(best_writes) <= 2  # the best is written with checkpoints, not every time it improves
    assert not (run / "checkpoint" / "optim.safetensors").exists()
    assert json.loads((run / "checkpoint" / "state.json").read_text())["optimizer"] is None
    assert os.stat(run / "model.safetensors").st_ino == os.stat(run / "checkpoint" / "model.safetensors").st_ino  # one copy

    saves.clear()
    train(_cfg(shapes_data, tmp_path / "unlocked", epochs=2, lock_image=False, lock_text=False))
    assert [(epoch, keep) for epoch, _, keep in saves] == [(1, True), (2, False)]  # expensive epochs: each one
    assert any(k.startswith(TOWER_PREFIXES) for k in _keys(tmp_path / "unlocked" / "model.safetensors"))  # towers trained


def test_resuming_a_finished_run_restarts_the_optimizer_with_one_line(shapes_data, tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, epochs=1, val_data=None))
    capsys.readouterr()
    train(_cfg(shapes_data, run, epochs=2, val_data=None, resume=True))
    assert "kept no optimizer state" in capsys.readouterr().out
    assert json.loads((run / "checkpoint" / "state.json").read_text())["epoch"] == 2


def test_an_unfinished_run_keeps_its_optimizer_state_for_resume(shapes_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real_step, calls = train_mod._train_step, {"n": 0}

    def crash_in_epoch_3(*args, **kw):
        calls["n"] += 1
        if calls["n"] > 12:  # 6 steps an epoch
            raise KeyboardInterrupt
        return real_step(*args, **kw)

    monkeypatch.setattr(train_mod, "_train_step", crash_in_epoch_3)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(shapes_data, run, epochs=3, checkpoint_every=1, val_data=None))
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["epoch"] == 2 and state["optimizer"] is not None
    assert (run / "checkpoint" / "optim.safetensors").exists()
    monkeypatch.setattr(train_mod, "_train_step", real_step)
    train(_cfg(shapes_data, run, epochs=3, checkpoint_every=1, val_data=None, resume=True))
    assert not (run / "checkpoint" / "optim.safetensors").exists()


def test_towers_that_differ_from_the_reference_fail_with_one_line(shapes_data, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, epochs=1, val_data=None))
    path = run / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    reference = json.loads(meta[TOWER_REFERENCE])
    save_file(tensors, str(path), metadata={TOWER_REFERENCE: json.dumps({**reference, "seed": 4})})  # other random towers
    with pytest.raises(UserError) as err:
        load_run(run)
    message = str(err.value)
    assert "\n" not in message and "image tower built here differs from the one the run was trained with" in message


def test_an_old_run_with_every_weight_still_loads(shapes_data, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, epochs=1, val_data=None))
    new, _ = load_run(run)
    full = {k: v.contiguous() for k, v in new.state_dict().items()}
    save_file(full, str(run / "model.safetensors"))  # how runs were written before: everything, no reference
    old, _ = load_run(run)
    for key, value in full.items():
        assert torch.equal(old.state_dict()[key], value), key
    save_file({"weight": torch.zeros(2)}, str(run / "model.safetensors"))
    with pytest.raises(UserError, match="cannot load"):
        load_run(run)


def test_save_weights_for_other_writers(tmp_path):
    """The solver's interface: model + which tensors trained. An unseeded random tower is kept
    (it cannot be rebuilt); a marked one is left out and rebuilt from the seed."""
    torch.manual_seed(7)
    model = build_model(ModelConfig(preset="tiny", embed_dim=8))
    model.lock(image=True, text=True)
    ckpt.save_weights(model, tmp_path / "a.safetensors")
    assert any(k.startswith(TOWER_PREFIXES) for k in _keys(tmp_path / "a.safetensors"))  # not marked: all kept

    ckpt.mark_built(model, 7)
    ckpt.save_weights(model, tmp_path / "b.safetensors", trained={"image_head.weight", "text_head.weight"})
    assert not any(k.startswith(TOWER_PREFIXES) for k in _keys(tmp_path / "b.safetensors"))
    from triclip.model.run import build_seeded, load_weights

    again = build_seeded(ModelConfig(preset="tiny", embed_dim=8), 7)
    load_weights(again, tmp_path / "b.safetensors")
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
