"""``index build`` and ``Searcher`` on tiny shapes data with a tiny (untrained) run."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import pytest
import torch
from PIL import Image

from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.search import SHORTLIST_FACTOR, Searcher
from triclip.index.store import MANIFEST, load_contents
from triclip.compact.features import importance_order, sign_flips, topm_embed
from triclip.data import load_pairs
from triclip.core.errors import UserError
from tests.index.conftest import EMBED_DIM, split_manifest
from triclip.training.checkpoint import load_run

M = 8
QUERIES = ["two small red circles in the top left", "three large blue squares", "a green star", "one purple triangle"]


def _build(run, data, out, **kw) -> dict:
    return build_index(IndexBuildConfig(run=str(run), data=str(data), out=str(out), **kw))


@pytest.fixture(scope="module")
def flat_index(tmp_path_factory, run_dir, shapes_dir):
    out = tmp_path_factory.mktemp("idx") / "flat"
    summary = _build(run_dir, shapes_dir / "train.jsonl", out, dims=[M, 16], factory="Flat")
    return out, summary


@pytest.fixture(scope="module")
def searcher(flat_index):
    return Searcher.load(flat_index[0])


@pytest.fixture(scope="module")
def reference(run_dir, shapes_dir):
    """Compact vectors computed straight from the definition (docs/CONTRACT.md "Compact features")."""
    model, _ = load_run(run_dir)
    pairs = load_pairs(shapes_dir / "train.jsonl")
    transform = model.image_transform(train=False)
    with torch.no_grad():
        images = torch.stack([transform(r.open_image()) for r in pairs.records])
        z = model.encode_image(images)  # (N, D)
        w = model.importance()
        compact = topm_embed(z, w, importance_order(w), M)  # (N, m)
        signs = sign_flips(compact)  # anchors: the indexed images in order
        queries = topm_embed(model.encode_text(QUERIES), w, importance_order(w), M) * signs  # (Q, m)
        full = topm_embed(z, w, importance_order(w), EMBED_DIM)  # (N, D)
        full = full * sign_flips(full)
    return pairs, (compact * signs).numpy(), queries.numpy(), full.numpy()


def test_build_writes_index_meta_and_manifest(flat_index, run_dir, shapes_dir):
    out, summary = flat_index
    pairs = load_pairs(shapes_dir / "train.jsonl")
    n_captions = sum(len(r.captions) for r in pairs.records)
    assert summary["count"] == summary["added"] == len(pairs.records)
    assert summary["text_count"] == n_captions and summary["dims"] == [M, 16, EMBED_DIM] and summary["dim"] == EMBED_DIM
    assert (out / "CURRENT").read_text().strip() == "v000001"
    manifest = json.loads((out / "v000001" / MANIFEST).read_text())
    assert manifest["run"] == os.path.abspath(run_dir) and manifest["ordering"] == "importance"
    assert (manifest["dims"], manifest["dim"], manifest["metric"]) == ([M, 16, EMBED_DIM], EMBED_DIM, "inner_product")
    assert manifest["factories"] == {str(m): "Flat" for m in (M, 16, EMBED_DIM)}
    curves = json.loads((out / "v000001" / "curves.json").read_text())  # measured by the build: every m has one
    assert manifest["recall"] == {str(m): curves["curves"]["importance"][str(m)] for m in (M, 16, EMBED_DIM)}
    w = load_run(run_dir)[0].importance().detach()
    np.testing.assert_allclose(manifest["importance"], w.sort(descending=True).values.numpy(), atol=1e-5)
    contents = load_contents(out)
    assert [row["id"] for row in contents.meta] == [r.key for r in pairs.records]
    assert [row["image"] for row in contents.meta] == [r.path for r in pairs.records]
    assert contents.vectors.shape == (len(pairs.records), EMBED_DIM) and contents.text_vectors.shape == (n_captions, EMBED_DIM)
    assert all(contents.text_indexes[m].ntotal == n_captions for m in (M, 16, EMBED_DIM))
    assert contents.text_rows.shape == (n_captions, 2)
    assert sorted(os.listdir(out)) == [".lock", ".triclip.json", "CURRENT", "v000001"]  # no temporary leftovers


def test_indexed_vectors_are_the_signed_topm_embedding(flat_index, reference):
    _, vectors, _, full = reference
    contents = load_contents(flat_index[0])
    index = contents.image_indexes[M]
    stored = index.reconstruct_n(0, index.ntotal)
    np.testing.assert_allclose(stored, vectors, atol=1e-5)  # the top-m embedding is the re-normalised prefix
    np.testing.assert_allclose(contents.vectors, full, atol=1e-5)
    assert (stored[0] > 0).all() and (contents.vectors[0] > 0).all()  # the sign fix: the first image anchors


def test_text_search_is_sorted_and_exact(searcher, reference):
    _, vectors, queries, _ = reference
    results = searcher.search_text(QUERIES, k=10, m=M)
    assert len(results) == len(QUERIES)
    for hits, q in zip(results, queries):
        assert len(hits) == 10 and all(set(h) == {"id", "image", "caption", "score"} for h in hits)
        scores = [h["score"] for h in hits]
        assert scores == sorted(scores, reverse=True)
        exact = vectors @ q  # (N,)
        rows = [searcher.contents.meta.index(next(m for m in searcher.contents.meta if m["id"] == h["id"])) for h in hits]
        np.testing.assert_allclose(scores, exact[rows], atol=1e-5)
        assert scores[0] == pytest.approx(exact.max(), abs=1e-5)


def test_indexed_image_finds_itself_first(searcher):
    rows = [0, 17, 45, 89]
    paths = [searcher.contents.meta[r]["image"] for r in rows]
    for row, hits in zip(rows, searcher.search_image(paths, k=3)):
        assert hits[0]["id"] == searcher.contents.meta[row]["id"]
        assert hits[0]["score"] == pytest.approx(1.0, abs=1e-4)


def test_image_to_text_returns_captions_of_indexed_images(searcher):
    meta = searcher.contents.meta
    hits = searcher.search_image([meta[3]["image"]], k=5, target="text")[0]
    assert len(hits) == 5
    by_id = {m["id"]: m for m in meta}
    for h in hits:
        assert h["caption"] in by_id[h["id"]]["captions"]
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)


def test_flat_and_hnsw_agree_on_the_top10(tmp_path, run_dir, shapes_dir, searcher):
    out = tmp_path / "hnsw"
    summary = _build(run_dir, shapes_dir / "train.jsonl", out, dims=M, factory="HNSW32", text_index=False)
    assert summary["factories"] == {str(M): "HNSW32", str(EMBED_DIM): "HNSW32"}
    hnsw = Searcher.load(out)
    assert isinstance(faiss.downcast_index(hnsw.contents.image_indexes[M]), faiss.IndexHNSW)
    overlaps = []
    for a, b in zip(searcher.search_text(QUERIES, k=10, m=M), hnsw.search_text(QUERIES, k=10, m=M)):
        overlaps.append(len({h["id"] for h in a} & {h["id"] for h in b}) / 10)
    assert min(overlaps) >= 0.8
    with pytest.raises(UserError, match="no caption vectors"):
        hnsw.search_text(QUERIES[:1], k=3, target="text")


def test_save_load_round_trip(flat_index, searcher):
    again = Searcher.load(flat_index[0])
    assert again.search_text(QUERIES, k=7) == searcher.search_text(QUERIES, k=7)
    assert len(again) == len(searcher) and again.transform.to_dict() == searcher.transform.to_dict()
    assert (again.dims, again.dim, again.has_text) == ([M, 16, EMBED_DIM], EMBED_DIM, True)


def test_mismatched_run_is_refused(flat_index, other_run_dir, run_dir):
    manifest = Searcher.load(flat_index[0]).manifest
    with pytest.raises(UserError) as err:
        Searcher.load(flat_index[0], run=other_run_dir)
    assert manifest["fingerprint"] in str(err.value) and str(other_run_dir) in str(err.value)
    with pytest.raises(UserError, match="not a triclip run"):
        Searcher.load(flat_index[0], run=flat_index[0])


def test_add_appends_and_matches_one_build(tmp_path, run_dir, other_run_dir, shapes_dir, searcher):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    split_manifest(shapes_dir / "train.jsonl", first, second, at=50)
    out = tmp_path / "grown"
    assert _build(run_dir, first, out, dims=M, factory="Flat")["count"] == 50  # an int is one m
    summary = _build(run_dir, second, out, add=True)
    assert (summary["count"], summary["added"], summary["dims"]) == (len(searcher), len(searcher) - 50, [M, EMBED_DIM])
    grown = Searcher.load(out)
    # the transform (order, weights, signs) comes from the first build: same vectors as one build
    for a, b in zip(grown.search_text(QUERIES, k=10, m=M), searcher.search_text(QUERIES, k=10, m=M)):
        assert [h["score"] for h in a] == pytest.approx([h["score"] for h in b], abs=1e-5)
        assert {os.path.basename(h["image"]) for h in a} == {os.path.basename(h["image"]) for h in b}
    assert grown.contents.text_indexes[M].ntotal == len(grown.contents.text_vectors) == len(searcher.contents.text_vectors)
    np.testing.assert_allclose(grown.contents.vectors[:50], searcher.contents.vectors[:50], atol=1e-6)
    again = _build(run_dir, second, out, add=True)  # nothing new
    assert (again["added"], again["already_indexed"], again["count"]) == (0, len(searcher) - 50, len(searcher))
    with pytest.raises(UserError, match=r"m = \[8, 32\]"):
        _build(run_dir, second, out, add=True, dims=4)
    with pytest.raises(UserError, match="fingerprint"):
        _build(other_run_dir, second, out, add=True)
    with pytest.raises(UserError, match="factory"):
        _build(run_dir, second, out, add=True, factory="HNSW32")
    with pytest.raises(UserError, match="existing index"):
        _build(run_dir, second, tmp_path / "none", add=True)


def test_bad_settings_leave_existing_files_alone(tmp_path, run_dir, shapes_dir):
    data = shapes_dir / "val.jsonl"
    keep = tmp_path / "notes"
    keep.mkdir()
    (keep / "mine.txt").write_text("precious")
    with pytest.raises(UserError, match="refusing to overwrite"):
        _build(run_dir, data, keep)
    assert (keep / "mine.txt").read_text() == "precious"
    out = tmp_path / "idx"
    _build(run_dir, data, out, dims=4, factory="Flat")
    before = (out / "v000001" / MANIFEST).read_text()
    with pytest.raises(UserError, match="factory"):
        _build(run_dir, data, out, factory="Bogus99", overwrite=True)
    with pytest.raises(UserError, match="exceeds"):
        _build(run_dir, data, out, dims=EMBED_DIM + 1, overwrite=True)
    with pytest.raises(UserError, match="--dims"):
        _build(run_dir, data, out, dims=0, overwrite=True)
    assert (out / "CURRENT").read_text().strip() == "v000001" and (out / "v000001" / MANIFEST).read_text() == before
    with pytest.raises(UserError, match="-k"):
        Searcher.load(out).search_text(["x"], k=0)
    with pytest.raises(UserError, match="cannot read query image"):
        Searcher.load(out).search_image([tmp_path / "missing.png"], k=1)
    with pytest.raises(UserError, match="not a triclip index"):
        Searcher.load(tmp_path)


def test_full_dimension_and_funnel_search_are_exact_at_d(searcher, reference):
    _, _, _, full = reference
    queries = searcher.embed_texts(QUERIES)  # (Q, D)
    exact = queries @ full.T  # (Q, N)
    plain = searcher.search_text(QUERIES, k=10)  # m=None: D
    searcher.shortlist_factor = 10  # 100 candidates of 90: the funnel sees everything
    funnel = searcher.search_text(QUERIES, k=10, funnel=M)
    for q, (a, b) in enumerate(zip(plain, funnel)):
        want = np.sort(exact[q])[::-1][:10]
        np.testing.assert_allclose([h["score"] for h in a], want, atol=1e-5)
        np.testing.assert_allclose([h["score"] for h in b], want, atol=1e-5)  # re-ranked at D, not at m
    searcher.shortlist_factor = 2  # 20 candidates: the re-rank is still exact on them
    narrow = searcher.search_text(QUERIES, k=10, funnel=M)
    for q, hits in enumerate(narrow):
        rows = [searcher._rows[h["id"]] for h in hits]
        np.testing.assert_allclose([h["score"] for h in hits], exact[q, rows], atol=1e-5)
    searcher.shortlist_factor = SHORTLIST_FACTOR


def test_search_ids_and_pil_images_match_file_queries(searcher):
    meta = searcher.contents.meta
    by_id = searcher.search_ids([meta[4]["id"], meta[30]["id"]], k=5, m=16)
    assert [hits[0]["id"] for hits in by_id] == [meta[4]["id"], meta[30]["id"]]
    assert by_id[0][0]["score"] == pytest.approx(1.0, abs=1e-5)
    by_file = searcher.search_image([meta[4]["image"], meta[30]["image"]], k=5, m=16)
    with Image.open(meta[4]["image"]) as im:
        by_pil = searcher.search_image([im.copy(), meta[30]["image"]], k=5, m=16)
    for a, b, c in zip(by_id, by_file, by_pil):
        assert [h["id"] for h in a] == [h["id"] for h in b] == [h["id"] for h in c]
        np.testing.assert_allclose([h["score"] for h in b], [h["score"] for h in c], atol=1e-5)
    texts = searcher.search_ids([meta[4]["id"]], k=3, target="text", funnel=M)[0]
    assert len(texts) == 3 and all(h["caption"] in {c for r in meta for c in r["captions"]} for h in texts)


def test_concurrent_searches_match_single_threaded(searcher):
    meta = searcher.contents.meta
    calls = [("text", [q], m, f) for q in QUERIES for m, f in ((None, None), (M, None), (16, None), (None, M))]
    calls += [("ids", [meta[i]["id"]], 16, None) for i in range(0, 90, 9)]
    calls += [("image", [meta[i]["image"]], M, None) for i in range(3, 90, 20)]

    def one(call):
        kind, queries, m, funnel = call
        fn = {"text": searcher.search_text, "ids": searcher.search_ids, "image": searcher.search_image}[kind]
        return fn(queries, k=7, m=m, funnel=funnel)

    expected = [one(c) for c in calls]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(3):
            assert list(pool.map(one, calls * 2)) == expected * 2


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda s: s.search_text([""]), "empty text query"),
        (lambda s: s.search_text(["   "]), "empty text query"),
        (lambda s: s.search_text(["x" * 20_000]), "too long"),
        (lambda s: s.search_text("a string, not a list"), "list of strings"),
        (lambda s: s.search_text(["x"], m=12), r"m=12 is not indexed here; choose from \[8, 16, 32\]"),
        (lambda s: s.search_text(["x"], funnel=64), "funnel=64 is not indexed"),
        (lambda s: s.search_text(["x"], target="both"), "unknown search target"),
        (lambda s: s.search_text(["x"], k=0), "-k"),
        (lambda s: s.search_ids(["no-such-id"]), "unknown id"),
        (lambda s: s.search_image([b"not an image"]), "not an image"),
        (lambda s: s.search_image([Image.new("RGB", (20_000, 20_000))]), "too large"),
    ],
)
def test_bad_queries_raise_one_line_user_errors(searcher, call, needle):
    with pytest.raises(UserError, match=needle) as err:
        call(searcher)
    assert "\n" not in str(err.value)


def test_index_recall_comes_from_the_evaluation_of_the_indexed_weights(tmp_path):
    """The manifest's recall per m is the kept best epoch's (what is indexed), not the last epoch's."""
    import json

    from triclip.index.sources import run_recall

    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    records = [
        {"epoch": 1, "t2i_r10": 0.5, "compact": {"importance": {"8": 0.30}}},
        {"epoch": 2, "t2i_r10": 0.7, "compact": {"importance": {"8": 0.45}}},  # the best
        {"epoch": 3, "t2i_r10": 0.6, "compact": {"importance": {"8": 0.40}}},  # the last
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "best" / "best.json").write_text(json.dumps({"epoch": 2, "step": 20, "metric": "t2i_r10", "value": 0.7}))
    assert run_recall(str(run), "importance", [8, 32]) == {"8": 0.45, "32": 0.7}
    assert run_recall(str(run), "importance", [8, 32], weights="last") == {"8": 0.40, "32": 0.6}
    (run / "best" / "best.json").write_text("{damaged")
    assert run_recall(str(run), "importance", [8, 32]) == {"8": 0.40, "32": 0.6}  # informative only: falls back


def test_funnel_through_faiss_equals_funnel_through_matmul(searcher, monkeypatch):
    import triclip.index.search as search_module

    by_matmul = searcher.search_text(QUERIES, k=5, funnel=M)
    monkeypatch.setattr(search_module, "MATMUL_SHORTLIST_MAX", 0)  # every index searched by FAISS
    by_faiss = searcher.search_text(QUERIES, k=5, funnel=M)
    for a, b in zip(by_matmul, by_faiss):
        np.testing.assert_allclose([h["score"] for h in a], [h["score"] for h in b], atol=1e-6)


def test_the_summary_counts_the_seconds_of_the_whole_command_the_embedding_included(run_dir, shapes_dir, tmp_path,
                                                                                   monkeypatch):
    import time

    import triclip.index.sources as sources

    embed = sources.embed_pairs

    def slow_embed(*args, **kwargs):  # the embedding takes at least a second
        time.sleep(1.0)
        return embed(*args, **kwargs)

    monkeypatch.setattr(sources, "embed_pairs", slow_embed)
    summary = _build(run_dir, shapes_dir / "train.jsonl", tmp_path / "index", dims=[M], factory="Flat")
    assert summary["seconds"] >= 1.0  # before, it counted from build_and_write's start: the embedding left out
