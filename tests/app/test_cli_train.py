"""``triclip train`` / ``triclip eval`` through the command line: outputs, JSON, resume, user errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from triclip.app.cli import build_parser, main
from triclip.data.builtin import prepare


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """prepare shapes -> train tiny tricl for 2 epochs through the CLI."""
    root = tmp_path_factory.mktemp("cli")
    prepare("shapes", str(root / "data"), num=400, seed=1)
    rc = main(
        [
            "train",
            "--train-data", str(root / "data" / "train.jsonl"),
            "--val-data", str(root / "data" / "val.jsonl"),
            "--out", str(root / "run"),
            "--model", "tiny",
            "--loss", "tricl",
            "--loss-opt", "dec_weight=0.5",
            "--epochs", "2",
            "--batch-size", "32",
            "--select-factor", "0",  # always keep the best epoch: the tests below read RUN/best
        ]
    )  # fmt: skip
    assert rc == 0
    return root


def test_train_writes_the_run_files(trained):
    run = trained / "run"
    assert (run / "model.safetensors").is_file() and (run / "config.json").is_file()
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in evals] == [1, 2]
    config = json.loads((run / "config.json").read_text())
    assert config["loss"] == "tricl" and config["loss_options"] == {"nested": 4, "dec_weight": 0.5}
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["value"] == max(e["t2i_r10"] for e in evals) and best["epoch"] in (1, 2)
    assert json.loads((run / "skipped.json").read_text()) == {"train": {}, "val": {}}


def test_eval_json_has_the_spec_keys_and_the_compact_curve(trained, capsys):
    capsys.readouterr()
    rc = main(["eval", "--run", str(trained / "run"), "--data", str(trained / "data" / "val.jsonl"), "--dims", "4,8,16", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "align", "uniform"):
        assert isinstance(result[key], float)
    assert 0 <= result["t2i_r1"] <= result["t2i_r5"] <= result["t2i_r10"] <= 1
    assert set(result["compact"]) == {"importance", "first", "random", "pca"}
    for curve in result["compact"].values():
        assert set(curve) == {"4", "8", "16"}
    assert result["skipped"] == {}
    chance = 10 / 40  # 40 validation images
    assert result["t2i_r10"] > chance  # it learned something in two short epochs


def test_eval_uses_the_best_epoch_unless_told_last(trained, capsys):
    run, val = str(trained / "run"), str(trained / "data" / "val.jsonl")
    evals = [json.loads(line) for line in (trained / "run" / "metrics.jsonl").read_text().splitlines()]
    best = json.loads((trained / "run" / "best" / "best.json").read_text())
    scores = {}
    for which in ("best", "last"):
        capsys.readouterr()
        assert main(["eval", "--run", run, "--data", val, "--weights", which, "--json"]) == 0
        scores[which] = json.loads(capsys.readouterr().out)["t2i_r10"]
    assert scores["best"] == pytest.approx(best["value"], abs=1e-9)
    assert scores["last"] == pytest.approx(evals[-1]["t2i_r10"], abs=1e-9)


def test_every_field_of_the_configs_is_an_option():
    from dataclasses import fields

    from triclip.training.config import EvalConfig, TrainConfig

    def dests(command):
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
        return {a.dest for a in sub._actions}

    from_init = {"post_affine"}  # taken from --init's run (solve --run's affine maps), never typed
    train_fields = {f.name for f in fields(TrainConfig) if f.name not in {"data", *from_init}} | {"image_key", "sep", "max_pixels"}
    assert train_fields <= dests("train") and not from_init & dests("train")
    assert {"eval_batch_size", "log_every", "workers", "seed", "weight_decay", "warmup_steps"} <= dests("train")
    assert {f.name for f in fields(EvalConfig) if f.name != "data_config"} <= dests("eval")


def test_help_shows_defaults_and_the_objectives(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--wd" in text and "--warmup" in text and "--loss-opt" in text and "--unlock-image" in text
    assert "pairs per step, per rank (default: the preset's: tiny/open_clip names 64; lite/lite1/lite2 256)" in text
    assert "lite 40 256 0.001 mlp True True 0.1 5" in text  # the recipe table
    assert "--patience" in text and "standard errors" in text and "lite/lite1/lite2 5" in text  # the stop rule
    for name in ("infonce", "debiased", "tricl", "triplet"):
        assert name in text


# ---------------------------------------------------------------------------- resume


def _copy_run(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    return run


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _resume_argv(trained: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--train-data", str(trained / "data" / "train.jsonl"), "--out", str(run), "--resume", *extra]


def test_overwrite_names_the_out_folder_not_the_one_it_was_written_in(trained, tmp_path, capsys):
    """--overwrite trains beside --out (.run.new-*) and swaps it in at the end: the summary names --out."""
    run = _copy_run(trained, tmp_path)
    capsys.readouterr()
    argv = ["train", "--train-data", str(trained / "data" / "train.jsonl"), "--val-data", str(trained / "data" / "val.jsonl"),
            "--out", str(run), "--epochs", "1", "--max-steps", "2", "--overwrite"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"the run is in {run}." in out and f"Eval and index use {run / 'best'}" in out
    assert ".new-" not in out and (run / "best").is_dir()


def test_resume_takes_the_runs_settings_and_may_grow_it(trained, tmp_path, capsys):
    """Only the data, --out and --resume given: loss, options, D, batch, val data come from config.json."""
    run = _copy_run(trained, tmp_path)
    before = json.loads((run / "config.json").read_text())
    capsys.readouterr()
    assert main(_resume_argv(trained, run, "--epochs", "3", "--max-steps", "25")) == 0
    after = json.loads((run / "config.json").read_text())
    assert after["loss_options"] == before["loss_options"] == {"nested": 4, "dec_weight": 0.5}
    assert after["model"] == before["model"]
    assert after["train"]["epochs"] == 3 and after["train"]["batch_size"] == 32
    assert after["train"]["warmup_steps"] == before["train"]["warmup_steps"]  # resolved once, kept
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in evals] == [1, 2, 3] and evals[-1]["step"] == 25
    out = capsys.readouterr().out
    assert f"the run is in {run}" in out and "Best epoch" in out and "Skipped records: none" in out


def test_resume_without_train_data_takes_the_runs_own(trained, tmp_path, capsys):
    """``train --resume --out RUN`` alone; without --resume, --train-data is still needed."""
    run = _copy_run(trained, tmp_path)
    assert main(["train", "--out", str(run), "--resume", "--epochs", "3", "--max-steps", "25"]) == 0
    after = json.loads((run / "config.json").read_text())
    assert after["train"]["train_data"] == str(trained / "data" / "train.jsonl") and after["train"]["epochs"] == 3
    assert [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert "needs --train-data" in err and err.count("\n") == 1
    assert main(["train", "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "is not a run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--loss-opt", "dec_weight=1"], "--loss-options"),
        (["--loss-opt", "nested=0"], "--loss-options"),
        (["--loss", "infonce"], "--loss"),
        (["--embed-dim", "16"], "--embed-dim"),
        (["--head", "mlp"], "--head"),
        (["--importance", "softplus"], "--importance"),
        (["--importance-spread", "10"], "--importance-spread"),
        (["--lr", "0.01"], "--lr"),
        (["--batch-size", "16"], "--batch-size"),
        (["--val-data", "other.jsonl"], "--val-data"),
        (["--sep", ";"], "--sep"),
    ],
)
def test_resume_refuses_any_conflicting_option(trained, tmp_path, capsys, extra, flag):
    run = _copy_run(trained, tmp_path)
    (tmp_path / "other.jsonl").write_text((trained / "data" / "val.jsonl").read_text())
    extra = [str(tmp_path / "other.jsonl") if x == "other.jsonl" else x for x in extra]
    before = _snapshot(run)
    capsys.readouterr()
    assert main(_resume_argv(trained, run, *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert flag in err and "differ from" in err
    assert _snapshot(run) == before  # nothing lost


def test_resume_accepts_options_that_repeat_the_runs_values(trained, tmp_path):
    run = _copy_run(trained, tmp_path)
    argv = _resume_argv(trained, run, "--loss", "tricl", "--loss-opt", "dec_weight=0.5", "--lr", "0.001", "--batch-size", "32")
    assert main(argv) == 0  # lr 1e-3 is what tiny resolved to; nested=4 the trainer's default


def test_resume_refuses_changed_training_data(trained, tmp_path, capsys):
    run = _copy_run(trained, tmp_path)
    data = tmp_path / "data"
    shutil.copytree(trained / "data", data)
    lines = (data / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # one record fewer
    argv = ["train", "--train-data", str(data / "train.jsonl"), "--out", str(run), "--resume"]
    assert main(argv) == 2  # another path: refused as an option
    argv_same_path = _resume_argv(trained, run)
    shutil.copy(data / "train.jsonl", tmp_path / "backup.jsonl")
    original = (trained / "data" / "train.jsonl").read_text()
    try:
        (trained / "data" / "train.jsonl").write_text((data / "train.jsonl").read_text())
        capsys.readouterr()
        assert main(argv_same_path) == 2  # same path, other contents: refused by fingerprint
        assert "changed since the run started" in capsys.readouterr().err
    finally:
        (trained / "data" / "train.jsonl").write_text(original)


# ---------------------------------------------------------------------------- all-bad data


def _truncated_manifest(trained: Path, folder: Path, n: int = 12) -> Path:
    """n records whose PNGs are cut in half: headers read, bodies do not decode."""
    folder.mkdir()
    rows = [json.loads(line) for line in (trained / "data" / "train.jsonl").read_text().splitlines()[:n]]
    out = []
    for i, row in enumerate(rows):
        data = (trained / "data" / row["image"]).read_bytes()
        (folder / f"{i}.png").write_bytes(data[: len(data) // 2])
        out.append(json.dumps({"image": f"{i}.png", "captions": row["captions"]}))
    (folder / "train.jsonl").write_text("\n".join(out) + "\n")
    return folder / "train.jsonl"


@pytest.mark.parametrize("lock", [[], ["--lock-image", "--lock-text"]], ids=["towers-train", "towers-locked"])
def test_train_on_only_truncated_images_exits_2(trained, tmp_path, capsys, monkeypatch, lock):
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    manifest = _truncated_manifest(trained, tmp_path / "bad")
    capsys.readouterr()
    rc = main(["train", "--train-data", str(manifest), "--out", str(tmp_path / "run"), "--batch-size", "4", "--embed-dim", "16", *lock])
    assert rc == 2
    err = capsys.readouterr().err
    message = [line for line in err.split("\n") if line.startswith("triclip: ")]  # progress bars aside
    assert len(message) == 1 and err.endswith(message[0] + "\n") and "Traceback" not in err
    assert "corrupt_image 12" in message[0] or "'corrupt_image': 12" in message[0]  # every record, by reason
    assert not (tmp_path / "run" / "model.safetensors").exists()  # no untrained model left as a result


# ---------------------------------------------------------------------------- one-line errors


def _train(trained: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["train", "--train-data", str(trained / "data" / "train.jsonl"), "--out", str(tmp_path / "new"), *extra]


def _damaged(name: str, content: bytes | None = None, truncate: bool = False):
    """Copy the trained run and damage one of its files; return the copy."""

    def make(trained: Path, tmp_path: Path) -> Path:
        run = _copy_run(trained, tmp_path)
        path = run / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2] if truncate else content)
        return run

    return make


def _unfinished_with_truncated_optimizer(trained: Path, tmp_path: Path) -> Path:
    """A finished run keeps no optimizer state: make the copy look unfinished, with a damaged one."""
    run = _copy_run(trained, tmp_path)
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["optimizer"] is None and not (run / "checkpoint" / "optim.safetensors").exists()
    state.update(epoch=1, optimizer={"param_groups": [], "scalars": {}})
    (run / "checkpoint" / "state.json").write_text(json.dumps(state))
    (run / "checkpoint" / "optim.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:100])
    return run


def _foreign_weights(trained: Path, tmp_path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    run = _copy_run(trained, tmp_path)
    save_file({"weight": torch.zeros(3, 3)}, str(run / "best" / "model.safetensors"))
    return run


def _eval(run_factory, *extra):
    def argv(trained, tmp_path):
        run = run_factory(trained, tmp_path) if run_factory else trained / "run"
        return ["eval", "--run", str(run), "--data", str(trained / "data" / "val.jsonl"), *extra], run

    return argv


def _resume(run_factory, *extra):
    def argv(trained, tmp_path):
        run = run_factory(trained, tmp_path)
        return _resume_argv(trained, run, "--epochs", "3", *extra), run

    return argv


def _new(*extra, out=None):
    def argv(trained, tmp_path):
        args = _train(trained, tmp_path, *extra)
        if out is not None:
            args[args.index("--out") + 1] = out(tmp_path)
        return args, None

    return argv


def _a_file(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("not a folder")
    return str(tmp_path / "file")


ERRORS = {
    "lr-nan": (_new("--lr", "nan"), "--lr"),
    "lr-negative": (_new("--lr", "-1"), "--lr must be > 0"),
    "embed-dim-negative": (_new("--embed-dim", "-4"), "--embed-dim must be >= 1"),
    "embed-dim-zero": (_new("--embed-dim", "0"), "--embed-dim must be >= 1"),
    "device-foo": (_new("--device", "foo"), "--device 'foo'"),
    "workers-negative": (_new("--workers", "-1"), "--workers must be >= 0"),
    "out-a-file": (_new(out=_a_file), "is a file"),
    "out-under-a-file": (_new(out=lambda t: _a_file(t) + "/run"), "is a file"),
    "out-unwritable": (_new(out=lambda t: "/proc/triclip-test/run"), "cannot write"),
    "max-steps-negative": (_new("--max-steps", "-3"), "--max-steps must be >= 1"),
    "save-every-negative": (_new("--save-every", "-1"), "--save-every must be >= 0"),
    "patience-negative": (_new("--patience", "-1"), "--patience must be >= 0"),
    "warmup-negative": (_new("--warmup", "-1"), "--warmup must be >= 0"),
    "wd-negative": (_new("--wd", "-0.1"), "--wd must be >= 0"),
    "grad-clip-nan": (_new("--grad-clip", "nan"), "--grad-clip"),
    "batch-size-one": (_new("--batch-size", "1"), "--batch-size must be >= 2"),
    "loss-unknown": (_new("--loss", "nope"), "invalid choice"),
    "loss-opt-without-value": (_new("--loss-opt", "tau"), "K=V"),
    "eval-dims-larger-than-D": (_eval(None, "--dims", "4,4096"), "larger than the run's embedding dimension"),
    "eval-dims-zero": (_eval(None, "--dims", "0,4"), "--dims must be >= 1"),
    "eval-weights-unknown": (_eval(None, "--weights", "first"), "invalid choice"),
    "eval-truncated-best-model": (_eval(_damaged("best/model.safetensors", truncate=True)), "cannot load"),
    "eval-truncated-last-model": (_eval(_damaged("model.safetensors", truncate=True), "--weights", "last"), "cannot load"),
    "eval-foreign-model": (_eval(_foreign_weights), "cannot load"),
    "eval-damaged-config": (_eval(_damaged("config.json", b'{"model": {"preset": ')), "cannot read"),
    "eval-config-wrong-types": (_eval(_damaged("config.json", b'{"model": {"embed_dim": "x", "bogus": 1}}')), "bad model section"),
    "eval-damaged-best-json": (_eval(_damaged("best/best.json", b"[1, 2")), None),  # weights are fine: eval works
    "resume-damaged-config": (_resume(_damaged("config.json", b"\x00\xff garbage")), "cannot read"),
    "resume-config-without-train": (_resume(_damaged("config.json", b'{"model": {}, "loss": "tricl"}')), "no train section"),
    "resume-damaged-state": (_resume(_damaged("checkpoint/state.json", b'{"step": 3')), "state.json is damaged"),
    "resume-state-missing-keys": (_resume(_damaged("checkpoint/state.json", b'{"optimizer": {}}')), "state.json is damaged"),
    "resume-truncated-checkpoint-weights": (_resume(_damaged("checkpoint/model.safetensors", truncate=True)), "cannot load"),
    "resume-truncated-optimizer": (_resume(_unfinished_with_truncated_optimizer), "cannot load"),
    "resume-damaged-metrics": (_resume(_damaged("metrics.jsonl", b'{"epoch": 1}\n{"epoch": 2, "t2i\n')), "metrics.jsonl is damaged"),
}


@pytest.mark.parametrize("case", list(ERRORS), ids=list(ERRORS))
def test_user_errors_are_one_line_exit_2_and_lose_nothing(trained, tmp_path, capsys, case):
    make_argv, message = ERRORS[case]
    argv, run = make_argv(trained, tmp_path)
    before = _snapshot(run) if run is not None else None
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    if message is None:
        assert rc == 0
        return
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("triclip: error: ") and "Traceback" not in err
    assert message in err, err
    if run is not None:
        assert _snapshot(run) == before  # the damaged run is left exactly as it was
    assert not (tmp_path / "new" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--run", "/no/such/run", "--data", "x.jsonl", "--json"], "not a triclip run"),
        (["train", "--train-data", "/no/such.jsonl", "--out", "x"], "data source not found"),
        (["train", "--train-data", "x", "--out", "y", "--epochs", "zero"], "invalid int value"),
        (["eval", "--run", "r", "--data", "d", "--dims", "4,a"], "--dims"),
        (["train", "--train-data", "x", "--out", "y", "--text-max-length", "1"], "--text-max-length must be >= 2"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths land here (not in a folder other test runs share)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # a refused command writes nothing (no --out folder, no lock)


# ---------------------------------------------------------------------------- the full check


@pytest.mark.slow
def test_train_lite_with_no_other_flag_is_a_small_locked_cached_run(tmp_path, capsys, monkeypatch):
    """``train --model lite --train-data T --val-data V --out R``: the lite recipe (locked, cached towers,
    MLP heads, lr 1e-3, 40 epochs; the batch shrinks to the small set), R under 20 MB, no tower weights."""
    import torch
    from safetensors.torch import load_file

    from triclip.model.run import load_run
    from triclip.model.model import ModelConfig, build_model

    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    prepare("shapes", str(tmp_path / "data"), num=500, seed=2)
    run = tmp_path / "run"
    argv = ["train", "--model", "lite", "--train-data", str(tmp_path / "data" / "train.jsonl"),
            "--val-data", str(tmp_path / "data" / "val.jsonl"), "--out", str(run)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    used = json.loads((run / "config.json").read_text())["train"]
    assert (used["epochs"], used["lr"], used["head"], used["lock_image"], used["lock_text"]) == (40, 1e-3, "mlp", True, True)
    assert used["batch_size"] < 256 and "instead of the lite recipe's 256" in out
    size = sum(st.st_size for st in {p.stat().st_ino: p.stat() for p in run.rglob("*") if p.is_file()}.values())  # as du counts
    assert size < 20_000_000, size
    for path in run.rglob("*.safetensors"):
        assert not any(k.startswith(("image_tower.", "text_tower.")) for k in load_file(str(path))), path
    assert "Validation, epoch" in out and "ordering     m=16" in out
    model, config = load_run(run)
    full = build_model(ModelConfig(**config["model"]))
    full.load_state_dict(model.state_dict())  # every tensor, towers rebuilt from their packages
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), model.state_dict().values()))
