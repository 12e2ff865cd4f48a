"""``triclip data prepare`` / ``triclip data inspect``: JSON out, user errors exit 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from app.cli import main
from tests.retrieval.data_fixtures import write_image, write_manifest, write_truncated_png

TRICLIP = os.path.join(os.path.dirname(sys.executable), "triclip")


def _one_line_error(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in captured.err
    lines = [line for line in captured.err.split("\n") if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("triclip: error: "), captured.err
    return lines[0]


def test_prepare_shapes_300(tmp_path: Path, capsys):
    assert main(["data", "prepare", "shapes", "--out", str(tmp_path / "d"), "--num", "300", "--seed", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["train"] + summary["val"] == 300 and summary["skipped"] == {}
    rows = [json.loads(line) for name in ("train.jsonl", "val.jsonl") for line in (tmp_path / "d" / name).open()]
    assert len(rows) == 300
    assert all((tmp_path / "d" / row["image"]).is_file() and row["captions"] and row["label"] for row in rows)


def test_inspect_two_good_and_three_bad(tmp_path: Path, capsys):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.jpg")
    write_truncated_png(tmp_path / "corrupt.png")
    manifest = write_manifest(
        tmp_path / "m.jsonl",
        [
            {"image": "a.png", "captions": ["one"]},
            {"image": "b.jpg", "captions": ["two"], "label": "x"},
            {"image": "corrupt.png", "captions": ["three"]},
            {"image": "missing.png", "captions": ["four"]},
            {"image": "a.png", "captions": [""]},
        ],
    )
    assert main(["data", "inspect", str(manifest), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == 2
    assert report["skipped"] == {"corrupt_image": 1, "empty_caption": 1, "missing_file": 1}
    assert main(["data", "inspect", str(manifest)]) == 0
    assert capsys.readouterr().out.startswith("2 usable records")


def test_inspect_passes_source_options(tmp_path: Path, capsys):
    write_image(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text("path;text\na.png;hi\n", encoding="utf-8")
    args = ["data", "inspect", str(tmp_path / "d.csv"), "--json", "--image-key", "path", "--caption-key", "text"]
    assert main(args + ["--sep", ";"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 1
    assert "no column 'filepath'" in _one_line_error(capsys, main(["data", "inspect", str(tmp_path / "d.csv")]))


def test_user_errors_exit_2_with_one_line(tmp_path: Path, capsys):
    line = _one_line_error(capsys, main(["data", "inspect", str(tmp_path / "missing.jsonl"), "--json"]))
    assert "data source not found" in line
    assert "invalid choice" in _one_line_error(capsys, main(["data", "prepare", "mnist", "--out", str(tmp_path)]))
    assert "--num must be positive" in _one_line_error(
        capsys, main(["data", "prepare", "shapes", "--out", str(tmp_path), "--num", "-3"])
    )
    (tmp_path / "x.txt").write_text("?")
    assert "cannot tell the format" in _one_line_error(capsys, main(["data", "inspect", str(tmp_path / "x.txt")]))
    bad = write_manifest(tmp_path / "bad.jsonl", [{"image": "nothing.png", "captions": ["x"]}, "{"])
    line = _one_line_error(capsys, main(["data", "inspect", str(bad)]))
    assert "no usable records" in line and "missing_file=1" in line and "bad_row=1" in line


def test_console_script_missing_manifest_and_offline_hub(tmp_path: Path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for source, message in ((str(tmp_path / "nope.jsonl"), "data source not found"), ("hf:someone/some-data", "hub")):
        done = subprocess.run([TRICLIP, "data", "inspect", source, "--json"], capture_output=True, text=True, env=env)
        assert done.returncode == 2, done.stderr
        assert done.stdout == "" and "Traceback" not in done.stderr
        lines = [line for line in done.stderr.split("\n") if line.strip()]
        assert len(lines) == 1 and message in lines[0], done.stderr
