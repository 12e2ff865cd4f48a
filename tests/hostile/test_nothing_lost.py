"""The third hostile trial (issue 28, "Nothing lost"): what it found, as tests that failed before the fix.

One mechanism carries most of it (``retrieval.io.writing``): every writer claims its folder,
takes its lock, writes its mark first and "done" last, and builds a replacement beside the
old folder. The full matrix (every writer x kill -9 at three points x rerun, and a 5 MB disk)
is ``scripts/kill_matrix.py`` (slow).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


from tests.hostile.conftest import copy_tree, one_line_error
from tests.hostile.test_output_dirs import snapshot


# ---------------------------------------------------------------------------- item 2: a read never deletes


def test_a_read_never_deletes_a_complete_version(cli, tmp_path, built_index, shapes, tiny_run):
    from index.search import Searcher
    from index.store import _versions

    index = copy_tree(built_index, tmp_path / "index")
    status, _, err = cli("index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", index,
                         "--overwrite", "--dims", "8")  # fmt: skip
    assert status == 0, err
    assert _versions(index) == ["v000001", "v000002"]
    (index / "CURRENT").write_text("v000001\n")  # the user points back at the older complete version
    before = snapshot(index)
    searcher = Searcher.load(index)
    assert searcher.contents.version == "v000001"
    assert snapshot(index) == before  # v000002 is still there, untouched


# ---------------------------------------------------------------------------- item 1: the demo owns only its own folder


def readme_workdir(work: Path, shapes: Path, tiny_run: Path, built_index: Path) -> Path:
    """A folder laid out as the README's own-data recipe, plus the user's own files."""
    work.mkdir()
    copy_tree(shapes, work / "data")
    for name in ("mrl", "solved", "run"):
        copy_tree(tiny_run, work / name)
    copy_tree(built_index, work / "index")
    (work / "previous-run").mkdir()
    (work / "previous-run" / "precious.txt").write_text("years of work\n")
    (work / "eval.json").write_text('{"mine": true}\n')
    (work / "notes.txt").write_text("my notes\n")
    return work


def test_demo_refuses_a_folder_it_did_not_make(cli, tmp_path, shapes, tiny_run, built_index):
    work = readme_workdir(tmp_path / "w", shapes, tiny_run, built_index)
    before = snapshot(work)
    status, out, err = cli("demo", "--workdir", work, "--no-serve", "--num", 40, "--epochs", 1)
    line = one_line_error(status, err)
    assert "--workdir" in line and "refusing" in line
    assert "openclipart data in" not in out  # refused before its first step
    assert snapshot(work) == before  # nothing deleted, moved, retrained or overwritten


@pytest.mark.parametrize("text", ["not json {", "[1, 2]", '{"key": 1}'])
def test_a_damaged_eval_json_is_one_line(tmp_path, shapes, tiny_run, text):
    from app.demo import DemoConfig, _evaluate
    from retrieval.errors import UserError

    saved = tmp_path / "eval.json"
    saved.write_text(text)
    with pytest.raises(UserError) as err:
        _evaluate(DemoConfig(embed_dim=32, dims=[8]), shapes, tiny_run, saved)
    assert "\n" not in str(err.value) and str(saved) in str(err.value)
    assert saved.read_text() == text


# ---------------------------------------------------------------------------- items 3 and 4: killed, then run again

class Killed(BaseException):
    """A kill -9 at a chosen point, in this process (nothing after it runs; no handler catches it)."""


SOLVE = ["--model", "tiny", "--embed-dim", "8", "--ridge", "1"]


def _solve_args(shapes: Path, out: Path, *extra) -> list:
    return ["solve", "--train-data", shapes / "train.jsonl", "--val-data", shapes / "val.jsonl", "--out", out, *SOLVE,
            *extra]  # fmt: skip


def _solve_killed_before_config(cli, monkeypatch, args) -> None:
    """``triclip ARGS`` (a solve) killed after its weights, before its config.json (the last file it writes)."""
    import training.checkpoint as ckpt

    def killed(*_a, **_k):
        raise Killed("kill -9")

    monkeypatch.setattr(ckpt, "write_config", killed)
    with pytest.raises(Killed):
        from app.cli import main

        main([str(a) for a in args])
    monkeypatch.undo()


def test_a_killed_solve_runs_again(cli, tmp_path, shapes, monkeypatch):
    out = tmp_path / "solved"
    _solve_killed_before_config(cli, monkeypatch, _solve_args(shapes, out))
    assert (out / "model.safetensors").exists() and not (out / "config.json").exists()
    status, _, err = cli(*_solve_args(shapes, out))  # a rerun takes the folder as its own
    assert status == 0, err
    status, _, err = cli("eval", "--run", out, "--data", shapes / "val.jsonl")
    assert status == 0, err


def test_solve_overwrite_killed_keeps_the_old_run_whole(cli, tmp_path, shapes, monkeypatch):
    out = tmp_path / "solved"
    status, _, err = cli(*_solve_args(shapes, out))
    assert status == 0, err
    before = snapshot(out)
    _solve_killed_before_config(cli, monkeypatch, _solve_args(shapes, out, "--overwrite", "--embed-dim", "4"))
    after = snapshot(out)
    assert {k: v for k, v in after.items() if not k.startswith(".")} == {
        k: v for k, v in before.items() if not k.startswith(".")
    }  # the old config with the old weights, not the new weights
    status, _, err = cli("eval", "--run", out, "--data", shapes / "val.jsonl")
    assert status == 0, err
    status, _, err = cli(*_solve_args(shapes, out, "--overwrite", "--embed-dim", "4"))
    assert status == 0, err
    assert json.loads((out / "config.json").read_text())["model"]["embed_dim"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left beside it


def test_a_killed_data_prepare_runs_again(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "data"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "app", "data", "prepare", "shapes", "--out", str(out), "--num", "5000"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            images = out / "images"
            if images.is_dir() and len(os.listdir(images)) >= 20:
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "prepare finished before it could be killed"
    from retrieval.data.builtin import prepare

    for overwrite in (False, True):
        summary = prepare("shapes", out, num=30, overwrite=overwrite)  # no "files triclip did not write"
        assert summary["train"] + summary["val"] == 30
    assert len(os.listdir(out / "images")) == 30  # the killed run's images were replaced, not mixed in


# ---------------------------------------------------------------------------- item 8: one writer per folder


def _writers(shapes: Path, tiny_run: Path, out: Path) -> dict[str, list]:
    train = ["--train-data", shapes / "train.jsonl", "--model", "tiny", "--loss", "infonce", "--epochs", "1",
             "--batch-size", "16", "--max-steps", "1", "--embed-dim", "16"]  # fmt: skip
    return {
        "data prepare": ["data", "prepare", "shapes", "--out", out, "--num", 20],
        "data split": ["data", "split", shapes / "train.jsonl", "--out", out],
        "train": ["train", *train, "--out", out],
        "solve": _solve_args(shapes, out),
        "embed": ["embed", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", out],
        "demo": ["demo", "--workdir", out, "--no-serve", "--num", 40, "--epochs", 1],
    }


@pytest.mark.parametrize("command", ["data prepare", "data split", "train", "solve", "embed", "demo"])
def test_two_writers_of_one_folder_exclude_each_other(cli, tmp_path, shapes, tiny_run, command):
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another triclip process is writing it
    try:
        status, _, err = cli(*_writers(shapes, tiny_run, out)[command])
    finally:
        os.close(fd)
    assert "another triclip process is writing" in one_line_error(status, err)
    assert sorted(p.name for p in out.iterdir() if p.name != ".triclip.json") == [".lock"]
