"""``triclip index build`` and ``triclip search`` through the CLI entry point."""

from __future__ import annotations

import json

import pytest

from app.cli import main


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def cli_index(tmp_path_factory, run_dir, shapes_dir):
    out = tmp_path_factory.mktemp("cli") / "index"
    code = main(["index", "build", "--run", str(run_dir), "--data", str(shapes_dir / "train.jsonl"),
                 "--out", str(out), "--dims", "8", "--factory", "Flat", "--batch-size", "32"])  # fmt: skip
    assert code == 0
    return out


def test_build_prints_a_summary(capsys, tmp_path, run_dir, shapes_dir):
    code, out, _ = _run(capsys, "index", "build", "--run", run_dir, "--data", shapes_dir / "val.jsonl",
                        "--out", tmp_path / "i", "--dims", "4")  # fmt: skip
    assert code == 0
    summary = json.loads(out)
    assert (summary["m"], summary["factory"], summary["count"]) == (4, "Flat", 10)  # auto: Flat for 10 vectors


def test_text_search_json(capsys, cli_index):
    code, out, _ = _run(capsys, "search", "--index", cli_index, "--text", "three large blue squares", "-k", "10", "--json")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 10 and all(set(r) == {"id", "image", "caption", "score"} for r in rows)
    assert [r["score"] for r in rows] == sorted((r["score"] for r in rows), reverse=True)


def test_image_search_finds_itself(capsys, cli_index):
    first = json.loads((cli_index / "meta.jsonl").read_text().splitlines()[7])
    code, out, _ = _run(capsys, "search", "--index", cli_index, "--image", first["image"], "-k", "3", "--json")
    assert code == 0 and json.loads(out)[0]["id"] == first["id"]


def test_user_errors_exit_2_with_one_line(capsys, cli_index, other_run_dir, shapes_dir, tmp_path):
    cases = [
        (["search", "--index", cli_index, "--text", "x", "--run", other_run_dir], "fingerprint"),
        (["search", "--index", tmp_path / "nope", "--text", "x"], "not a triclip index"),
        (["search", "--index", cli_index, "--text", "x", "-k", "0"], "-k"),
        (["search", "--index", cli_index, "--image", tmp_path / "missing.png"], "cannot read query image"),
        (["index", "build", "--run", other_run_dir, "--data", shapes_dir / "val.jsonl", "--out", cli_index, "--add"],
         "fingerprint"),
        (["index", "build", "--run", other_run_dir, "--data", tmp_path / "missing.jsonl", "--out", tmp_path / "o"],
         "not found"),
    ]
    for argv, needle in cases:
        code, out, err = _run(capsys, *argv)
        assert code == 2, argv
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err
