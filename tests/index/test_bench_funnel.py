"""``python -m benchmarks.bench_funnel`` on a tiny synthetic case and on an index folder: the numbers it reports."""

from __future__ import annotations

import json

from benchmarks.bench_funnel import main
from index.build import IndexBuildConfig, build_index


def _results(path) -> dict:
    return {r["method"]: r for r in json.loads(path.read_text())["results"]}


def test_synthetic_funnel_beats_plain_m_and_full_d_is_the_reference(tmp_path):
    out = tmp_path / "bench.json"
    main(["--n", "3000", "--dim", "64", "--queries", "40", "--single", "2", "--rounds", "1", "--factors", "5,300",
          "--json", str(out)])  # fmt: skip
    rows = _results(out)
    assert rows["full D"]["recall_at_10"] == 1.0 and rows["full D"]["batch_speedup"] == 1.0
    plain, narrow, wide = rows["plain m=8 (Flat)"], rows["funnel 8->D x5 (Flat)"], rows["funnel 8->D x300 (Flat)"]
    assert plain["m"] == 8 and narrow["candidates"] == 50
    assert plain["recall_at_10"] <= narrow["recall_at_10"] <= wide["recall_at_10"]
    assert wide["recall_at_10"] == 1.0  # every vector re-ranked at D: exact
    assert all(r["batch_qps"] > 0 and r["single_qps"] > 0 for r in rows.values())


def test_index_folder_case(tmp_path, run_dir, shapes_dir):
    index = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(index), dims=[8, 16]))
    out = tmp_path / "bench.json"
    main(["--index", str(index), "--queries", "30", "--single", "2", "--rounds", "1", "--factors", "10", "--json", str(out)])
    rows = _results(out)
    assert set(rows) == {"full D", "plain m=8 (Flat)", "funnel 8->D x10 (Flat)", "plain m=16 (Flat)", "funnel 16->D x10 (Flat)"}
    assert {r["m"] for r in rows.values()} == {8, 16, 32}
    assert all(r["recall_at_10"] == 1.0 for r in rows.values() if r["candidates"] >= 90)  # 90 images: all re-ranked
