"""The acceptance path on a trained run: train tricl on shapes, index at --dims 8, search (slow)."""

from __future__ import annotations

import json

import pytest

from triclip.app.cli import main

QUERIES = ["two small red circles in the top left", "three large blue squares", "a green star", "one purple triangle"]


def _json(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_trained_tricl_run_indexes_and_searches(capsys, tmp_path, shapes_dir, monkeypatch):
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    train = shapes_dir / "train.jsonl"
    code = main(["train", "--train-data", str(train), "--model", "tiny", "--loss", "tricl",
                 "--epochs", "2", "--batch-size", "30", "--out", str(run)])  # fmt: skip
    assert code == 0
    capsys.readouterr()
    for factory in ("Flat", "HNSW32"):
        summary = _json(capsys, "index", "build", "--run", run, "--data", train, "--out", tmp_path / factory,
                        "--dims", 8, "--factory", factory)  # fmt: skip
        assert (summary["dims"][0], summary["factories"]["8"]) == (8, factory)
    for query in QUERIES:
        rows = {
            f: _json(capsys, "search", "--index", tmp_path / f, "--text", query, "-k", 10, "--m", 8, "--json")
            for f in ("Flat", "HNSW32")
        }
        for hits in rows.values():
            assert len(hits) == 10 and all(set(h) == {"id", "image", "caption", "score"} for h in hits)
            assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        overlap = len({h["id"] for h in rows["Flat"]} & {h["id"] for h in rows["HNSW32"]}) / 10
        assert overlap >= 0.8
    meta = [json.loads(line) for line in (tmp_path / "Flat" / "v000001" / "meta.jsonl").read_text().splitlines()]
    for row in meta[:5]:
        hits = _json(capsys, "search", "--index", tmp_path / "Flat", "--image", row["image"], "-k", 3, "--json")
        assert hits[0]["id"] == row["id"]
