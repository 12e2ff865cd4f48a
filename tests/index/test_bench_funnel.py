"""``python -m benchmarks.bench_funnel`` on a tiny synthetic case and on an index folder: the numbers it reports."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.bench_funnel import main, query_vectors, recall_with_ties
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.store import load_contents


def _results(path) -> dict:
    return {r["method"]: r for r in json.loads(path.read_text())["results"]}


def test_synthetic_funnel_beats_plain_m_and_full_d_is_the_reference(tmp_path):
    out = tmp_path / "bench.json"
    main(["--n", "3000", "--dim", "64", "--queries", "40", "--single", "2", "--rounds", "1", "--factors", "5,300",
          "--json", str(out)])  # fmt: skip
    rows = _results(out)
    exact, blas = rows["full D"], rows["full D (blas)"]
    assert exact["recall_at_10"] == 1.0 and blas["recall_ties"] == 1.0 and blas["family"] == "blas"
    assert max(exact["batch_speedup"], blas["batch_speedup"]) == 1.0  # ratios over the faster exact search
    assert max(exact["single_speedup"], blas["single_speedup"]) == 1.0
    plain, narrow, wide = rows["plain m=8 (Flat)"], rows["funnel 8->D x5 (Flat)"], rows["funnel 8->D x300 (Flat)"]
    assert plain["m"] == 8 and narrow["candidates"] == 50
    assert plain["recall_at_10"] <= narrow["recall_at_10"] <= wide["recall_at_10"]
    assert wide["recall_at_10"] == 1.0 == wide["recall_ties"]  # every vector re-ranked at D: exact
    assert all(r["recall_ties"] >= r["recall_at_10"] for r in rows.values())
    assert all(r["batch_qps"] > 0 and r["single_qps"] > 0 for r in rows.values())


def test_recall_with_ties_counts_a_tied_duplicate_as_a_hit():
    base = np.eye(4, dtype=np.float32)[[0, 1, 1, 2]]  # rows 1 and 2 are the same vector
    queries = np.array([[0.0, 0.6, 0.0, 0.8]], np.float32)  # scores: row 3 0.0... rows 1,2 0.6, row 0 0.0
    tenth = np.array([0.6], np.float32)  # exact top-1 is row 1 (or row 2: a tie)
    assert recall_with_ties(np.array([[2]]), base, queries, tenth) * 10 == pytest.approx(1.0)
    assert recall_with_ties(np.array([[0]]), base, queries, tenth) == 0.0
    assert recall_with_ties(np.array([[-1]]), base, queries, tenth) == 0.0


def test_index_folder_case(tmp_path, run_dir, shapes_dir):
    index = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(index), dims=[8, 16]))
    out = tmp_path / "bench.json"
    main(["--index", str(index), "--queries", "30", "--single", "2", "--rounds", "1", "--factors", "10", "--json", str(out)])
    rows = _results(out)
    assert set(rows) == {"full D", "full D (blas)", "plain m=8 (Flat)", "funnel 8->D x10 (Flat)", "plain m=16 (Flat)",
                         "funnel 16->D x10 (Flat)"}  # fmt: skip
    assert {r["m"] for r in rows.values()} == {8, 16, 32}
    assert all(r["recall_ties"] == 1.0 for r in rows.values() if r["candidates"] >= 90)  # 90 images: all re-ranked
    assert "(titles)" in json.loads(out.read_text())["header"]


def test_query_sets_of_a_folder(tmp_path, run_dir, shapes_dir):
    index = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(index), dims=[8]))
    contents = load_contents(index)
    titles = {row["captions"][0].strip().lower() for row in contents.meta}
    got = query_vectors(contents, "titles", 10_000, 0)
    assert len(got) == len(titles)  # each distinct title once
    assert len(query_vectors(contents, "titles", 5, 0)) == 5
    assert len(query_vectors(contents, "captions", 10_000, 0)) == len(contents.text_vectors)
    with pytest.raises(SystemExit, match="val"):  # built from train.jsonl only
        query_vectors(contents, "val-titles", 10, 0)
