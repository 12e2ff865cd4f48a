"""Export to Milvus (Milvus Lite, a local .db in this process) and search it: the same hits as the index folder.

Every test writes its own .db (Milvus Lite serves one process at a time, and one file per test keeps
them apart). The server path (http://...) is the same client code over gRPC: Milvus Lite answers on a
local port inside this process, so these tests run it too; no Milvus server is started here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from triclip.core.errors import UserError
from triclip.index import milvus as mv
from triclip.index.config import ExportConfig
from triclip.index.milvus_export import count_rows, export
from triclip.index.milvus_search import MilvusSearcher, open_searcher
from triclip.index.search import Searcher
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.vectors import prefix
from tests.index.conftest import split_manifest

QUERIES = ["two red circles", "a small blue square", "green triangles in the top left", "large orange stars"]


@pytest.fixture(scope="module")
def index(run_dir, shapes_dir, tmp_path_factory) -> Path:
    """An index of the shapes train split at m = 8, 16, D = 32, with captions."""
    out = tmp_path_factory.mktemp("milvus") / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), dims=[8, 16]))
    return out


def tree_state(root: Path) -> dict:
    """Every file under ``root``: (size, mtime_ns, sha256), to show an export changed nothing there."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def ids(hits: list[list[dict]]) -> list[list[str]]:
    return [[h["id"] for h in q] for q in hits]


