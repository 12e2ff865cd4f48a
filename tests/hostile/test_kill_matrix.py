"""The full kill matrix (slow): every writing command x SIGKILL at each step it takes x rerun with and
without --overwrite, and x a 5 MB disk (``scripts/kill_matrix.py``; its docstring says what passes); and the
matrix's own parts: the watcher sees every file in order, temporary names are told apart from steps, and a
command that takes a second is killed at the step asked for."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def matrix():
    path = Path(__file__).resolve().parents[2] / "scripts" / "kill_matrix.py"
    spec = importlib.util.spec_from_file_location("kill_matrix", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_the_watcher_sees_every_file_in_order_through_new_and_renamed_folders(matrix, tmp_path):
    actions = [
        lambda: (tmp_path / "out").mkdir(),
        lambda: (tmp_path / "out" / "a.txt").write_text("a"),
        lambda: (tmp_path / "out" / ".stage").mkdir(),
        lambda: (tmp_path / "out" / ".stage" / "b.txt").write_text("b"),
        lambda: os.rename(tmp_path / "out" / ".stage", tmp_path / "out" / "done"),
        lambda: (tmp_path / "out" / "done" / "c.txt").write_text("c"),  # in a renamed folder: under its new name
    ]
    watcher, seen = matrix.Watcher(tmp_path), []
    try:
        for action in actions:
            action()
            seen += watcher.read(1.0)
    finally:
        watcher.close()
    assert seen == [("create/", "out"), ("create", "out/a.txt"), ("create/", "out/.stage"),
                    ("create", "out/.stage/b.txt"), ("moved/", "out/done"), ("create", "out/done/c.txt")]


def test_a_file_written_before_its_folders_watch_is_found_and_killed_at_by_its_path(matrix, tmp_path):
    """A folder made and filled before the watcher reads its creation: what it holds is ``found`` (created or renamed
    there, unknown which), and a run killed at that step stops at the first event of any kind at that path."""
    watcher = matrix.Watcher(tmp_path)
    try:
        (tmp_path / ".stage").mkdir()
        (tmp_path / ".stage" / "mark.json").write_text("{}")  # before the watch on .stage is in place
        seen = watcher.read(1.0)
    finally:
        watcher.close()
    assert seen == [("create/", ".stage"), ("found", ".stage/mark.json")]
    step = ("found", ".stage/mark.json")
    assert matrix.reached(step, ("moved", ".stage/mark.json"), "moved", ".stage/mark.json")  # the next run: in time
    assert matrix.reached(step, ("create", ".stage/mark.json"), "create", ".stage/mark.json")
    assert not matrix.reached(step, ("create", ".stage/.mark.json.*.tmp"), "create", ".stage/.mark.json.ab12cd34.tmp")
    assert not matrix.reached(step, ("moved/", ".stage/mark.json"), "moved/", ".stage/mark.json")  # a folder there
    created = ("create", ".stage/mark.json")  # a step the reference saw in time, found by a later run
    assert matrix.reached(created, ("found", ".stage/mark.json"), "found", ".stage/mark.json")
    assert not matrix.reached(created, ("moved", ".stage/mark.json"), "moved", ".stage/mark.json")


def test_temporary_names_are_one_kind_of_file_and_each_kind_one_step(matrix, tmp_path):
    names = [Path(tempfile.mkstemp(prefix=".model.safetensors.", suffix=".tmp", dir=tmp_path)[1]).name for _ in range(3)]
    names += [Path(tempfile.mkdtemp(prefix=".tmp-", dir=tmp_path)).name for _ in range(2)]
    assert {matrix.normalise(f"out/{n}") for n in names} == {"out/.model.safetensors.*.tmp", "out/.tmp-*"}
    steps = matrix.Steps()
    events = [("moved", "out/.triclip.json"), ("create", "out/images/000001.png"), ("create", "out/images/000002.png"),
              ("moved", "out/train.jsonl"), ("moved", "out/.triclip.json")]  # fmt: skip
    started = [steps.add(kind, path) for kind, path in events]
    assert [s is not None for s in started] == [True, True, False, True, False]  # every image: one step
    assert steps.order == [("moved", "out/.triclip.json"), ("create", "out/images/#.png"), ("moved", "out/train.jsonl")]


def test_a_command_of_a_second_is_killed_at_the_step_asked_for_and_runs_again(matrix, tmp_path, shapes):
    spec = {"args": ["data", "split", str(shapes / "train.jsonl"), "--out", "{out}"], "kind": "data"}
    work = tmp_path / "work"
    reference, fresh, replace = matrix.references("data split", spec, work)
    wanted = ("moved", "out/val.jsonl")
    assert wanted in fresh.order
    parent = matrix.case_folder(work, "killed")
    killed, steps, _, _ = matrix.watched(matrix.with_out(spec, parent / matrix.OUT), parent, work, wanted)
    assert killed and steps.order[-1] == wanted
    out = parent / matrix.OUT
    assert (out / "val.jsonl").exists() and json.loads((out / ".triclip.json").read_text())["done"] is False
    assert matrix.rerun(spec, out, work, overwrite=False) is None
    assert replace is not None and replace.order[-1] == ("moved/", "out")  # the replacement swaps in last


def test_at_a_glob_a_command_is_killed_at_the_first_path_that_matches_and_the_kill_is_listed(matrix, tmp_path, shapes):
    """``--at``: no reference and no step numbers; the first path under the case folder matching the glob."""
    assert matrix.reached("out/images/*/.*.tmp", None, "create", "out/images/a/.x.png.k2x8a1qz.tmp")
    assert matrix.reached("out/images/*/.*.tmp", None, "found", "out/images/a/.x.png.k2x8a1qz.tmp")
    assert not matrix.reached("out/images/*/.*.tmp", None, "moved", "out/images/a/x.png")
    spec = {"args": ["data", "split", str(shapes / "train.jsonl"), "--out", "{out}"], "kind": "data"}
    work = tmp_path / "work"
    [(case, why)] = matrix.at_cases("data split", spec, work, "out/val.jsonl")
    assert why is None and "out/val.jsonl" in case
    listing = (work / "cases" / "data_split-at" / "killed.txt").read_text().splitlines()
    assert "out/val.jsonl" in listing and "out/" in listing
    assert json.loads((work / "cases" / "data_split-at" / "out" / ".triclip.json").read_text())["done"] is True  # rerun


def test_a_command_that_fits_in_5_mb_meets_a_disk_of_half_what_it_wrote(matrix, tmp_path, shapes):
    spec = {"args": ["data", "split", str(shapes / "train.jsonl"), "--out", "{out}"], "kind": "data"}
    case, why, how, used = matrix.disk_case("data split", spec, tmp_path)
    assert why.startswith("exit 0 ok: it fits") and used > 0, why
    case, why, how, _ = matrix.disk_case("data split", spec, tmp_path, used // 2)
    assert why.startswith("exit 2 ok: triclip: error:") and f"{used // 2:,} bytes" in case, why
    assert "disk full" in why or "file too large" in why.lower(), why  # tmpfs full (ENOSPC), or the RLIMIT_FSIZE fallback


def test_where_mount_is_not_permitted_the_small_disk_is_a_file_size_limit(matrix, tmp_path, shapes, monkeypatch):
    """The fallback full disk (``prlimit``'s RLIMIT_FSIZE), which a root CI with tmpfs never takes otherwise."""
    run = subprocess.run
    refused = lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, 32) if cmd[0] == "mount" else run(cmd, *a, **k)  # noqa: E731
    monkeypatch.setattr(subprocess, "run", refused)
    spec = {"args": ["data", "split", str(shapes / "train.jsonl"), "--out", "{out}"], "kind": "data"}
    _, why, how, used = matrix.disk_case("data split", spec, tmp_path)
    assert why.startswith("exit 0 ok: it fits") and used > 0 and how.startswith("RLIMIT_FSIZE"), why
    _, why, how, _ = matrix.disk_case("data split", spec, tmp_path, 2048)  # smaller than any file it writes
    assert why.startswith("exit 2 ok: triclip: error:") and "file too large" in why.lower(), why


