"""The demo end to end on a few hundred real openclipart records (slow: real lite towers)."""

import json
import os

import pytest

from app.demo import DemoConfig, run_demo

pytestmark = pytest.mark.slow


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))


def test_demo_builds_run_and_index_then_reuses_everything(tmp_path, own_cache, capsys):
    if not os.path.isdir("/usr/share/openclipart/png"):
        pytest.skip("Debian openclipart-png is not installed (scripts/setup.sh installs it)")
    cfg = DemoConfig(workdir=str(tmp_path / "demo"), num=240, epochs=2, dims=[16, 64, 256], serve=False)
    first = run_demo(cfg)
    assert first["metrics"]["t2i_r10"] > 0.0
    from index.search import Searcher

    searcher = Searcher.load(first["index"])
    assert searcher.dims == [16, 64, 256]
    records = sum(1 for split in ("train", "val") for _ in open(tmp_path / "demo" / "data" / f"{split}.jsonl"))
    assert len(searcher) == records  # every image of both splits, nothing dropped or doubled
    hit = searcher.search_text(["a red apple"], k=3, m=16)[0]
    assert len(hit) == 3 and hit[0]["score"] >= hit[-1]["score"]

    run = tmp_path / "demo" / "run"
    stamps = {p.name: p.stat().st_mtime_ns for p in [run / "model.safetensors", run / "metrics.jsonl"]}
    cache_files = sorted(os.listdir(tmp_path / "cache" / "features"))
    capsys.readouterr()
    second = run_demo(cfg)  # everything is there: nothing is trained, cached or indexed again
    assert second["metrics"] == json.loads(json.dumps(first["metrics"]))
    assert {p: (run / p).stat().st_mtime_ns for p in stamps} == stamps
    assert sorted(os.listdir(tmp_path / "cache" / "features")) == cache_files
    assert "caching locked" not in capsys.readouterr().err
