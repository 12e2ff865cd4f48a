"""Model selection: the best epoch is kept only when it beats the last beyond sampling noise."""

from __future__ import annotations

import json
import math

import pytest
import torch

import triclip.training.evaluate
import triclip.training.train as train_mod
from triclip.model.run import best_info, load_run, run_fingerprint, weights_path
from triclip.training.selection import early_stop, select, select_from_history
from triclip.training.train import TrainConfig, train


def test_a_gain_within_noise_keeps_the_last_weights():
    """The case that motivated it: 116 validation queries, the best epoch early, a small lead."""
    decision = select_from_history([0.50, 0.64, 0.61, 0.60], queries=116)
    stderr = math.sqrt(0.62 * 0.38 / 116)  # p: the mean of best and last
    assert decision.stderr == pytest.approx(stderr) and decision.threshold == pytest.approx(2 * stderr)
    assert (decision.best_epoch, decision.last_epoch) == (2, 4)
    assert decision.kept == "last" and decision.kept_epoch == 4
    assert "within noise, kept the last" in decision.reason() and "116 distinct validation queries" in decision.reason()
    assert "standard errors at the two epochs' mean recall" in decision.reason()  # why another pair has another one


def test_a_gain_well_above_noise_keeps_the_best_epoch():
    decision = select_from_history([0.50, 0.80, 0.65, 0.60], queries=116)
    assert decision.kept == "best" and decision.kept_epoch == 2
    assert decision.best_value - decision.last_value > decision.threshold
    assert "kept the best epoch" in decision.reason()


def test_the_same_gain_counts_on_a_larger_split():
    values = [0.50, 0.64, 0.61, 0.60]
    assert select_from_history(values, queries=116).kept == "last"
    assert select_from_history(values, queries=5000).kept == "best"  # se shrinks as 1/sqrt(n)


def test_factor_zero_is_plain_selection_and_the_threshold_is_its_boundary():
    assert select_from_history([0.5, 0.6, 0.59], queries=100, factor=0).kept == "best"
    p = 0.55
    threshold = 2 * math.sqrt(p * (1 - p) / 100)
    just_below = select((1, p + threshold / 2 - 1e-6), (2, p - threshold / 2 + 1e-6), queries=100)
    just_above = select((1, p + threshold / 2 + 1e-3), (2, p - threshold / 2 - 1e-3), queries=100)
    assert just_below.kept == "last" and just_above.kept == "best"


def test_when_the_last_is_the_best_it_is_kept_and_ties_pick_the_first():
    assert select_from_history([0.2, 0.3, 0.4], queries=50).kept_epoch == 3
    assert select_from_history([0.2, 0.4, 0.4], queries=50).best_epoch == 2
    assert select_from_history([1.0, 1.0], queries=1).stderr > 0  # never a zero threshold
    with pytest.raises(ValueError):
        select_from_history([], queries=10)


