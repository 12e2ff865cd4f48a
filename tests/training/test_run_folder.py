"""Run folders: resolved config, best epoch, restart after an early kill, skipped records, umask."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import triclip.training.train as train_mod
from triclip.core.errors import UserError
from triclip.core.io import atomic_path, current_umask, temp_dir, write_json_atomic
from triclip.model.run import best_info, load_run, read_metrics, run_fingerprint, weights_path
from triclip.training.train import TrainConfig, train


def _cfg(shapes_data, out, **kw) -> TrainConfig:
    base = dict(
        train_data=str(shapes_data / "train.jsonl"),
        val_data=str(shapes_data / "val.jsonl"),
        out=str(out),
        model="tiny",
        embed_dim=16,
        loss="tricl",
        epochs=1,
        batch_size=32,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_config_records_the_values_used(shapes_data, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, max_steps=2, val_data=None, embed_dim=None))
    config = json.loads((run / "config.json").read_text())
    t = config["train"]
    assert t["lr"] == 1e-3 and t["warmup_steps"] == 1 and t["head"] == "linear"  # tiny's defaults, resolved
    assert t["importance_spread"] == 100.0 and t["loss_options"] == {"nested": 4}
    assert t["embed_dim"] == config["model"]["embed_dim"] and isinstance(t["embed_dim"], int)
    assert t["device"] == "cpu" and os.path.isabs(t["train_data"])
    assert None not in (t["lr"], t["warmup_steps"], t["head"], t["importance_spread"], t["embed_dim"])
    assert config["sources"]["train"]["records"] > 0 and len(config["sources"]["train"]["fingerprint"]) > 8


def test_best_epoch_is_kept_and_loaded_by_default(shapes_data, tmp_path, monkeypatch):
    """Epoch 2 scores worse than epoch 1 (forced): best/ keeps epoch 1, load_run gives it."""
    run = tmp_path / "run"
    real_evaluate, calls = train_mod.evaluate, {"n": 0}

    def worse_later(*args, **kw):
        result = real_evaluate(*args, **kw)
        calls["n"] += 1
        result["t2i_r10"] = {1: 0.5, 2: 0.25, 3: 0.75}[calls["n"]]
        return result

    monkeypatch.setattr(train_mod, "evaluate", worse_later)
    train(_cfg(shapes_data, run, epochs=2))
    info = best_info(run)
    assert info["epoch"] == 1 and info["value"] == 0.5 and info["metric"] == "t2i_r10"
    assert weights_path(run) == run / "best" / "model.safetensors"
    assert run_fingerprint(run) != run_fingerprint(run, which="last")  # epoch 1 and epoch 2 weights
    best, _ = load_run(run)
    last, _ = load_run(run, which="last")
    assert not torch.equal(best.image_head.weight, last.image_head.weight)

    train(_cfg(shapes_data, run, epochs=3, resume=True))  # epoch 3 beats epoch 1
    assert best_info(run)["epoch"] == 3
    assert run_fingerprint(run) == run_fingerprint(run, which="last")  # the same bytes
    assert [r["epoch"] for r in read_metrics(run)] == [1, 2, 3]


def test_without_validation_there_is_no_best_and_the_last_weights_are_used(shapes_data, tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, val_data=None, max_steps=1))
    assert best_info(run) is None and weights_path(run) == run / "model.safetensors"
    assert "no best epoch" in capsys.readouterr().out
    with pytest.raises(UserError, match="--weights"):
        weights_path(run, "first")


def test_run_killed_before_its_first_checkpoint_can_be_started_again(shapes_data, tmp_path, monkeypatch):
    run = tmp_path / "run"

    def killed(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "_train_step", killed)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(shapes_data, run, max_steps=2))
    assert (run / "config.json").exists() and not (run / "checkpoint").exists()
    monkeypatch.undo()
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))

    train(_cfg(shapes_data, run, max_steps=2))  # again, without --resume: starts over
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 2

    other = tmp_path / "other"
    monkeypatch.setattr(train_mod, "_train_step", killed)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(shapes_data, other, max_steps=2, loss="infonce"))
    monkeypatch.undo()
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    train(_cfg(shapes_data, other, resume=True, loss="tricl", embed_dim=None), given={"resume", "out", "train_data"})
    assert json.loads((other / "config.json").read_text())["loss"] == "infonce"  # --resume: the run's own settings


def test_resume_refuses_a_changed_option_and_keeps_the_run(shapes_data, tmp_path):
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, max_steps=1, val_data=None))
    before = (run / "config.json").read_bytes()
    with pytest.raises(UserError, match=r"--loss-options .*differ from"):
        train(_cfg(shapes_data, run, max_steps=1, val_data=None, resume=True, loss_options={"tau_plus": 0.1}))
    with pytest.raises(UserError, match=r"--embed-dim 8 \(the run's: 16\)"):
        train(_cfg(shapes_data, run, max_steps=1, val_data=None, resume=True, embed_dim=8))
    with pytest.raises(UserError, match=r"--head 'mlp'"):
        train(_cfg(shapes_data, run, max_steps=1, val_data=None, resume=True, head="mlp"))
    assert (run / "config.json").read_bytes() == before


def test_skipped_records_are_counted_by_reason_and_written_to_the_run(shapes_data, tmp_path, capsys):
    """Good records plus one missing, one truncated and one caption-less record."""
    rows = [json.loads(line) for line in (shapes_data / "train.jsonl").read_text().splitlines()]
    images = shapes_data
    good = [{**r, "image": str(images / r["image"])} for r in rows[:64]]
    cut = (images / rows[0]["image"]).read_bytes()
    (tmp_path / "cut.png").write_bytes(cut[: len(cut) // 2])
    bad = [
        {"image": str(tmp_path / "missing.png"), "captions": ["a missing image"]},
        {"image": str(tmp_path / "cut.png"), "captions": ["a truncated image"]},
        {"image": str(images / rows[1]["image"]), "captions": [""]},
    ]
    manifest = tmp_path / "mixed.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, train_data=str(manifest), lock_image=True, lock_text=True, max_steps=2))
    skipped = json.loads((run / "skipped.json").read_text())
    assert skipped["train"] == {"corrupt_image": 1, "empty_caption": 1, "missing_file": 1}
    assert skipped["val"] == {}
    out = capsys.readouterr().out
    assert "train: corrupt_image 1, empty_caption 1, missing_file 1" in out and str(run) in out


def test_files_and_folders_follow_the_umask(shapes_data, tmp_path):
    old = os.umask(0o022)
    try:
        assert current_umask() == 0o022
        with atomic_path(tmp_path / "f.bin") as tmp:
            tmp.write_bytes(b"x")
        write_json_atomic(tmp_path / "g.json", {})
        folder = temp_dir(tmp_path, ".t-")
        assert stat.S_IMODE((tmp_path / "f.bin").stat().st_mode) == 0o644
        assert stat.S_IMODE((tmp_path / "g.json").stat().st_mode) == 0o644
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755

        run = tmp_path / "run"
        train(_cfg(shapes_data, run, max_steps=1))
        for path in [run, *run.rglob("*")]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
    finally:
        os.umask(old)


def _with_truncated(shapes_data, tmp_path, good: int, bad: int):
    rows = [json.loads(line) for line in (shapes_data / "train.jsonl").read_text().splitlines()]
    out = [{**r, "image": str(shapes_data / r["image"])} for r in rows[:good]]
    for i, r in enumerate(rows[good : good + bad]):
        data = (shapes_data / r["image"]).read_bytes()
        (tmp_path / f"cut{i}.png").write_bytes(data[: len(data) // 2])
        out.append({"image": str(tmp_path / f"cut{i}.png"), "captions": r["captions"]})
    manifest = tmp_path / "mixed.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in out))
    return manifest


def test_training_towers_count_every_bad_image_after_one_epoch(shapes_data, tmp_path):
    """20 of 84 records are truncated; an epoch of 2 batches of 32 leaves 20 records out, yet all are counted."""
    manifest = _with_truncated(shapes_data, tmp_path, good=64, bad=20)
    run = tmp_path / "run"
    train(_cfg(shapes_data, run, train_data=str(manifest), val_data=None))
    assert json.loads((run / "skipped.json").read_text())["train"] == {"corrupt_image": 20}
    train(_cfg(shapes_data, run, train_data=str(manifest), val_data=None, resume=True))  # nothing left to do
    assert json.loads((run / "skipped.json").read_text())["train"] == {"corrupt_image": 20}  # the count stays


def test_eval_reports_every_skipped_record_by_reason(shapes_data, tmp_path):
    from triclip.training.config import EvalConfig
    from triclip.training.evaluate import evaluate_run

    run = tmp_path / "run"
    train(_cfg(shapes_data, run, val_data=None, max_steps=1))
    manifest = _with_truncated(shapes_data, tmp_path, good=30, bad=4)
    with manifest.open("a") as f:
        f.write(json.dumps({"image": str(tmp_path / "missing.png"), "captions": ["gone"]}) + "\n")
    result = evaluate_run(EvalConfig(run=str(run), data=str(manifest), dims=[4]))
    assert result["skipped"] == {"corrupt_image": 4, "missing_file": 1}
    assert set(result["compact"]["importance"]) == {4}
