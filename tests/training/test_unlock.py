"""Partly unlocked towers: the bottom runs once (cached), each epoch runs only the top."""

import json
import os

import pytest
import torch

import triclip.model.unlock as unlock
import triclip.training.train as training_train
from triclip.core.errors import UserError
from triclip.training.train import TrainConfig, train


class _Counter:
    """Counts forward calls of every module below the cuts and of the tops, however they are reached."""

    def __init__(self, monkeypatch):
        self.bottom_modules: set[int] = set()
        self.tops: set[int] = set()
        self.bottom_calls = 0  # calls of any module that belongs to a frozen bottom
        self.top_calls = 0  # calls of a top
        real = unlock.split_tower

        def counted(tower, n):
            bottom, top = real(tower, n)
            self.bottom_modules |= {id(m) for m in bottom.modules()}
            self.tops.add(id(top))
            return bottom, top

        monkeypatch.setattr(unlock, "split_tower", counted)
        self.after_eval: list[int] = []  # bottom_calls after each epoch's evaluation
        real_eval = training_train.eval_caches

        def marked(*args, **kwargs):
            out = real_eval(*args, **kwargs)
            self.after_eval.append(self.bottom_calls)
            return out

        monkeypatch.setattr(training_train, "eval_caches", marked)
        self.handle = torch.nn.modules.module.register_module_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if id(module) in self.tops:
            self.top_calls += 1
        elif id(module) in self.bottom_modules:
            self.bottom_calls += 1

    def close(self):
        self.handle.remove()


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(
        train_data=str(data / "train.jsonl"), val_data=str(data / "val.jsonl"), out=str(out), model="tiny",
        embed_dim=16, batch_size=32, epochs=1, unlock_image_groups=1, unlock_text_layers=1, lr=1e-3,
    )
    return TrainConfig(**{**base, **kw})


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_epochs_run_only_the_top(shapes_data, tmp_path, monkeypatch):
    counts = {}
    for epochs in (1, 3):
        monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / f"cache{epochs}"))  # each run fills its own cache
        counter = _Counter(monkeypatch)
        try:
            train(_cfg(shapes_data, tmp_path / f"run{epochs}", epochs=epochs, cached_views=2))
        finally:
            counter.close()
        counts[epochs] = (counter.bottom_calls, counter.top_calls)
        assert len(set(counter.after_eval)) == 1  # nothing below a cut ran after the first epoch
        assert len(_metrics(tmp_path / f"run{epochs}")) == epochs
    assert counts[1][0] > 0 and counts[3][0] == counts[1][0]  # the bottoms ran for the caches only
    assert counts[3][1] > counts[1][1]  # the tops ran every epoch
    files = sorted(p.name for p in (tmp_path / "cache3" / "features").iterdir())
    assert sum(name.startswith("image-bottom-") for name in files) == 2  # train (2 views) and val
    assert sum(name.startswith("text-bottom-") for name in files) == 2

    counter = _Counter(monkeypatch)  # a new run on the same caches runs no bottom at all
    try:
        train(_cfg(shapes_data, tmp_path / "again", epochs=1, cached_views=2))
    finally:
        counter.close()
    assert counter.bottom_calls == 0 and counter.top_calls > 0


def test_trained_weights_evaluate_the_same_without_the_split(shapes_data, tmp_path):
    """The per-epoch evaluation (top over the fp16 cached bottom) equals `triclip eval` (whole towers)."""
    from triclip.training.evaluate import evaluate_run
    from triclip.training.config import EvalConfig

    run = tmp_path / "run"
    last = train(_cfg(shapes_data, run, epochs=2, cached_views=3))
    again = evaluate_run(EvalConfig(run=str(run), data=str(shapes_data / "val.jsonl"), weights="last"))
    for key in ("t2i_r10", "i2t_r10", "t2i_r1"):
        assert abs(again[key] - last[key]) <= 0.03, key  # fp16 activations may flip a near tie
    config = json.loads((run / "config.json").read_text())["train"]
    assert config["unlock_image_groups"] == 1 and config["cached_views"] == 3


def test_resume_continues_the_same_views(shapes_data, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train(_cfg(shapes_data, straight, epochs=2, cached_views=2))
    real, calls = training_train.evaluate, []

    def killed_in_epoch_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies after epoch 2's steps, before its checkpoint
        return real(*args, **kwargs)

    resumed = tmp_path / "resumed"
    monkeypatch.setattr(training_train, "evaluate", killed_in_epoch_two)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(shapes_data, resumed, epochs=2, cached_views=2))
    monkeypatch.setattr(training_train, "evaluate", real)
    train(_cfg(shapes_data, resumed, epochs=2, cached_views=2, resume=True), given={"resume", "out"})
    a, b = _metrics(straight)[-1], _metrics(resumed)[-1]
    assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"]
    assert a["t2i_r10"] == pytest.approx(b["t2i_r10"], abs=1e-6) and a["align"] == pytest.approx(b["align"], abs=1e-5)


def test_cache_budget_is_one_line(shapes_data, tmp_path):
    with pytest.raises(UserError, match="over --cache-budget"):
        train(_cfg(shapes_data, tmp_path / "run", cache_budget=1e-6))
    with pytest.raises(UserError, match="--cached-views needs --unlock-image-groups"):
        train(_cfg(shapes_data, tmp_path / "run2", unlock_image_groups=0, cached_views=2))
    with pytest.raises(UserError, match="groups to unlock"):
        train(_cfg(shapes_data, tmp_path / "run3", unlock_image_groups=9))


def test_cli_flags_exist(capsys):
    from triclip.app.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--unlock-image-groups", "--unlock-text-layers", "--cached-views", "--cache-budget"):
        assert flag in text


OPENCLIPART = "/usr/share/openclipart"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(OPENCLIPART), reason="Debian openclipart-png/svg not installed")
def test_lite_unlocked_head_group_on_openclipart(tmp_path, monkeypatch):
    """The full check: lite, --unlock-image-groups 1 --lock-text, a few hundred openclipart records."""
    from triclip.data.builtin import prepare

    data = tmp_path / "data"
    prepare("openclipart", str(data), num=300)
    counter = _Counter(monkeypatch)
    try:
        last = train(
            TrainConfig(
                train_data=str(data / "train.jsonl"), val_data=str(data / "val.jsonl"), out=str(tmp_path / "run"),
                model="lite", lock_text=True, unlock_image_groups=1, epochs=2, batch_size=32,
            )
        )
        assert counter.bottom_calls > 0 and counter.top_calls > 0
        assert len(counter.after_eval) == 2 and counter.after_eval[1] == counter.after_eval[0]  # epoch 2: top only
    finally:
        counter.close()
    assert 0.0 <= last["t2i_r10"] <= 1.0 and "compact" in last
    epochs = _metrics(tmp_path / "run")
    assert len(epochs) == 2
    files = sorted(p.name for p in (tmp_path / "cache" / "features").iterdir())
    assert sum(name.startswith("image-bottom-") for name in files) == 2  # train and val, once each