def _cfg(shapes_data, out, **kw) -> TrainConfig:
    base = dict(
        train_data=str(shapes_data / "train.jsonl"), val_data=str(shapes_data / "val.jsonl"), out=str(out),
        model="tiny", embed_dim=16, loss="infonce", epochs=3, batch_size=32,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _forced(monkeypatch, values):
    real, calls = triclip.training.evaluate.evaluate, {"n": 0}

    def forced(*args, **kw):
        result = real(*args, **kw)
        result["t2i_r10"] = values[calls["n"]]
        calls["n"] += 1
        return result

    monkeypatch.setattr(train_mod, "evaluate", forced)


def test_training_keeps_the_last_weights_when_the_best_is_within_noise(shapes_data, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _forced(monkeypatch, [0.40, 0.42, 0.41])  # a 0.01 lead on ~50 queries: noise
    train(_cfg(shapes_data, run))
    decision = json.loads((run / "selection.json").read_text())
    assert decision["kept"] == "last" and decision["best_epoch"] == 2 and decision["kept_epoch"] == 3
    assert decision["queries"] == json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["t2i_queries"] > 10
    assert (run / "best" / "model.safetensors").exists()  # held, not used
    assert weights_path(run) == run / "model.safetensors" and best_info(run) is None
    assert run_fingerprint(run) == run_fingerprint(run, which="last")
    kept, _ = load_run(run)
    last, _ = load_run(run, which="last")
    assert torch.equal(kept.image_head.weight, last.image_head.weight)
    out = capsys.readouterr().out
    assert "within noise, kept the last weights" in out
    assert f"Eval and index use {run / 'model.safetensors'} (the last weights; " in out
    assert "unless given --weights last" not in out
    assert "Validation, epoch 3 (kept):" in out and "ordering     m=" in out  # the demo's per-m table


def test_training_keeps_the_best_epoch_when_it_is_well_above_noise(shapes_data, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _forced(monkeypatch, [0.40, 0.90, 0.41])
    train(_cfg(shapes_data, run))
    assert json.loads((run / "selection.json").read_text())["kept"] == "best"
    assert best_info(run)["epoch"] == 2 and weights_path(run) == run / "best" / "model.safetensors"
    out = capsys.readouterr().out
    assert "Validation, epoch 2 (kept):" in out
    assert f"Eval and index use {run / 'best'} (unless given --weights last; " in out

    _forced(monkeypatch, [0.45, 0.44])  # resumed: epochs 4-5 lower, the held best still leads
    train(_cfg(shapes_data, run, epochs=5, resume=True))
    decision = json.loads((run / "selection.json").read_text())
    assert decision["kept"] == "best" and decision["best_epoch"] == 2 and decision["last_epoch"] == 5


# ---------------------------------------------------------------------------- early stopping (--patience)


def test_early_stop_waits_patience_epochs_after_the_last_gain_beyond_noise():
    """300 queries: se ~ 0.029 at p ~ 0.5, so a gain must exceed ~0.058 (select's rule) to count."""
    rising = [0.30, 0.40, 0.50, 0.52, 0.53, 0.52]  # epoch 3 beat epoch 2 beyond noise; 4-6 did not beat 3
    assert early_stop(rising, queries=300, patience=4, epochs=40) is None
    stop = early_stop(rising + [0.54], queries=300, patience=4, epochs=40)
    assert (stop.reference_epoch, stop.stopped_epoch, stop.best_since) == (3, 7, 0.54)
    assert stop.threshold == pytest.approx(select((7, 0.54), (3, 0.50), 300).threshold)
    assert "Stopped early after epoch 7 of 40" in stop.reason() and "--patience 4" in stop.reason()
    assert "standard errors at the mean recall of the two compared" in stop.reason()


def test_a_slow_steady_gain_moves_the_reference_and_patience_zero_never_stops():
    slow = [0.30 + 0.02 * i for i in range(12)]  # +0.02 an epoch: beyond noise every 3-4 epochs
    assert early_stop(slow, queries=300, patience=4, epochs=40) is None
    assert early_stop([0.5] * 30, queries=300, patience=0, epochs=40) is None
    assert early_stop([0.5] * 10, queries=300, patience=9, epochs=10) is None  # the last epoch: nothing to stop


def test_training_stops_early_says_why_and_selection_json_records_the_rule(shapes_data, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _forced(monkeypatch, [0.40, 0.41, 0.40, 0.42, 0.90, 0.90])  # within noise for 3 epochs after epoch 1
    train(_cfg(shapes_data, run, epochs=6, patience=3))
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4  # epochs 5-6 never ran
    decision = json.loads((run / "selection.json").read_text())
    stopping = decision["early_stopping"]
    assert stopping["patience"] == 3 and stopping["stopped"] and stopping["stopped_epoch"] == 4
    assert stopping["reference_epoch"] == 1 and "standard errors" in stopping["rule"]
    assert decision["last_epoch"] == 4
    out = capsys.readouterr().out
    assert "Stopped early after epoch 4 of 6" in out and "did not beat it by more than" in out
    assert json.loads((run / "config.json").read_text())["train"]["patience"] == 3

    train(_cfg(shapes_data, run, epochs=6, patience=3, resume=True))  # a stopped run stays stopped
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    assert json.loads((run / "selection.json").read_text())["early_stopping"]["stopped_epoch"] == 4


def test_without_a_stop_selection_json_still_records_patience(shapes_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    _forced(monkeypatch, [0.40, 0.42, 0.41])
    train(_cfg(shapes_data, run, patience=5))
    stopping = json.loads((run / "selection.json").read_text())["early_stopping"]
    assert stopping["patience"] == 5 and stopping["stopped"] is False and "rule" in stopping
