"""Another model's weights (``--init``, a run's weights file) name the first tensor that differs and both
models (the message used to end at "Error(s) in loading state_dict for DualEncoder:")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import triclip.training.train as train_mod
from triclip.app.cli import main
from triclip.core.errors import UserError
from triclip.model.model import ModelConfig, build_model
from triclip.model.run import load_run, state_mismatch
from triclip.training import checkpoint as ckpt


def _run(out: Path, dim: int, head: str = "linear") -> Path:
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", embed_dim=dim, head=head)
    out.mkdir(parents=True)
    ckpt.save_weights(build_model(cfg), out / ckpt.MODEL)
    ckpt.write_config(out, {"model": cfg.to_dict(), "loss": "infonce"})
    return out


def test_state_mismatch_names_the_first_missing_unexpected_or_reshaped_tensor():
    own = {"a": torch.zeros(2), "b": torch.zeros(3)}
    assert state_mismatch(own, dict(own)) is None
    assert state_mismatch(own, {"a": torch.zeros(2)}).startswith("missing tensor b (1 missing")
    assert state_mismatch(own, {**own, "c": torch.zeros(1)}).startswith("unexpected tensor c")
    assert state_mismatch(own, {**own, "b": torch.zeros(4)}).startswith("tensor b is (4,) in the weights, (3,) in the model")
    assert state_mismatch(own, {"b": torch.zeros(3)}, left_out=("a",)) is None  # a tower a run rebuilds


def test_init_from_another_model_names_the_tensor_and_both_models(tmp_path):
    other = _run(tmp_path / "other", dim=16, head="mlp")
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny", embed_dim=32, head="linear"))
    with pytest.raises(UserError) as caught:
        train_mod._load_init(model, str(other))
    text = str(caught.value)
    assert text.startswith("--init: cannot load") and "tensor image_head." in text
    assert "preset tiny, D=16, mlp heads" in text and "this run: preset tiny, D=32, linear heads" in text
    assert "Error(s) in loading" not in text


def test_a_run_holding_another_models_weights_file_says_which_tensor(shapes_data, tmp_path, capsys):
    run, other = _run(tmp_path / "run", dim=16), _run(tmp_path / "other", dim=32)
    shutil.copyfile(other / ckpt.MODEL, run / ckpt.MODEL)
    with pytest.raises(UserError, match=r"tensor \S+ is \(.*32.*\) in the weights.*preset tiny, D=16"):
        load_run(run)
    assert main(["eval", "--run", str(run), "--data", str(shapes_data / "val.jsonl"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tensor" in err and "Traceback" not in err
