"""Housekeeping and counts.

Temp files of checkpoint writes that a kill cut short are removed by the next run or
``--resume`` of the folder; ``data prepare`` and ``embed`` follow the umask; a source whose
records all fail reports every reason with its count; one good record among bad ones is
reported as what it is, not as "no image decoded".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.hostile.conftest import one_line_error

KILLED_WRITE = """
import os, sys
from pathlib import Path
from triclip.core.io import atomic_path
with atomic_path(Path(sys.argv[1])) as tmp:
    tmp.write_bytes(os.urandom(4096))
    os.kill(os.getpid(), 9)  # SIGKILL mid-write: no finally, no cleanup
"""


def killed_write(target: Path) -> None:
    """Start the writer that checkpoints use on ``target`` and SIGKILL it mid-write."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(target)], cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == -signal.SIGKILL


def _train(cli, shapes: Path, run: Path, *extra):
    return cli("train", "--train-data", shapes / "train.jsonl", "--out", run, "--model", "tiny", "--loss", "infonce",
               "--batch-size", 16, "--embed-dim", 16, *extra)  # fmt: skip


def orphans(run: Path) -> list[str]:
    """Hidden files other than the folder's own lock and mark (triclip.core.io.writing)."""
    return sorted(p.name for p in run.iterdir() if p.name.startswith(".") and p.name not in (".lock", ".triclip.json"))


def test_resume_removes_what_killed_checkpoint_writes_left(cli, tmp_path, shapes):
    run = tmp_path / "run"
    status, _, err = _train(cli, shapes, run, "--epochs", 1)
    assert status == 0, err
    for name in ("model.safetensors", "metrics.jsonl", "config.json"):
        killed_write(run / name)
    (run / ".checkpoint.tmp").mkdir()  # save_checkpoint's staging folder, killed before the swap
    (run / ".checkpoint.tmp" / "optim.safetensors").write_bytes(b"x" * 4096)
    (run / ".checkpoint.old").mkdir()  # swap_dir killed after its second rename, before removing the old one
    (run / ".checkpoint.old" / "optim.safetensors").write_bytes(b"x" * 4096)
    assert len(orphans(run)) == 5
    status, _, err = _train(cli, shapes, run, "--epochs", 2, "--resume")
    assert status == 0, err
    assert orphans(run) == []


def test_a_new_run_in_a_killed_folder_removes_its_orphans(cli, tmp_path, shapes):
    run = tmp_path / "run"
    run.mkdir()
    killed_write(run / "model.safetensors")  # killed before anything was saved
    assert len(orphans(run)) == 1
    status, _, err = _train(cli, shapes, run, "--epochs", 1)
    assert status == 0, err
    assert orphans(run) == []


def test_a_recovery_copy_is_kept(tmp_path):
    """``.checkpoint.old`` without ``checkpoint/`` is what a crash mid-swap leaves to resume from: kept."""
    from triclip.training.checkpoint import remove_orphans

    (tmp_path / ".checkpoint.old").mkdir()
    assert remove_orphans(tmp_path) == [] and (tmp_path / ".checkpoint.old").is_dir()


# ---------------------------------------------------------------------------- the umask


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(root: Path) -> set[tuple[str, str]]:
    return {("dir" if p.is_dir() else "file", oct(p.stat().st_mode & 0o777)) for p in [root, *root.rglob("*")]}


def test_data_prepare_and_embed_follow_the_umask(cli, tmp_path, tiny_run, umask_022):
    status, _, err = cli("data", "prepare", "shapes", "--out", tmp_path / "data", "--num", 12)
    assert status == 0, err
    assert modes(tmp_path / "data") == {("dir", "0o755"), ("file", "0o644")}
    status, _, err = cli("embed", "--run", tiny_run, "--data", tmp_path / "data" / "train.jsonl", "--out", tmp_path / "emb",
                         "--shard-size", 4)  # fmt: skip
    assert status == 0, err
    assert modes(tmp_path / "emb") == {("dir", "0o755"), ("file", "0o644")}


# ---------------------------------------------------------------------------- counts


@pytest.fixture
def bad_source(tmp_path) -> Path:
    """8 records that all fail, for 5 reasons: corrupt_image 3 (one only when decoded), missing_file 2,
    empty_caption 1, not_a_file 1, bad_row 1."""
    Image.new("RGB", (8, 8), "red").save(tmp_path / "good.png")
    (tmp_path / "garbage.png").write_bytes(b"not an image at all")
    good = (tmp_path / "good.png").read_bytes()
    (tmp_path / "trunc.png").write_bytes(good[: len(good) // 2])
    noise = np.random.default_rng(0).integers(0, 255, (256, 256, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "noise.png")
    body = (tmp_path / "noise.png").read_bytes()
    (tmp_path / "body.png").write_bytes(body[: int(len(body) * 0.6)])  # the header reads; the pixels do not
    (tmp_path / "folder.png").mkdir()
    rows = [("garbage.png", "a"), ("trunc.png", "b"), ("missing.png", "c"), ("good.png", ""), ("folder.png", "d"),
            ("missing2.png", "e"), ("body.png", "f")]  # fmt: skip
    lines = [json.dumps({"image": image, "captions": [caption]}) for image, caption in rows] + ["{not json"]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "bad.jsonl"


EVERY_REASON = "'bad_row': 1, 'corrupt_image': 3, 'empty_caption': 1, 'missing_file': 2, 'not_a_file': 1"


@pytest.mark.parametrize("command", ["index", "embed", "eval"])
def test_an_all_bad_source_reports_every_reason(cli, tmp_path, tiny_run, bad_source, command):
    args = {
        "index": ["index", "build", "--run", tiny_run, "--data", bad_source, "--out", tmp_path / "index"],
        "embed": ["embed", "--run", tiny_run, "--data", bad_source, "--out", tmp_path / "emb"],
        "eval": ["eval", "--run", tiny_run, "--data", bad_source, "--json"],
    }[command]
    status, _, err = cli(*args)
    line = one_line_error(status, err)
    assert EVERY_REASON in line
    assert f"; the first: {bad_source.parent / 'body.png'}: " in line  # the one whose header read, and why


def test_one_good_record_among_bad_ones_is_not_no_image_decoded(cli, tmp_path, bad_source):
    text = bad_source.read_text() + json.dumps({"image": "good.png", "captions": ["a red square"]}) + "\n"
    (tmp_path / "one_good.jsonl").write_text(text)
    status, _, err = cli("train", "--train-data", tmp_path / "one_good.jsonl", "--out", tmp_path / "run", "--model",
                         "tiny", "--loss", "infonce", "--epochs", 1, "--batch-size", 2)  # fmt: skip
    line = one_line_error(status, err)
    assert "no image decoded" not in line and "only 1 of 2 images decoded" in line
    assert f"; the first that failed: {tmp_path / 'body.png'}: image file is truncated" in line  # header read
