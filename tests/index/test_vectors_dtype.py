"""The full-D vectors kept as float16 (``index build --vectors``): chosen by the free disk, refused before any work
when they do not fit, recorded and checked by the manifest, and searched with the float32 answers."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from benchmarks.vectors_dtype import measure
from triclip.core.errors import UserError
from triclip.index import vectors as vec
from triclip.index.milvus_export import _mapped
from triclip.index.search import Searcher
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.store import MANIFEST, current_version, load_contents
from triclip.index.vectors import stored_dtype
from tests.index.test_from_embeddings import emb  # noqa: F401 (the same fixture)

GB = 10**9


def test_the_dtype_follows_the_free_disk_and_a_dtype_that_does_not_fit_is_refused(tmp_path):
    rows, dim = 1_000_000, 256  # float32 1.024 GB, float16 0.512 GB
    assert stored_dtype("auto", rows, dim, tmp_path, free=2 * GB) == "float32"
    assert stored_dtype("auto", rows, dim, tmp_path, free=GB) == "float16"  # float32 is 1.024 GB
    assert stored_dtype("float16", rows, dim, tmp_path, free=2 * GB) == "float16"
    with pytest.raises(UserError, match=r"1\.0 GB as float32 or 0\.5 GB as float16 or 0\.3 GB as sq8 on disk.* 0\.2 GB free"):
        stored_dtype("auto", rows, dim, tmp_path, free=GB // 5)
    with pytest.raises(UserError, match=r"need 1\.0 GB as float32 on disk"):
        stored_dtype("float32", rows, dim, tmp_path, free=GB)
    assert stored_dtype("auto", 100, 32, tmp_path) == "float32"  # this disk, measured


def test_half_a_step_of_float16_bounds_the_change_of_an_inner_product_of_unit_vectors():
    """What ``--vectors float16``'s help promises: |q.x - q.fp16(x)| <= 2^-11 for unit q and x."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20_000, 256)).astype(np.float32)
    x[:10_000, 64:] *= 1e-3  # rows whose mass sits in a prefix, as importance-ordered vectors do
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[:200] + 0.3 * x[200:400]
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    change = np.abs(q @ x.T - q @ x.astype(np.float16).astype(np.float32).T)  # (200, 20000)
    assert 2**-16 < change.max() <= 2**-11


@pytest.fixture(scope="module")
def both(emb, tmp_path_factory):  # noqa: F811
    """The same embeddings built with float32 and with float16 vectors, with codes of 8 B re-ranked by them."""
    root = tmp_path_factory.mktemp("dtypes")
    for dtype in ("float32", "float16"):
        build_index(IndexBuildConfig(embeddings=str(emb), out=str(root / dtype), dims=[8], bytes=[8], factory="Flat",
                                     vectors=dtype))
    return root


def test_a_float16_build_records_its_dtype_halves_the_files_and_answers_as_float32_does(both):
    folders = {d: both / d / current_version(both / d) for d in ("float32", "float16")}
    for dtype, folder in folders.items():
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest["vectors_dtype"] == dtype
        row = np.load(folder / "vectors.npy", mmap_mode="r")[0]
        assert row.dtype == dtype
        reranks = [c for c in json.loads((folder / "curves.json").read_text())["bytes"]["candidates"]["8"]
                   if c.get("shortlist")]
        assert reranks and all(c["disk_bytes_per_query"] == row.nbytes * c["shortlist"] for c in reranks)
    for name in ("vectors.npy", "text_vectors.npy"):
        half, full = ((folders[d] / name).stat().st_size for d in ("float16", "float32"))
        assert half < 0.51 * full
    a, b = Searcher.load(both / "float32"), Searcher.load(both / "float16")
    ids = [row["id"] for row in a.contents.meta[:30]]
    assert b.vectors_of(ids).dtype == np.float32
    np.testing.assert_allclose(b.vectors_of(ids), a.vectors_of(ids), atol=2**-11)
    queries = np.asarray(a.contents.text_vectors[:40], np.float32)  # (40, D)
    for how in ({"funnel": 8}, {"bytes": 8, "rescore": "float"}, {}):
        want, got = a.search_vectors(queries, k=5, **how), b.search_vectors(queries, k=5, **how)
        for w, g in zip(want, got):
            assert [h["id"] for h in w][:1] == [h["id"] for h in g][:1]
            scores = {h["id"]: h["score"] for h in w}
            assert all(abs(h["score"] - scores[h["id"]]) <= 2**-11 for h in g if h["id"] in scores)
        assert np.mean([len({h["id"] for h in w} & {h["id"] for h in g}) / 5 for w, g in zip(want, got)]) >= 0.9
    assert [h["id"] for h in b.search_ids(ids[:5], k=1)[0]] == ids[:1]  # an image finds itself first


