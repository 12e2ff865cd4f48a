"""No command silently replaces what a user already has.

One rule (``triclip.core.io.claim_output_dir``) for ``data prepare``, ``train``, ``index build``
and ``embed``: a non-empty folder of another kind is refused, one of the command's own kind
needs ``--overwrite`` (or ``--resume`` / ``--add`` / an ``embed`` re-run), and an overwritten
index keeps its previous version for ``triclip index rollback``. Every refusal leaves the
folder byte for byte as it was.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from triclip.index.store import _versions, current_version, load_contents
from triclip.core.errors import UserError
from triclip.core.io import claim_output_dir, folder_kind
from tests.hostile.conftest import copy_tree, first_rows, one_line_error


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: its hash and mtime (a refused command must change neither)."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def user_folder(path: Path) -> Path:
    """A folder of the user's own files that happen to carry a run's names."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"my": "settings"}\n')
    (path / "model.safetensors").write_bytes(b"my own weights")
    (path / "metrics.jsonl").write_text('{"my": 1}\n')
    return path


# ---------------------------------------------------------------------------- index build


def test_index_rebuild_from_fewer_records_is_refused_and_keeps_the_index(cli, tmp_path, built_index, shapes, tiny_run):
    index = copy_tree(built_index, tmp_path / "index")
    before, count = snapshot(index), load_contents(index, indexes=False).manifest["count"]
    few = first_rows(shapes / "train.jsonl", tmp_path / "few.jsonl", 20)
    status, _, err = cli("index", "build", "--run", tiny_run, "--data", few, "--out", index)
    line = one_line_error(status, err)
    assert "--overwrite" in line and "--add" in line
    assert snapshot(index) == before
    assert load_contents(index, indexes=False).manifest["count"] == count > 20


def test_index_overwrite_keeps_one_rollback(cli, tmp_path, built_index, shapes, tiny_run):
    index = copy_tree(built_index, tmp_path / "index")
    count = load_contents(index, indexes=False).manifest["count"]
    old = current_version(index)
    few = first_rows(shapes / "train.jsonl", tmp_path / "few.jsonl", 20)
    status, _, err = cli("index", "build", "--run", tiny_run, "--data", few, "--out", index, "--overwrite", "--dims", "8")
    assert status == 0, err
    assert load_contents(index, indexes=False).manifest["count"] == 20
    assert old in _versions(index)  # kept for one rollback
    status, out, err = cli("index", "rollback", "--index", index)
    assert status == 0, err
    assert current_version(index) == old and load_contents(index, indexes=False).manifest["count"] == count
    assert len(_versions(index)) == 1
    status, _, err = cli("index", "rollback", "--index", index)  # only one step back is kept
    assert "no earlier version" in one_line_error(status, err)


def test_an_overwrites_rollback_survives_the_adds_after_it(cli, tmp_path, built_index, shapes, tiny_run):
    """What the demo does on a new recipe: --overwrite from train, then --add val and test; rollback is the old index."""
    index = copy_tree(built_index, tmp_path / "index")
    old, count = current_version(index), load_contents(index, indexes=False).manifest["count"]
    few = first_rows(shapes / "train.jsonl", tmp_path / "few.jsonl", 20)
    status, _, err = cli("index", "build", "--run", tiny_run, "--data", few, "--out", index, "--overwrite", "--dims", "8")
    assert status == 0, err
    for _ in range(2):
        status, _, err = cli("index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", index, "--add")
        assert status == 0, err
    assert len(_versions(index)) == 2 and old in _versions(index)  # the live one and the kept rollback, no more
    status, _, err = cli("index", "rollback", "--index", index)
    assert status == 0, err
    assert current_version(index) == old and load_contents(index, indexes=False).manifest["count"] == count


def test_index_add_and_overwrite_together_is_refused(cli, tmp_path, built_index, shapes, tiny_run):
    index = copy_tree(built_index, tmp_path / "index")
    status, _, err = cli("index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", index, "--add",
                         "--overwrite")  # fmt: skip
    one_line_error(status, err)


@pytest.mark.parametrize("other", ["user", "data", "run"])
def test_index_build_into_a_foreign_folder_is_refused(cli, tmp_path, shapes, tiny_run, other):
    target = {"user": lambda: user_folder(tmp_path / "mine"), "data": lambda: copy_tree(shapes, tmp_path / "d"),
              "run": lambda: copy_tree(tiny_run, tmp_path / "r")}[other]()  # fmt: skip
    before = snapshot(target)
    status, _, err = cli("index", "build", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", target,
                         "--overwrite")  # fmt: skip
    assert "refusing" in one_line_error(status, err)
    assert snapshot(target) == before


# ---------------------------------------------------------------------------- data prepare


