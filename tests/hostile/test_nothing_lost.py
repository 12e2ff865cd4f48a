"""Nothing a user has is lost: what hostile use found, as tests that failed before the fix.

One mechanism carries most of it (``triclip.core.io.writing``): every writer claims its folder,
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


# ---------------------------------------------------------------------------- a read never deletes


def test_a_read_never_deletes_a_complete_version(cli, tmp_path, built_index, shapes, tiny_run):
    from triclip.index.search import Searcher
    from triclip.index.store import _versions

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


# ---------------------------------------------------------------------------- the demo owns only its own folder


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
    from triclip.app.demo import DemoConfig, _evaluate
    from triclip.core.errors import UserError

    saved = tmp_path / "eval.json"
    saved.write_text(text)
    with pytest.raises(UserError) as err:
        _evaluate(DemoConfig(embed_dim=32, dims=[8]), shapes, tiny_run, saved)
    assert "\n" not in str(err.value) and str(saved) in str(err.value)
    assert saved.read_text() == text


def test_a_demo_killed_mid_solve_solves_again(tmp_path, shapes, tiny_run, monkeypatch):
    """Its rerun used to skip the solve because model.safetensors existed, then train --init refused: stuck."""
    import shutil

    import triclip.app.demo as demo

    work = tmp_path / "w"
    work.mkdir()
    (work / ".triclip.json").write_text('{"kind": "demo", "done": false}')  # a folder the demo made
    data = copy_tree(shapes, work / "data")
    shutil.copy(data / "val.jsonl", data / "test.jsonl")
    mrl = copy_tree(tiny_run, work / "mrl")
    (mrl / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')  # MRL trained, its 2 epochs
    solved = work / "solved"
    solved.mkdir()
    (solved / ".triclip.json").write_text('{"kind": "run", "done": false}')  # the solve's mark, written first
    shutil.copy(tiny_run / "model.safetensors", solved)  # killed after its weights, before config.json
    calls = []
    monkeypatch.setattr(demo, "_train", lambda cfg, data, out, **kw: calls.append(("train", out.name)))
    monkeypatch.setattr(demo, "_solve", lambda data, mrl, solved, overwrite=False: calls.append(("solve", overwrite)))
    monkeypatch.setattr(demo, "_evaluate", lambda *a: {})
    monkeypatch.setattr(demo, "_index", lambda *a, **k: calls.append(("index",)))
    demo.run_demo(demo.DemoConfig(workdir=str(work), serve=False, epochs=2))
    assert calls[:2] == [("solve", False), ("train", "run")]  # solved again (no --overwrite needed), then tuned


# ---------------------------------------------------------------------------- killed, then run again

class Killed(BaseException):
    """A kill -9 at a chosen point, in this process (nothing after it runs; no handler catches it)."""


SOLVE = ["--model", "tiny", "--embed-dim", "8", "--ridge", "1"]


def _solve_args(shapes: Path, out: Path, *extra) -> list:
    return ["solve", "--train-data", shapes / "train.jsonl", "--val-data", shapes / "val.jsonl", "--out", out, *SOLVE,
            *extra]  # fmt: skip


def _killed_in(monkeypatch, module, name: str, args) -> None:
    """``triclip ARGS`` killed (``kill -9`` stands in) when it reaches ``module.name``."""

    def killed(*_a, **_k):
        raise Killed("kill -9")

    monkeypatch.setattr(module, name, killed)
    with pytest.raises(Killed):
        from triclip.app.cli import main

        main([str(a) for a in args])
    monkeypatch.undo()


def _solve_killed_before_config(cli, monkeypatch, args) -> None:
    """``triclip ARGS`` (a solve) killed after its weights, before its config.json (the last file it writes)."""
    import triclip.training.checkpoint as ckpt

    _killed_in(monkeypatch, ckpt, "write_config", args)


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
    proc = subprocess.Popen([sys.executable, "-m", "triclip", "data", "prepare", "shapes", "--out", str(out), "--num", "5000"],
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
    from triclip.data.builtin import prepare

    for overwrite in (False, True):
        summary = prepare("shapes", out, num=30, overwrite=overwrite)  # no "files triclip did not write"
        assert summary["train"] + summary["val"] == 30
    assert len(os.listdir(out / "images")) == 30  # the killed run's images were replaced, not mixed in


# ---------------------------------------------------------------------------- one writer per folder


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


# ---------------------------------------------------------------------------- --init survives a kill


def _init_train(shapes: Path, init: Path, out: Path, *extra) -> list:
    return ["train", "--train-data", shapes / "train.jsonl", "--model", "tiny", "--init", init, "--loss", "infonce",
            "--epochs", "1", "--batch-size", "16", "--max-steps", "2", "--seed", "3", "--out", out, *extra]  # fmt: skip


def _killed_before_first_checkpoint(monkeypatch, args) -> None:
    import triclip.training.train as train_mod

    _killed_in(monkeypatch, train_mod, "_save", args)


def test_a_resume_before_the_first_checkpoint_starts_from_the_init_again(cli, tmp_path, shapes, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from tests.index.conftest import make_run

    init = make_run(tmp_path / "init", seed=7)  # weights no seed of this training would draw
    status, _, err = cli(*_init_train(shapes, init, tmp_path / "whole"))
    assert status == 0, err
    killed = tmp_path / "killed"
    _killed_before_first_checkpoint(monkeypatch, _init_train(shapes, init, killed))
    assert (killed / "config.json").exists() and not (killed / "checkpoint").exists()
    status, _, err = cli(*_init_train(shapes, init, killed, "--resume"))
    assert status == 0, err
    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(killed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # as if never killed


@pytest.mark.parametrize("change", ["gone", "changed"])
def test_a_resume_refuses_an_init_that_is_gone_or_changed(cli, tmp_path, shapes, monkeypatch, change):
    import shutil

    from tests.index.conftest import make_run

    init = make_run(tmp_path / "init", seed=7)
    killed = tmp_path / "killed"
    _killed_before_first_checkpoint(monkeypatch, _init_train(shapes, init, killed))
    if change == "gone":
        shutil.rmtree(init)
    else:
        shutil.rmtree(init)
        make_run(init, seed=8)  # another run under the same name
    status, _, err = cli(*_init_train(shapes, init, killed, "--resume"))
    line = one_line_error(status, err)
    assert "--init" in line and ("gone" if change == "gone" else "changed") in line
    assert not (killed / "model.safetensors").exists()


# ---------------------------------------------------------------------------- values that make nonsense


@pytest.mark.parametrize("command", ["solve", "eval", "index build", "train", "embed"])
@pytest.mark.parametrize("size", ["0", "-5"])
def test_a_batch_size_below_one_is_one_line_in_every_command(cli, tmp_path, shapes, tiny_run, command, size):
    out = tmp_path / "out"
    args = {
        "solve": _solve_args(shapes, out),
        "eval": ["eval", "--run", tiny_run, "--data", shapes / "val.jsonl"],
        "index build": ["index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", out],
        "train": _writers(shapes, tiny_run, out)["train"],
        "embed": _writers(shapes, tiny_run, out)["embed"],
    }[command]
    status, _, err = cli(*args, "--batch-size", size)
    assert "--batch-size" in one_line_error(status, err)
    assert not out.exists()


def test_a_ridge_that_zeroes_the_heads_is_refused(cli, tmp_path, shapes):
    out = tmp_path / "solved"
    status, _, err = cli(*[a if a != "1" else "1e300" for a in _solve_args(shapes, out)])
    assert "degenerate" in one_line_error(status, err)
    assert not out.exists()  # nothing written


def test_a_dangling_symlink_as_out_is_named(cli, tmp_path, shapes):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    status, _, err = cli("data", "prepare", "shapes", "--out", link, "--num", 10)
    line = one_line_error(status, err)
    assert "symbolic link" in line and "File exists" not in line


# ---------------------------------------------------------------------------- modes and the network


def test_every_index_file_follows_the_umask(cli, tmp_path, shapes, tiny_run):
    import stat

    from triclip.index.store import current_version

    index = tmp_path / "index"
    status, _, err = cli("index", "build", "--run", tiny_run, "--data", shapes / "train.jsonl", "--val-data",
                         shapes / "val.jsonl", "--out", index, "--dims", "8")  # fmt: skip
    assert status == 0, err
    version = index / current_version(index)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in version.iterdir()}
    assert "curves.json" in modes
    assert len(set(modes.values())) == 1, modes  # curves.json as readable as every other file


def test_an_hf_name_offline_is_one_line_without_a_request(cli, tmp_path, monkeypatch):
    import socket

    tried = []

    def no_network(self, address):
        tried.append(address)
        raise OSError("network is off in this test")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(socket.socket, "connect", no_network)
    status, _, err = cli("data", "split", "hf:someone/not-cached-anywhere", "--out", tmp_path / "out")
    assert "offline" in one_line_error(status, err)
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert tried == []


# ---------------------------------------------------------------------------- a full disk and permissions


@pytest.mark.parametrize("command", ["train", "solve --run", "index build", "index build --overwrite", "embed"])
def test_a_full_disk_is_one_true_line(cli, tmp_path, shapes, tiny_run, built_index, small_disk, command):
    disk = small_disk(leave=1 << 30)  # nothing filled yet
    if command == "solve --run":
        mrl = tmp_path / "mrl"
        status, _, err = cli("train", "--train-data", shapes / "train.jsonl", "--out", mrl, "--model", "tiny", "--loss",
                             "infonce", "--epochs", "1", "--batch-size", "16", "--max-steps", "1", "--embed-dim", "8",
                             "--lock-image", "--lock-text")  # fmt: skip
        assert status == 0, err
    if command == "index build --overwrite":
        copy_tree(built_index, disk / "out")
    small_disk(leave=16 << 10)  # room for the folder's mark and a config, not for weights or an index
    out = disk / "out"
    args = {
        "train": _writers(shapes, tiny_run, out)["train"],
        "solve --run": ["solve", "--run", tmp_path / "mrl", "--train-data", shapes / "train.jsonl", "--ridge", "1",
                        "--out", out],  # fmt: skip
        "index build": ["index", "build", "--run", tiny_run, "--data", shapes / "train.jsonl", "--out", out],
        "index build --overwrite": ["index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", out,
                                    "--overwrite", "--dims", "8"],  # fmt: skip
        "embed": _writers(shapes, tiny_run, out)["embed"],
    }[command]
    status, _, err = cli(*args)
    line = one_line_error(status, err)
    assert "disk full" in line and str(disk) in line, line


def test_numpy_short_write_says_disk_full(tmp_path, small_disk):
    import numpy as np

    from triclip.core.errors import UserError
    from triclip.core.io import atomic_path

    disk = small_disk(leave=0)
    with pytest.raises(UserError, match="disk full while writing"):
        with atomic_path(disk / "big.npy") as tmp:
            np.save(tmp, np.zeros(1 << 20, np.float32))  # "OSError: N requested and M written"
    assert not (disk / "big.npy").exists()


def test_unreadable_weights_say_permission_denied(tmp_path, tiny_run, shapes):
    from tests.hostile.conftest import run_triclip

    run = copy_tree(tiny_run, tmp_path / "run")
    os.chmod(run / "model.safetensors", 0)
    proc = run_triclip(["eval", "--run", run, "--data", shapes / "val.jsonl"], tmp_path, unprivileged=True)
    line = one_line_error(proc.returncode, proc.stderr)
    assert "Permission denied" in line and "No such file" not in line


def test_a_source_behind_a_closed_folder_says_permission_denied(tmp_path, shapes):
    from tests.hostile.conftest import run_triclip

    closed = tmp_path / "closed"
    copy_tree(shapes, closed / "data")
    os.chmod(closed, 0o600)  # readable names, not searchable
    try:
        proc = run_triclip(["data", "inspect", closed / "data" / "val.jsonl"], tmp_path, unprivileged=True)
    finally:
        os.chmod(closed, 0o700)
    line = one_line_error(proc.returncode, proc.stderr)
    assert "Permission denied" in line and "not found" not in line


# ---------------------------------------------------------------------------- versioned URLs mean that version


def test_an_image_url_of_a_version_not_served_is_404(tmp_path, built_index):
    import httpx

    from tests.app.conftest import serving

    index = copy_tree(built_index, tmp_path / "index")
    with serving(index, follow=0) as (url, app):
        live = app.live.view().version
        good = httpx.get(f"{url}triclip/image/0?v={live}", timeout=30)
        assert good.status_code == 200 and "max-age" in good.headers["cache-control"]  # a version's row never changes
        for version in ("v000099", "v000000", "nonsense"):  # never served, or no longer kept
            answer = httpx.get(f"{url}triclip/image/0?v={version}", timeout=30)
            assert answer.status_code == 404, version
            assert "max-age" not in answer.headers.get("cache-control", "")
        plain = httpx.get(f"{url}triclip/image/0", timeout=30)  # no version: the live one, not to be kept
        assert plain.status_code == 200 and "max-age" not in plain.headers.get("cache-control", "")


def test_a_split_that_filled_the_disk_runs_again(cli, tmp_path, shapes, small_disk):
    disk = small_disk(leave=8 << 10)
    out = disk / "out"
    status, _, err = cli("data", "split", shapes / "train.jsonl", "--out", out)
    line = one_line_error(status, err)
    assert "disk full" in line or "No space left" in line
    (disk / "filler").unlink()
    status, _, err = cli("data", "split", shapes / "train.jsonl", "--out", out)  # no "files triclip did not write"
    assert status == 0, err
    assert (out / "train.jsonl").is_file() and json.loads((out / ".triclip.json").read_text())["done"] is True
