"""Data preparation SIGKILLed while it writes its images, then run again: every manifest row's image decodes.

The demo's kill matrix once failed here (killed at the temporary file of the first image written in a
second folder of ``images/``, the rerun's train.jsonl named 41 images that were not there). These tests
kill a real ``triclip`` process with SIGKILL at that event (seen through inotify, as the kill matrix
sees it), run the command again and decode every image the manifests name; and they check the guard
that keeps a data folder from being marked done, or taken as done by the demo, while images are missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hostile.conftest import one_line_error
from triclip.core.io import folder_done, read_mark
from triclip.data import builtin, openclipart
from triclip.data.builtin import data_complete, missing_images, prepare
from triclip.data.images import FileImage, decode_image

ROOT = Path(__file__).resolve().parents[2]
needs_openclipart = pytest.mark.skipif(
    not os.path.isdir(os.path.join(openclipart.ROOT, "png")), reason="Debian package openclipart-png not installed"
)


def _watcher_module():
    spec = importlib.util.spec_from_file_location("kill_matrix", ROOT / "scripts" / "kill_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def _second_folder_tmp(path: str, first: list[str]) -> bool:
    """Whether ``path`` is an image's temporary file in another folder than the first image's (``first`` keeps
    that folder: the first image file seen, temporary or renamed into place)."""
    parts = path.split("/")
    if "images" not in parts or not parts[-1].endswith((".tmp", ".png")):
        return False
    folder = "/".join(parts[:-1])
    first[:] = first or [folder]
    return folder != first[0] and parts[-1].endswith(".tmp")


def kill_at_second_folder(args: list[str], parent: Path, cache: Path) -> tuple[int, str]:
    """Run ``triclip ARGS`` watched from ``parent`` and SIGKILL it at the first image temp file in a second
    folder; ``(exit status, the event it was killed at)``."""
    km = _watcher_module()
    watcher, first, event = km.Watcher(parent), [], ""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRICLIP_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "triclip", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while not event and proc.poll() is None:
            for _, path in watcher.read(0.05):
                if _second_folder_tmp(path, first) and proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    event = path
                    break
    finally:
        watcher.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return proc.returncode, event


def assert_every_image_decodes(data: Path) -> int:
    """Every row of train / val / test.jsonl names an image in ``data`` that decodes; returns the row count."""
    manifests = [data / f"{split}.jsonl" for split in ("train", "val", "test") if (data / f"{split}.jsonl").exists()]
    rows = [json.loads(line) for manifest in manifests for line in manifest.read_text().splitlines()]
    for row in rows:
        assert not os.path.isabs(row["image"]), row
        decode_image(FileImage(str(data / row["image"])))  # BadRecord (missing_file, corrupt_image) fails the test
    assert missing_images(data) == []
    return len(rows)


@needs_openclipart
def test_prepare_killed_at_the_first_image_of_a_second_folder_then_run_again(cli, tmp_path):
    out = tmp_path / "out"
    args = ["data", "prepare", "openclipart", "--num", "60", "--out", str(out)]
    status, event = kill_at_second_folder(args, tmp_path, tmp_path / "cache")
    assert status == -signal.SIGKILL and event.startswith("out/images/") and event.endswith(".tmp"), (status, event)
    assert read_mark(out) == {"kind": "data", "done": False}  # killed among the images: unfinished
    assert not (out / "train.jsonl").exists()

    status, _, err = cli(*args)
    assert status == 0, err
    assert folder_done(out, "data")
    assert assert_every_image_decodes(out) == 51  # 60 names, 9 byte-identical copies merged
    assert not [p for p in out.rglob("*.tmp")]  # the killed run's temporary image is gone with its folder


def test_a_builder_whose_rows_name_a_missing_image_leaves_the_folder_unfinished(cli, tmp_path, monkeypatch):
    """An image gone between the builder and the manifests (deleted by another process): one line, exit 2, no
    manifest written, the folder not done; the next run builds it whole."""
    real = builtin.BUILTINS["shapes"]

    def losing_one(out: str, num, seed):
        built = real(out, num, seed)
        os.remove(os.path.join(out, built.train[3]["image"]))  # as another process might
        return built

    monkeypatch.setitem(builtin.BUILTINS, "shapes", losing_one)
    out = tmp_path / "shapes"
    status, _, err = cli("data", "prepare", "shapes", "--num", "40", "--out", out)
    line = one_line_error(status, err)
    assert "1 images the manifests would name are not in it" in line and "run the command again" in line, line
    assert read_mark(out) == {"kind": "data", "done": False}
    assert not (out / "train.jsonl").exists()

    monkeypatch.setitem(builtin.BUILTINS, "shapes", real)
    status, _, err = cli("data", "prepare", "shapes", "--num", "40", "--out", out)
    assert status == 0, err
    assert assert_every_image_decodes(out) == 40


def test_a_done_folder_that_lost_an_image_is_not_complete(tmp_path):
    out = tmp_path / "shapes"
    prepare("shapes", str(out), num=30, seed=0)
    assert data_complete(out) and missing_images(out) == []
    row = json.loads((out / "val.jsonl").read_text().splitlines()[0])
    (out / row["image"]).unlink()
    assert folder_done(out, "data") and not data_complete(out)
    assert missing_images(out) == [row["image"]]
    (out / row["image"]).mkdir()  # a folder in its place is no image either
    assert missing_images(out) == [row["image"]]
    (out / "test.jsonl").write_text('{"image": "images/none.png", "captions": ["x"]}\nnot json\n')
    assert missing_images(out) == [row["image"], "images/none.png", "None"]


@pytest.mark.slow
@needs_openclipart
def test_demo_killed_at_the_first_image_of_a_second_folder_then_run_again(tmp_path):
    """The demo's step that failed in its kill matrix, as one case (about a minute on 2 cores); then an image
    deleted from its finished data folder: the next demo prepares the data again."""
    work = tmp_path / "out"
    args = ["demo", "--workdir", str(work), "--no-serve", "--num", "60", "--epochs", "1"]
    status, event = kill_at_second_folder(args, tmp_path, tmp_path / "cache")
    assert status == -signal.SIGKILL and event.startswith("out/data/images/"), (status, event)
    assert read_mark(work / "data") == {"kind": "data", "done": False}

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRICLIP_CACHE": str(tmp_path / "cache")}
    run = lambda: subprocess.run([sys.executable, "-m", "triclip", *args], cwd=ROOT, env=env, capture_output=True, text=True)  # noqa: E731
    done = run()
    assert done.returncode == 0, done.stderr[-3000:]
    assert folder_done(work, "demo") and folder_done(work / "data", "data")
    assert assert_every_image_decodes(work / "data") == 51

    row = json.loads((work / "data" / "train.jsonl").read_text().splitlines()[0])
    (work / "data" / row["image"]).unlink()
    again = run()
    assert again.returncode == 0, again.stderr[-3000:]
    assert "manifests are missing: preparing the data again" in again.stdout
    assert assert_every_image_decodes(work / "data") == 51
