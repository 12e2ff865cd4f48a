"""``triclip data prepare`` / ``triclip data inspect``: JSON out, user errors exit 2 with one line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from triclip.app.cli import main
from tests.data.data_fixtures import write_image, write_manifest, write_truncated_png

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
    assert "--num must be >= 1" in _one_line_error(
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


# ---------------------------------------------------------------------------- data split


def _split_source(tmp_path: Path) -> Path:
    """20 distinct images in a TSV, plus a byte-identical copy of image 5 under another name."""
    lines = ["filepath\ttitle"]
    for i in range(20):
        write_image(tmp_path / "img" / f"{i}.png", colour=(10 * i, 255 - 10 * i, 7 * i))
        lines.append(f"img/{i}.png\tpicture {i}")
    (tmp_path / "img" / "copy.png").write_bytes((tmp_path / "img" / "5.png").read_bytes())
    lines.append("img/copy.png\tthe fifth picture")
    (tmp_path / "all.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp_path / "all.tsv"


def test_split_prints_a_summary_and_writes_three_manifests(tmp_path: Path, capsys):
    source = _split_source(tmp_path)
    args = ["data", "split", str(source), "--out", str(tmp_path / "d"), "--val", "0.2", "--test", "0.1", "--seed", "3"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [summary[s] for s in ("train", "val", "test")] == [14, 4, 2]
    assert summary["duplicates_merged"] == 1 and summary["images"] == 20 and summary["skipped"] == {}
    rows = {s: [json.loads(line) for line in (tmp_path / "d" / f"{s}.jsonl").open()] for s in ("train", "val", "test")}
    digests = {}
    for split, split_rows in rows.items():
        for row in split_rows:
            digest = hashlib.sha256((tmp_path / "d" / row["image"]).read_bytes()).hexdigest()
            assert digests.setdefault(digest, split) == split and row["captions"]
    assert len(digests) == 20
    fifth = next(row for split_rows in rows.values() for row in split_rows if row["image"] == "../img/5.png")
    assert fifth["captions"] == ["picture 5", "the fifth picture"]
    assert main(["data", "inspect", str(tmp_path / "d" / "val.jsonl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 4
    line = _one_line_error(capsys, main(args))  # the folder holds a data set now
    assert "--overwrite" in line
    assert main(args[:-2] + ["--seed", "4", "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["seed"] == 4


def test_split_bad_shares_exit_2_before_any_work(tmp_path: Path, capsys):
    source = _split_source(tmp_path)
    out = tmp_path / "never"
    for shares, message in (
        (["--val", "-0.1"], "--val must be >= 0"),
        (["--test", "-1"], "--test must be >= 0"),
        (["--val", "0.6", "--test", "0.4"], "below 1"),
        (["--val", "abc"], "expected a number, got 'abc'"),
        (["--test", "nan"], "argument --test: expected a finite number"),  # every float option's parse
        (["--val", "inf"], "argument --val: expected a finite number"),
    ):
        line = _one_line_error(capsys, main(["data", "split", str(source), "--out", str(out), *shares]))
        assert message in line, line
        assert not out.exists()
    line = _one_line_error(capsys, main(["data", "split", str(tmp_path / "none.jsonl"), "--out", str(out)]))
    assert "data source not found" in line and not out.exists()
    line = _one_line_error(capsys, main(["data", "split", str(source), "--out", str(source)]))
    assert "is a file" in line