def test_data_prepare_over_a_data_set_needs_overwrite(cli, tmp_path, shapes):
    data = copy_tree(shapes, tmp_path / "data")
    before = snapshot(data)
    status, _, err = cli("data", "prepare", "shapes", "--out", data, "--num", 10)
    assert "--overwrite" in one_line_error(status, err)
    assert snapshot(data) == before  # neither the manifests nor a single image redrawn
    status, out, err = cli("data", "prepare", "shapes", "--out", data, "--num", 10, "--overwrite")
    assert status == 0, err
    assert len((data / "train.jsonl").read_text().splitlines()) + len((data / "val.jsonl").read_text().splitlines()) == 10


@pytest.mark.parametrize("other", ["user", "index", "run"])
def test_data_prepare_into_a_foreign_folder_is_refused(cli, tmp_path, built_index, tiny_run, other):
    target = {"user": lambda: user_folder(tmp_path / "mine"), "index": lambda: copy_tree(built_index, tmp_path / "i"),
              "run": lambda: copy_tree(tiny_run, tmp_path / "r")}[other]()  # fmt: skip
    before = snapshot(target)
    status, _, err = cli("data", "prepare", "shapes", "--out", target, "--num", 10, "--overwrite")
    assert "refusing" in one_line_error(status, err)
    assert snapshot(target) == before


# ---------------------------------------------------------------------------- train


def _train_args(shapes: Path, out: Path) -> list:
    return ["train", "--train-data", shapes / "train.jsonl", "--out", out, "--model", "tiny", "--loss", "infonce",
            "--epochs", "1", "--batch-size", "16", "--max-steps", "1", "--embed-dim", "16"]  # fmt: skip


@pytest.mark.parametrize("other", ["user", "index", "data"])
def test_train_into_a_foreign_folder_is_refused(cli, tmp_path, shapes, built_index, other):
    target = {"user": lambda: user_folder(tmp_path / "mine"), "index": lambda: copy_tree(built_index, tmp_path / "i"),
              "data": lambda: copy_tree(shapes, tmp_path / "d")}[other]()  # fmt: skip
    before = snapshot(target)
    for extra in ([], ["--overwrite"], ["--resume"]):
        status, _, err = cli(*_train_args(shapes, target), *extra)
        one_line_error(status, err)
        assert snapshot(target) == before


def test_train_over_a_run_needs_overwrite(cli, tmp_path, shapes, tiny_run):
    run = copy_tree(tiny_run, tmp_path / "run")
    before = snapshot(run)
    status, _, err = cli(*_train_args(shapes, run))
    assert "--overwrite" in one_line_error(status, err)
    assert snapshot(run) == before
    status, _, err = cli(*_train_args(shapes, run), "--overwrite", "--resume")
    one_line_error(status, err)
    status, _, err = cli(*_train_args(shapes, run), "--overwrite")
    assert status == 0, err
    assert snapshot(run)["model.safetensors"] != before["model.safetensors"]


# ---------------------------------------------------------------------------- embed


@pytest.mark.parametrize("other", ["user", "index", "run"])
def test_embed_into_a_foreign_folder_is_refused(cli, tmp_path, shapes, tiny_run, built_index, other):
    target = {"user": lambda: user_folder(tmp_path / "mine"), "index": lambda: copy_tree(built_index, tmp_path / "i"),
              "run": lambda: copy_tree(tiny_run, tmp_path / "r")}[other]()  # fmt: skip
    before = snapshot(target)
    status, _, err = cli("embed", "--run", tiny_run, "--data", shapes / "val.jsonl", "--out", target, "--overwrite")
    assert "refusing" in one_line_error(status, err)
    assert snapshot(target) == before


# ---------------------------------------------------------------------------- the rule itself


def test_folder_kinds_are_recognised(tmp_path, shapes, tiny_run, built_index):
    assert folder_kind(shapes) == "data"
    assert folder_kind(tiny_run) == "run"
    assert folder_kind(built_index) == "index"
    assert folder_kind(user_folder(tmp_path / "mine")) is None


def test_claim_accepts_new_and_empty_folders_and_leftovers(tmp_path):
    assert claim_output_dir(tmp_path / "new" / "deeper", "index") is None
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".lock").write_text("")
    (tmp_path / "empty" / ".tmp-abc").mkdir()
    (tmp_path / "empty" / ".model.safetensors.x1y2.tmp").write_text("")
    assert claim_output_dir(tmp_path / "empty", "run") is None
    assert not (tmp_path / "new").exists()  # nothing made


def test_claim_refuses_devices_files_and_fifos(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    for path in ("/dev/null", tmp_path / "fifo", tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(UserError):
            claim_output_dir(path, "embeddings")
