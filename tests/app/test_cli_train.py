"""``triclip train`` / ``triclip eval`` through the command line: outputs, JSON, user errors."""

import json

import pytest

from app.cli import main
from retrieval.data.builtin import prepare


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
    chance = 10 / 40  # 40 validation images
    assert result["t2i_r10"] > chance  # it learned something in two short epochs


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--run", "/no/such/run", "--data", "x.jsonl", "--json"], "not a triclip run"),
        (["train", "--train-data", "/no/such.jsonl", "--out", "/tmp/x"], "no such data source"),
        (["train", "--train-data", "x", "--out", "y", "--epochs", "zero"], "invalid int value"),
        (["eval", "--run", "r", "--data", "d", "--dims", "4,a"], "--dims"),
        (["train", "--train-data", "x", "--out", "y", "--text-max-length", "1"], "--text-max-length must be >= 2"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