def assert_same_hits(got: list[list[dict]], want: list[list[dict]], atol: float = 1e-5) -> None:
    """Per query the same hits in the same order, each with the same caption, image and score (within ``atol``),
    except where two scores tie within ``atol``: Milvus and FAISS round differently, so either order of a near-tie
    is right, and a hit tied with the last one may stand in for it."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == len(w)
        mine, theirs = ({h["id"]: h for h in hits} for hits in (g, w))
        for hit_id in mine.keys() ^ theirs.keys():  # only a tie at the cut may differ
            hits = g if hit_id in mine else w
            assert abs((mine.get(hit_id) or theirs.get(hit_id))["score"] - hits[-1]["score"]) <= atol, hit_id
        for hit_id in mine.keys() & theirs.keys():
            a, b = mine[hit_id], theirs[hit_id]
            assert (a["caption"], a["image"]) == (b["caption"], b["image"]) and abs(a["score"] - b["score"]) <= atol
        for a, b in zip(g, w):  # place by place: the same hit, or two that tie
            assert a["id"] == b["id"] or abs(a["score"] - b["score"]) <= atol, (a["id"], b["id"])


def test_flat_export_gives_the_local_float_top10(index, tmp_path):
    before = tree_state(index)
    summary = export(ExportConfig(index=str(index), to=str(tmp_path / "t.db"), chunk=16))
    assert tree_state(index) == before  # read only on the index folder
    assert summary["index_type"] == "FLAT" and summary["m"] == 32 and summary["note"] is None
    assert summary["rows_written"] == summary["count"] > 0 and summary["text_rows_written"] == summary["text_count"] > 0
    local = Searcher.load(index)
    remote = open_searcher(str(tmp_path / "t.db"))
    try:
        assert isinstance(remote, MilvusSearcher) and len(remote) == len(local) and remote.has_text
        assert remote.dims == [32] and remote.dim == 32 and "Milvus Lite" in remote.served_from
        for target in ("image", "text"):
            want = local.search_text(QUERIES, k=10, target=target)
            got = remote.search_text(QUERIES, k=10, target=target)
            assert_same_hits(got, want)
            np.testing.assert_allclose([[h["score"] for h in q] for q in got], [[h["score"] for h in q] for q in want],
                                       atol=1e-5)
        first = local.contents.meta[5]["id"]
        assert ids(remote.search_ids([first], k=10)) == ids(local.search_ids([first], k=10))
        assert remote.search_ids([first], k=1)[0][0]["id"] == first
        with pytest.raises(UserError, match="unknown id"):
            remote.search_ids(["no-such-id"], k=3)
        for bad in ({"funnel": 8}, {"bytes": 8}, {"m": 8}):
            with pytest.raises(UserError, match="one index|not in this collection"):
                remote.search_text(QUERIES[:1], k=3, **bad)
    finally:
        remote.close()


def test_the_collection_records_run_version_order_and_manifest(index, tmp_path):
    export(ExportConfig(index=str(index), to=str(tmp_path / "t.db")))
    client = mv.connect(str(tmp_path / "t.db"))
    try:
        props = mv.read_properties(client, "triclip")
        manifest_file = index / "v000001" / "manifest.json"
        manifest = json.loads(manifest_file.read_text())
        assert props["run"] == manifest["run"] and props["fingerprint"] == manifest["fingerprint"]
        assert props["manifest"] == "v000001:" + hashlib.sha256(manifest_file.read_bytes()).hexdigest()[:16]
        assert props["complete"] == props["manifest"] and int(props["done"]) == manifest["count"]
        assert json.loads(props["order"]) == manifest["transform"]["keep"] and props["m"] == "32"
        assert json.loads(props["importance"]) == manifest["importance"]
        assert mv.decode_blob(props, "transform") == manifest["transform"]
        client.load_collection("triclip")
        client.load_collection("triclip_captions")
        assert count_rows(client, "triclip") == manifest["count"]
        assert count_rows(client, "triclip_captions") == manifest["text_count"]
        row = client.query("triclip", ids=[3], output_fields=["id", "image", "captions", "label", "file"])[0]
        meta = [json.loads(line) for line in (index / "v000001" / "meta.jsonl").read_text().splitlines()]
        assert row["id"] == meta[3]["id"] and row["image"] == meta[3]["image"]
        assert json.loads(row["captions"]) == meta[3]["captions"] and json.loads(row["file"]) == meta[3]["file"]
        assert json.loads(row["label"]) == meta[3].get("label")
    finally:
        mv.close(client)


def test_a_second_export_writes_nothing_and_add_then_export_writes_only_the_new_rows(run_dir, shapes_dir, tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    split_manifest(shapes_dir / "train.jsonl", first, second, at=50)
    out, db = tmp_path / "index", str(tmp_path / "t.db")
    build_index(IndexBuildConfig(run=str(run_dir), data=str(first), out=str(out), dims=[8]))
    one = export(ExportConfig(index=str(out), to=db, chunk=7))
    assert one["rows_written"] == one["count"] == 50
    again = export(ExportConfig(index=str(out), to=db, chunk=7))
    assert again["rows_written"] == 0 and again["text_rows_written"] == 0 and again["resumed_from"] == 50
    build_index(IndexBuildConfig(run=str(run_dir), data=str(second), out=str(out), add=True))
    added = export(ExportConfig(index=str(out), to=db, chunk=7))
    local = Searcher.load(out)
    new_captions = len(local.contents.text_rows) - one["text_count"]
    assert added["version"] == "v000002" and added["resumed_from"] == 50
    assert added["rows_written"] == len(local) - 50 > 0 and added["text_rows_written"] == new_captions > 0
    remote = open_searcher(db)
    try:
        assert len(remote) == len(local) and remote.contents.version == "v000002"
        assert ids(remote.search_text(QUERIES, k=10)) == ids(local.search_text(QUERIES, k=10))
        newest = local.contents.meta[-1]["id"]
        assert remote.search_ids([newest], k=1)[0][0]["id"] == newest  # an added row is there
    finally:
        remote.close()


def test_a_budget_maps_to_a_milvus_index_and_says_what_stands_in(run_dir, shapes_dir, tmp_path):
    out = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), bytes=[4],
                                 codec="binary"))
    spec = json.loads((out / "v000001" / "manifest.json").read_text())["budgets"]["4"]["spec"]
    db = str(tmp_path / "t.db")
    with pytest.raises(UserError, match=r"no codes of that many bytes; choose from \[4\]"):
        export(ExportConfig(index=str(out), to=db, bytes=8))
    summary = export(ExportConfig(index=str(out), to=db, bytes=4, nlist=4, nprobe=4))
    assert summary["index_type"] == "IVF_SQ8" and summary["m"] == spec["m"] and summary["params"] == {"nlist": 4}
    assert "Milvus Lite has no index for binary" in summary["note"] and "IVF_SQ8" in summary["note"]
    remote = open_searcher(db)
    local = Searcher.load(out)
    try:
        assert remote.dims == [spec["m"]] and "4 B budget" in remote.served_from
        queries = local.embed_texts(QUERIES * 3)  # (Q, D)
        got = ids(remote.search_vectors(queries, k=10))
        exact = np.argsort(-(prefix(queries, spec["m"]) @ prefix(np.asarray(local.contents.vectors), spec["m"]).T), axis=1)
        want = [[local.contents.meta[i]["id"] for i in row[:10]] for row in exact]
        overlap = np.mean([len(set(g) & set(w)) / 10 for g, w in zip(got, want)])
        assert overlap >= 0.9, overlap  # IVF_SQ8, every list probed, against exact search at the same m
    finally:
        remote.close()


def test_a_rolled_back_version_is_refused_naming_the_live_one(run_dir, shapes_dir, tmp_path):
    from triclip.index.store import rollback

    out, db = tmp_path / "index", str(tmp_path / "t.db")
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "val.jsonl"), out=str(out)))
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), overwrite=True))
    assert export(ExportConfig(index=str(out), to=db))["version"] == "v000002"
    rollback(out)
    before = tree_state(out)
    with pytest.raises(UserError, match=r"holds version v000002 .* newer than its live version v000001") as err:
        export(ExportConfig(index=str(out), to=db))
    assert "\n" not in str(err.value) and tree_state(out) == before
    assert export(ExportConfig(index=str(out), to=db, overwrite=True))["version"] == "v000001"


def test_another_run_or_dimension_is_refused_on_export_and_search(index, run_dir, other_run_dir, shapes_dir, tmp_path):
    db = str(tmp_path / "t.db")
    export(ExportConfig(index=str(index), to=db))
    other = tmp_path / "other"
    build_index(IndexBuildConfig(run=str(other_run_dir), data=str(shapes_dir / "val.jsonl"), out=str(other)))
    with pytest.raises(UserError, match="holds vectors of run .*run_a.* not of this index's run .*run_b"):
        export(ExportConfig(index=str(other), to=db))
    with pytest.raises(UserError, match="is not the run"):
        open_searcher(db, run=str(other_run_dir))  # queries embedded by another run: refused
    budget = tmp_path / "budget"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "val.jsonl"), out=str(budget), bytes=[4],
                                 codec="int8"))
    with pytest.raises(UserError, match="holds vectors of dimension 32"):
        export(ExportConfig(index=str(budget), to=db, bytes=4))


def test_a_missing_run_is_refused_in_one_line(run_dir, shapes_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    out, db = tmp_path / "index", str(tmp_path / "t.db")
    build_index(IndexBuildConfig(run=str(run), data=str(shapes_dir / "val.jsonl"), out=str(out)))
    export(ExportConfig(index=str(out), to=db))
    shutil.rmtree(run)
    with pytest.raises(UserError) as err:
        open_searcher(db)
    assert str(run) in str(err.value) and "\n" not in str(err.value)


def test_uris_collections_and_options_are_checked(index, tmp_path):
    assert mv.is_milvus_uri("http://h:19530") and mv.is_milvus_uri(str(tmp_path / "x.db"))
    assert not mv.is_milvus_uri(str(index)) and not mv.is_milvus_uri("some/folder")
    for bad, needle in [("ftp://x", "not a Milvus URI"), (str(tmp_path / "no" / "x.db"), "does not exist")]:
        with pytest.raises(UserError, match=needle):
            export(ExportConfig(index=str(index), to=bad))
    (tmp_path / "file.db").write_text("not Lite")
    with pytest.raises(UserError, match="is a file"):
        export(ExportConfig(index=str(index), to=str(tmp_path / "file.db")))
    for field, value, needle in [("collection", "9bad-name", "not a Milvus collection name"), ("chunk", 0, "--chunk"),
                                 ("nlist", 0, "--nlist"), ("timeout", 0.0, "--timeout")]:
        with pytest.raises(UserError, match=needle):
            export(ExportConfig(index=str(index), to=str(tmp_path / "t.db"), **{field: value}))
    with pytest.raises(UserError, match="no such Milvus Lite file"):
        open_searcher(str(tmp_path / "never.db"))
    assert not (tmp_path / "never.db").exists()
    mv.close(mv.connect(str(tmp_path / "t.db")))  # a Milvus Lite file with no collection
    with pytest.raises(UserError, match="no collection 'nope'"):
        open_searcher(str(tmp_path / "t.db"), collection="nope")
    with pytest.raises(UserError, match="holds no collection written by triclip"):
        open_searcher(str(tmp_path / "t.db"))
    with pytest.raises(UserError, match="--collection goes with a Milvus"):
        open_searcher(str(index), collection="x")


def test_the_cli_exports_and_searches_a_milvus_uri(index, tmp_path, capsys):
    from triclip.app.cli import main

    db = str(tmp_path / "t.db")
    assert main(["index", "export", "--index", str(index), "--to", db, "--collection", "shapes", "--chunk", "25"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["collection"] == "shapes" and summary["captions"] == "shapes_captions"
    assert summary["rows_written"] == summary["count"]
    assert main(["search", "--index", db, "--text", QUERIES[0], "-k", "5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["search", "--index", str(index), "--text", QUERIES[0], "-k", "5", "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert_same_hits([got], [want])
    assert main(["search", "--index", db, "--collection", "shapes", "--text", QUERIES[0], "--funnel", "8"]) == 2
    assert "no --funnel, --bytes or --rescore" in capsys.readouterr().err
