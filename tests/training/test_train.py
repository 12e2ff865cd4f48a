"""Training runs end to end on tiny data: files, evaluations, resume, safety, locked caches."""

import json

import pytest
import torch
from safetensors.torch import load_file

import triclip.training.train as train_mod
from triclip.core.errors import UserError
from triclip.training import checkpoint as ckpt
from triclip.training.train import TrainConfig, train


def _cfg(shapes_data, out, **kw) -> TrainConfig:
    base = dict(
        train_data=str(shapes_data / "train.jsonl"),
        val_data=str(shapes_data / "val.jsonl"),
        out=str(out),
        model="tiny",
        embed_dim=32,
        loss="tricl",
        epochs=1,
        batch_size=32,
    )
    base.update(kw)
    return TrainConfig(**base)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_weights_config_and_one_evaluation_per_epoch(shapes_data, tmp_path):
    run = tmp_path / "run"
    last = train(_cfg(shapes_data, run, epochs=2))
    assert (run / "model.safetensors").exists() and (run / "config.json").exists()
    evals = _metrics(run)
    assert [e["epoch"] for e in evals] == [1, 2]
    for key in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "align", "uniform", "importance"):
        assert key in evals[-1]
    assert evals[-1]["t2i_r10"] == last["t2i_r10"]
    model, config = ckpt.load_run(run, which="last")
    assert config["loss"] == "tricl" and model.embed_dim == 32
    saved = load_file(str(run / "model.safetensors"))
    assert torch.equal(saved["theta"], model.theta.detach())
    assert config["model"]["importance"] == "softplus_mean1" and config["model"]["importance_spread"] == 100.0
    assert config["loss_options"] == {"nested": 4} == config["train"]["loss_options"]  # the trainer's default


def test_given_loss_options_override_the_trainers_default(shapes_data, tmp_path):
    cfg = _cfg(shapes_data, tmp_path / "run", max_steps=1, val_data=None, loss_options={"nested": 0, "dec_weight": 1})
    train(cfg)
    assert cfg.loss_options == {"nested": 0, "dec_weight": 1}  # the caller's config is not modified
    assert ckpt.read_config(tmp_path / "run")["loss_options"] == {"nested": 0, "dec_weight": 1}


def test_objectives_that_ignore_w_keep_it_at_one(shapes_data, tmp_path):
    train(_cfg(shapes_data, tmp_path / "run", loss="infonce", max_steps=2))
    model, config = ckpt.load_run(tmp_path / "run")
    assert config["loss_options"] == {}
    assert config["model"]["importance_spread"] == 1.0
    assert torch.equal(model.importance().detach(), torch.ones(32))  # the compact "importance" order is the identity


def test_resume_after_a_crash_equals_an_uninterrupted_run(shapes_data, tmp_path, monkeypatch):
    full = tmp_path / "full"
    train(_cfg(shapes_data, full, epochs=2, save_every=2))

    crashed = tmp_path / "crashed"
    real_step, calls = train_mod._train_step, {"n": 0}

    def crash_after_9(*args, **kw):
        if calls["n"] == 9:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real_step(*args, **kw)

    monkeypatch.setattr(train_mod, "_train_step", crash_after_9)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(shapes_data, crashed, epochs=2, save_every=2))
    monkeypatch.setattr(train_mod, "_train_step", real_step)
    state = json.loads((crashed / "checkpoint" / "state.json").read_text())
    assert state["step"] == 8  # last save_every checkpoint before the crash at step 9
    train(_cfg(shapes_data, crashed, epochs=2, save_every=2, resume=True))

    a, b = load_file(str(full / "model.safetensors")), load_file(str(crashed / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    assert [e["epoch"] for e in _metrics(crashed)] == [1, 2]


def test_resume_with_more_epochs_appends_evaluations(shapes_data, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, epochs=1))
    train(_cfg(shapes_data, run, epochs=2, resume=True))
    assert [e["epoch"] for e in _metrics(run)] == [1, 2]


def test_existing_run_is_not_overwritten_without_resume(shapes_data, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, max_steps=1))
    before = (run / "model.safetensors").read_bytes()
    with pytest.raises(UserError, match="already holds a run"):
        train(_cfg(shapes_data, run))
    assert (run / "model.safetensors").read_bytes() == before


def test_nan_loss_stops_without_writing_a_checkpoint(shapes_data, tmp_path, monkeypatch):
    run = tmp_path / "run"

    class NaNLoss(torch.nn.Module):
        def forward(self, image_features, text_features, logit_scale, importance=None):
            return {"contrastive_loss": (image_features * text_features).sum() * float("nan")}

    monkeypatch.setattr(train_mod, "build_loss", lambda name, **kw: NaNLoss())
    with pytest.raises(UserError, match="nan"):
        train(_cfg(shapes_data, run))
    assert not (run / "model.safetensors").exists()
    assert not (run / "checkpoint").exists()


def test_bad_settings_are_user_errors(shapes_data, tmp_path):
    with pytest.raises(UserError, match="batch-size"):
        train(_cfg(shapes_data, tmp_path / "a", batch_size=1))
    with pytest.raises(UserError, match="data source not found"):
        train(_cfg(shapes_data, tmp_path / "b", train_data=str(tmp_path / "missing.jsonl")))
    with pytest.raises(UserError, match="--loss"):
        train(_cfg(shapes_data, tmp_path / "c", loss="no-such-loss"))


def test_locked_towers_train_only_heads_and_reuse_the_cache(shapes_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, lock_image=True, lock_text=True, max_steps=3))
    cache_files = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "features").iterdir())
    assert cache_files == ["image", "image", "text", "text"]  # train and val, each tower
    model, _ = ckpt.load_run(run)
    from triclip.model.model import ModelConfig, build_model

    torch.manual_seed(0)  # the run's seed: same tower init
    fresh = build_model(ModelConfig(preset="tiny", embed_dim=32))
    for name, p in model.image_tower.state_dict().items():
        assert torch.equal(p, fresh.image_tower.state_dict()[name]), name
    assert not torch.equal(model.image_head.weight, fresh.image_head.weight)

    # a second run reads the cache instead of running the towers
    def no_tower(*args, **kw):
        raise AssertionError("locked tower ran although its outputs are cached")

    from triclip.model.model import DualEncoder

    monkeypatch.setattr(DualEncoder, "image_features", no_tower)
    monkeypatch.setattr(DualEncoder, "text_features", no_tower)
    train(_cfg(shapes_data, tmp_path / "run2", lock_image=True, lock_text=True, max_steps=3))


@pytest.mark.parametrize("model,head", [("lite", "mlp"), ("tiny", "linear")])
def test_default_heads_per_preset(shapes_data, tmp_path, model, head):
    """lite gets MLP heads by default (README ablation), every other preset linear ones."""
    lines = (shapes_data / "train.jsonl").read_text().splitlines()[:8]
    images = shapes_data / "images"
    small = tmp_path / "small.jsonl"  # 8 records, image paths made absolute
    small.write_text("".join(json.dumps({**json.loads(x), "image": str(images.parent / json.loads(x)["image"])}) + "\n" for x in lines))
    cfg = _cfg(shapes_data, tmp_path / "run", model=model, train_data=str(small), val_data=None, embed_dim=16,
               batch_size=4, max_steps=1, lock_image=True, lock_text=True)  # fmt: skip
    train(cfg)
    model_obj, config = ckpt.load_run(tmp_path / "run")
    assert config["model"]["head"] == head
    assert isinstance(model_obj.image_head, torch.nn.Linear) == (head == "linear")