def test_a_manifest_that_does_not_vouch_for_the_vectors_dtype_is_refused(both, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(both / "float32", copy)
    manifest_file = copy / current_version(copy) / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["vectors_dtype"] = "float16"  # the file holds float32
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"vectors.npy holds float32 .* expected float16"):
        load_contents(copy)
    manifest["vectors_dtype"] = "int4"
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"dtype as 'int4'"):
        load_contents(copy)


def test_the_milvus_export_reads_float16_rows_as_float32(both):
    folder = both / "float16" / current_version(both / "float16")
    stored = np.load(folder / "vectors.npy")
    rows = _mapped(folder / "vectors.npy", stored.shape, lambda what: UserError(what))
    got = rows[3:11]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, stored[3:11].astype(np.float32))


def test_auto_keeps_float16_when_float32_would_not_fit_and_refuses_before_any_work(emb, tmp_path, monkeypatch):  # noqa: F811
    contents = load_contents(_build(emb, tmp_path / "probe", "float32"))
    need32 = 4 * contents.vectors.shape[1] * (len(contents.vectors) + len(contents.text_vectors))
    Usage = namedtuple("Usage", "total used free")  # the free disk given: between float16's size and float32's
    monkeypatch.setattr(vec.shutil, "disk_usage", lambda where: Usage(0, 0, need32 * 3 // 4))
    out = _build(emb, tmp_path / "auto", "auto")
    assert load_contents(out).manifest["vectors_dtype"] == "float16"
    monkeypatch.setattr(vec.shutil, "disk_usage", lambda where: Usage(0, 0, need32 // 5))  # under sq8's quarter
    with pytest.raises(UserError, match="free some space") as err:
        _build(emb, tmp_path / "none", "auto")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "none").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".none")]  # no parts folder left behind


def _build(emb: Path, out: Path, dtype: str) -> Path:  # noqa: F811
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(out), vectors=dtype))
    return out


def test_add_keeps_the_index_float16_and_refuses_another_precision(tmp_path, run_dir, shapes_dir):
    from tests.index.conftest import split_manifest

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    split_manifest(shapes_dir / "train.jsonl", first, second, at=50)
    out = tmp_path / "grown"
    common = dict(run=str(run_dir), out=str(out), factory="Flat")
    build_index(IndexBuildConfig(data=str(first), vectors="float16", **common))
    with pytest.raises(UserError, match="--vectors do not apply"):
        build_index(IndexBuildConfig(data=str(second), add=True, vectors="float32", **common))
    summary = build_index(IndexBuildConfig(data=str(second), add=True, **common))
    grown = load_contents(out)
    assert summary["added"] == len(grown.vectors) - 50 > 0 and grown.manifest["vectors_dtype"] == "float16"
    assert grown.vectors.dtype == grown.text_vectors.dtype == np.float16


def test_float16_rows_move_scores_by_at_most_half_a_step_and_rows_already_float16_move_nothing(emb, tmp_path):  # noqa: F811
    """``benchmarks.vectors_dtype`` on a real index: what float16 rows change in an exact search."""
    out = tmp_path / "index"
    build_index(IndexBuildConfig(embeddings=str(emb), out=str(out), factory="Flat"))
    got = measure(str(out), k=5, queries=100)
    dim = got["dim"]
    assert got["queries"] == 100 and got["bytes_per_row"] == {"float32": 4 * dim, "float16": 2 * dim, "sq8": dim}
    half = got["float16"]
    assert 0 < half["max_score_change"] <= 2**-11 and half["max_shortfall"] <= 2 * 2**-11
    assert 0.9 <= half["top_k_kept"] <= 1 and (half["top_k_kept"] == 1) == (half["queries_changed"] == 0)
    for name in ("sq8", "sq8 unrotated"):  # its half a step bound: tests/index/test_vectors_sq8.py
        sq8 = got[name]
        assert 0 < sq8["max_score_change"] < 0.05 and 0.5 <= sq8["top_k_kept"] <= 1
        assert (sq8["top_k_kept"] == 1) == (sq8["queries_changed"] == 0)
    assert set(got["t2i_recall"]) == {"float32", "float16", "sq8", "sq8 unrotated"}
    half = _build(emb, tmp_path / "half", "float16")  # its rows are what float16 holds: nothing moves
    same = measure(str(half), k=5, queries=100)["float16"]
    assert same["max_score_change"] == 0 and same["top_k_kept"] == 1