@pytest.mark.slow
def test_the_index_writers_survive_kills_and_a_full_disk(matrix, tmp_path, capsys):
    """The matrix over data split and index build (about 100 cases, each killed at a step of its own): what runs in
    the suite's time, two cases at once: 769 s, against 1,436 s one at a time in a full run of the suite, on 2 cores).
    Every writer, train's ~200 cases included, is ``python scripts/kill_matrix.py`` (about an hour on 2 cores, one
    case at a time)."""
    status = matrix.main(["--work", str(tmp_path), "--only", "data split,index build", "--jobs", "2"])
    out = capsys.readouterr().out
    assert "PASS" in out and status == 0, out
    assert " 0 skipped, 0 failed" in out.splitlines()[-1], out


def test_cases_run_two_at_once_come_back_in_the_order_given(matrix):
    """``--jobs 2``: the second case runs while the first waits on it, and the results keep the cases' order."""
    import threading

    second_ran = threading.Event()

    def first():
        assert second_ran.wait(10), "the second case did not run beside the first"
        return None

    def second():
        second_ran.set()
        return "skip: it exited before the step came"

    cases = [("a", first), ("b", second), ("c", lambda: "exit 1: boom")]
    assert list(matrix.in_order(iter(cases), 2)) == [("a", None), ("b", "skip: it exited before the step came"), ("c", "exit 1: boom")]
    with pytest.raises(SystemExit) as bad:
        matrix.main(["--jobs", "0", "--list"])
    assert bad.value.code == 2
