"""``index build --bytes``: per budget the best measured code is stored, for the images and for the captions, and
the recall the manifest records is the recall of those stored codes, recomputed here from the index files alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from triclip import codecs
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.search import Searcher
from triclip.index.store import current_version, load_contents
from triclip.index.vectors import exact_topk
from triclip.core.errors import UserError
from tests.index.conftest import EMBED_DIM, GivenLatency

BUDGETS = [4, 8, 16]


@pytest.fixture(scope="module")
def by_bytes(run_dir, shapes_dir, tmp_path_factory):
    """Every code answers within the bound (latencies given, not timed): the choice is by recall, as before."""
    from triclip.index import budgets

    out = tmp_path_factory.mktemp("bytes") / "index"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budgets, "latency_model", lambda: GivenLatency())
        summary = build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out),
                                               dims=[8], bytes=BUDGETS))
    return out, summary


def _recall_from_files(folder, budget: int) -> float:
    """t2i recall@10 over distinct captions of the stored codes, from the version's files only: the codes alone,
    or their recorded shortlist re-ranked by the stored float vectors."""
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["budgets"][str(budget)]
    codec = codecs.load(folder / entry["file"], manifest["dim"])
    image = np.load(folder / "vectors.npy")  # (N, D)
    text = np.load(folder / "text_vectors.npy")  # (T, D)
    rows = np.load(folder / "text_rows.npy")  # (T, 2)
    meta = [json.loads(line) for line in (folder / "meta.jsonl").read_text().splitlines()]
    first, positives = {}, {}
    for t, (row, c) in enumerate(rows.tolist()):
        caption = meta[row]["captions"][c]
        first.setdefault(caption, t)
        positives.setdefault(caption, set()).add(row)
    hits = 0
    for caption, t in first.items():
        if entry["rescore"] is None:
            _, ids = codec.search(text[t : t + 1], 10)
        else:  # the evaluation is the indexed images themselves here: the recorded shortlist as it is
            _, short = codec.search(text[t : t + 1], entry["rescore"]["shortlist"])
            ids = short[:, np.argsort(-(image[short[0]] @ text[t]), kind="stable")[:10]]
        hits += any(int(i) in positives[caption] for i in ids[0])
    return hits / len(first)


def _text_recall_from_files(folder, budget: int) -> float:
    """i2t recall@10 over distinct captions of the stored caption codes, from the version's files only: each
    distinct caption once (its first row, whose stored code is checked to be its own encoding), every image
    that carries one as a query."""
    manifest = json.loads((folder / "manifest.json").read_text())
    stored = codecs.load(folder / manifest["budgets"][str(budget)]["text"]["file"], manifest["dim"])
    image, text = np.load(folder / "vectors.npy"), np.load(folder / "text_vectors.npy")  # (N, D), (T, D)
    rows = np.load(folder / "text_rows.npy")  # (T, 2)
    meta = [json.loads(line) for line in (folder / "meta.jsonl").read_text().splitlines()]
    first = {}  # caption -> its first row
    for t, (row, c) in enumerate(rows.tolist()):
        first.setdefault(meta[row]["captions"][c], t)
    captions = list(first)
    gallery = stored.empty_copy()
    gallery.add(text[list(first.values())])
    np.testing.assert_allclose(gallery.reconstruct(), stored.reconstruct(np.array(list(first.values()))), atol=1e-6)
    queries = [i for i, row in enumerate(meta) if row["captions"]]
    _, ids = gallery.search(image[queries], 10)
    hits = [bool(set(meta[i]["captions"]) & {captions[j] for j in found if j >= 0}) for i, found in zip(queries, ids)]
    return float(np.mean(hits))


def test_each_budget_stores_the_best_code_and_its_recall_is_the_stored_codes_recall(by_bytes):
    out, summary = by_bytes
    folder = out / current_version(out)
    manifest = json.loads((folder / "manifest.json").read_text())
    curves = json.loads((folder / "curves.json").read_text())["bytes"]
    assert sorted(manifest["budgets"], key=int) == [str(b) for b in BUDGETS]
    for b in BUDGETS:
        entry = manifest["budgets"][str(b)]
        assert entry["spec"]["bytes_per_vector"] <= b and (folder / entry["file"]).is_file()
        assert entry["recall"] == pytest.approx(_recall_from_files(folder, b), abs=1e-9)
        tried = [min(c["recall"], entry["full_recall"]) for c in curves["candidates"][str(b)] if c["recall"] is not None]
        assert len(tried) >= 4 and min(entry["recall"], entry["full_recall"]) == max(tried)  # the best that fits,
        # counted up to the float vectors' own recall
        assert curves["chosen"][str(b)]["recall"] == entry["recall"]
        assert entry["latency"] == {"ms": round(GivenLatency().ms(codecs.CodecSpec.from_json(entry["spec"])), 4),
                                    "how": "given"} and entry["latency_bound_ms"] == 1.0
        assert summary["budgets"][str(b)]["index_bytes"] == entry["index_bytes"] == entry["bytes_per_vector"] * manifest["count"]
    tried = [c["codec"] for c in curves["candidates"]["4"]]
    fits = [s.codec for s in codecs.candidates(4, manifest["dim"])]
    assert tried == fits  # every registered codec that fits, in order; those that never win shown skipped, unfitted
    assert all(c["recall"] is None and "not fitted" in c["skipped"] for c in curves["candidates"]["4"]
               if c["codec"] == "pq")
    assert set(tried) >= {"float32", "int8", "binary", "opq", "rq", "mixed"}  # a few hundred vectors: OPQ is tried
    assert set(curves["float_pruning"]) >= {str(4 * m) for m in (2, 4, 8)}  # float top-m at 4m bytes


def test_each_budget_stores_caption_codes_chosen_by_their_own_image_to_text_recall(by_bytes):
    out, summary = by_bytes
    folder = out / current_version(out)
    manifest = json.loads((folder / "manifest.json").read_text())
    text_curves = json.loads((folder / "curves.json").read_text())["text_bytes"]
    assert text_curves["metric"] == "i2t_r10" and text_curves["split"] == "indexed"
    for b in BUDGETS:
        entry = manifest["budgets"][str(b)]["text"]
        assert entry["file"] == f"text.b{b}.codec" and entry["spec"]["bytes_per_vector"] <= b
        assert entry["recall"] == pytest.approx(_text_recall_from_files(folder, b), abs=1e-9)
        tried = [c["recall"] for c in text_curves["candidates"][str(b)] if c["recall"] is not None]
        assert len(tried) >= 4 and entry["recall"] == max(tried) == text_curves["chosen"][str(b)]["recall"]
        assert entry["index_bytes"] == entry["bytes_per_vector"] * manifest["text_count"]
        assert summary["budgets"][str(b)]["text"]["recall"] == entry["recall"]


def test_image_to_text_by_bytes_searches_the_caption_codes(by_bytes):
    out, _ = by_bytes
    searcher = Searcher.load(out)
    assert searcher.text_budgets == BUDGETS
    contents = searcher.contents
    queries = np.asarray(contents.vectors[:20])  # (20, D) served image vectors
    hits = searcher.search_vectors(queries, k=5, target="text", bytes=8)
    _, ids = contents.text_codes[8].search(queries, 5)
    rows = contents.text_rows
    assert [[(h["id"], h["caption"]) for h in row] for row in hits] == [
        [(contents.meta[rows[t, 0]]["id"], contents.meta[rows[t, 0]]["captions"][rows[t, 1]]) for t in r]
        for r in ids.tolist()]
    searcher.shortlist_factor = len(contents.text_vectors)  # every caption re-ranked by its float vector: exact
    exact = np.sort(queries @ np.asarray(contents.text_vectors).T, axis=1)[:, ::-1][:, :5]  # (20, 5)
    rescored = searcher.search_vectors(queries, k=5, target="text", bytes=4, rescore="float")
    np.testing.assert_allclose([[h["score"] for h in row] for row in rescored], exact, atol=1e-5)
    with pytest.raises(UserError, match="no codes of that many bytes for the captions here"):
        searcher.search_vectors(queries, target="text", bytes=12)


def test_search_bytes_is_the_codes_ranking_and_rescoring_reaches_exact(by_bytes):
    out, _ = by_bytes
    searcher = Searcher.load(out)
    assert searcher.budgets == BUDGETS
    contents = searcher.contents
    queries = np.asarray(contents.text_vectors[:30])  # (30, D) served caption vectors
    hits = searcher.search_vectors(queries, k=5, bytes=8)
    _, ids = contents.codes[8].search(queries, 5)
    assert [[h["id"] for h in row] for row in hits] == [[contents.meta[i]["id"] for i in r] for r in ids.tolist()]
    # re-scoring: a shortlist of every row re-ranked by the float vectors is exact search at full D
    searcher.shortlist_factor = len(searcher)
    exact = exact_topk(np.asarray(contents.vectors), queries, 5)
    rescored = searcher.search_vectors(queries, k=5, bytes=4, rescore="float")
    assert [[h["id"] for h in row] for row in rescored] == [[contents.meta[i]["id"] for i in r] for r in exact.tolist()]
    by_codes = searcher.search_vectors(queries, k=5, bytes=4, rescore=16)  # ... and by the decoded 16-byte codes
    scores16 = np.sort(queries @ contents.codes[16].reconstruct().T, axis=1)[:, ::-1][:, :5]  # (30, 5)
    np.testing.assert_allclose([[h["score"] for h in row] for row in by_codes], scores16, atol=1e-5)


def test_rescoring_a_small_shortlist_recovers_most_of_exact(by_bytes):
    out, _ = by_bytes
    searcher = Searcher.load(out)
    queries = np.asarray(searcher.contents.text_vectors[:40])
    exact = exact_topk(np.asarray(searcher.contents.vectors), queries, 10)

    def overlap(rows):
        return np.mean([len({searcher._rows[h["id"]] for h in r} & set(t.tolist())) / 10 for r, t in zip(rows, exact)])

    plain = overlap(searcher.search_vectors(queries, k=10, bytes=4))
    rescored = overlap(searcher.search_vectors(queries, k=10, bytes=4, rescore="float"))  # 200 candidates of ~90
    searcher.shortlist_factor = 2
    partial = overlap(searcher.search_vectors(queries, k=10, bytes=4, rescore="float"))  # 20 candidates
    assert rescored == 1.0 and partial >= plain


def test_codec_forces_the_choice_and_bad_budgets_are_one_line(run_dir, shapes_dir, tmp_path, by_bytes):
    out = tmp_path / "int8"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), bytes=[8],
                                 codec="int8", val_data=str(shapes_dir / "val.jsonl")))
    contents = load_contents(out)
    entry = contents.manifest["budgets"]["8"]
    assert entry["spec"]["codec"] == "int8" and entry["split"] == "validation"
    assert contents.codes[8].spec.codec == "int8" and len(contents.codes[8]) == contents.manifest["count"]
    searcher = Searcher.load(by_bytes[0])
    with pytest.raises(UserError, match="no codes of that many bytes here; choose from"):
        searcher.search_text(["a red circle"], bytes=12)
    with pytest.raises(UserError, match="give bytes too"):
        searcher.search_text(["a red circle"], rescore="float")
    with pytest.raises(UserError, match="--bytes must be >= 1, got 0"):
        build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(tmp_path / "x"),
                                     bytes=[0]))


def test_cli_offers_the_registered_codecs_and_refuses_another_before_any_work(run_dir, shapes_dir, tmp_path, capsys):
    """--codec's choices are the registry's names (--help lists them); a bad one is one line, exit 2, nothing
    written; the library refuses it too, before it reads the run."""
    from triclip.app.cli import main

    with pytest.raises(SystemExit):
        main(["index", "build", "--help"])
    assert f"(one of: {', '.join(codecs.names())})" in " ".join(capsys.readouterr().out.split())
    out = tmp_path / "never"
    assert main(["index", "build", "--run", str(run_dir), "--data", str(shapes_dir / "train.jsonl"), "--out", str(out),
                 "--bytes", "4", "--codec", "lz4"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--codec" in err[0] and "'lz4'" in err[0] and "'mixed'" in err[0] and not out.exists()
    with pytest.raises(UserError, match="unknown codec 'lz4'; choose from float32, int8"):
        build_index(IndexBuildConfig(run=str(tmp_path / "no-run"), data=str(shapes_dir / "train.jsonl"), out=str(out),
                                     bytes=[4], codec="lz4"))
    assert not out.exists()


def test_cli_prints_the_table_and_searches_by_bytes(by_bytes, run_dir, shapes_dir, tmp_path, capsys):
    from triclip.app.cli import main

    built = tmp_path / "cli"
    assert main(["index", "build", "--run", str(run_dir), "--data", str(shapes_dir / "train.jsonl"), "--out", str(built),
                 "--bytes", "4", "--codec", "binary"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    lines = [line.split() for line in captured.err.splitlines() if line.strip().startswith(("bytes", "4 "))]
    assert lines[0][:6] == ["bytes", "codes", "code", "m", "stored", "stages"]
    for line, side in zip(lines[1:], ("image", "text"), strict=True):
        assert line[:3] == ["4", side, "binary"] and line[3] in ("m=16", "m=32")
        assert line[4:7] == [line[3][2:], str(int(line[3][2:]) // 8), "B"]  # m, then the bytes the code stores
    assert summary["budgets"]["4"]["code"]["codec"] == summary["budgets"]["4"]["text"]["code"]["codec"] == "binary"
    assert "candidates" not in captured.out  # the table on stderr lists them; curves.json keeps them
    curves = json.loads(next(built.glob("v*/curves.json")).read_text())
    assert {c["codec"] for c in curves["bytes"]["candidates"]["4"]} == {"binary"}
    assert any(line.strip().startswith("- binary m=") for line in captured.err.splitlines())
    out, _ = by_bytes
    assert main(["search", "--index", str(out), "--text", "a red circle", "--bytes", "8", "--json", "-k", "3"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 3
    assert main(["search", "--index", str(out), "--text", "x", "--bytes", "5"]) == 2
    assert "no codes of that many bytes" in capsys.readouterr().err
    image = shapes_dir / json.loads((shapes_dir / "train.jsonl").read_text().splitlines()[0])["image"]
    assert main(["search", "--index", str(out), "--image", str(image), "--target", "text", "--bytes", "8", "--json",
                 "-k", "3"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    count = load_contents(out).manifest["count"]
    rescore = ["search", "--index", str(out), "--text", "a red circle", "--bytes", "4", "--rescore", "float", "-k", "5"]
    assert main(rescore + ["--timing"]) == 0  # 5 x 20 candidates of fewer images: the full-D answer, said
    err = capsys.readouterr().err
    assert f"holds all {count} image vectors" in err and "exact full-D search" in err
    timing = json.loads(err.split("timing: ", 1)[1].splitlines()[0])
    assert timing["shortlist"]["whole_gallery"] is True and timing["shortlist"]["candidates"] == count
    assert main(rescore + ["--factor", "2", "--timing"]) == 0  # 10 candidates: the codes choose, nothing to say
    err = capsys.readouterr().err
    assert "note:" not in err and json.loads(err.split("timing: ", 1)[1].splitlines()[0])["shortlist"] == {
        "candidates": 10, "vectors": count, "whole_gallery": False}
    assert EMBED_DIM == load_contents(out).manifest["dim"]


def test_add_extends_the_codes_of_every_budget(run_dir, shapes_dir, tmp_path):
    from tests.index.conftest import split_manifest

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    split_manifest(shapes_dir / "train.jsonl", first, second, 50)
    out = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(first), out=str(out), bytes=[8]))
    before = load_contents(out)
    build_index(IndexBuildConfig(run=str(run_dir), data=str(second), out=str(out), add=True))
    after = load_contents(out)
    assert len(after.codes[8]) == after.manifest["count"] > before.manifest["count"]
    entry, old = after.manifest["budgets"]["8"], before.manifest["budgets"]["8"]
    assert (entry["spec"], entry["recall"]) == (old["spec"], old["recall"])  # the same trained code, measured once
    assert entry["index_bytes"] == entry["bytes_per_vector"] * after.manifest["count"]
    np.testing.assert_allclose(after.codes[8].reconstruct(np.arange(50)), before.codes[8].reconstruct(), atol=1e-6)
    text, old_text = entry["text"], old["text"]  # the caption codes too
    assert (text["spec"], text["recall"]) == (old_text["spec"], old_text["recall"])
    assert len(after.text_codes[8]) == after.manifest["text_count"] > before.manifest["text_count"]
    assert text["index_bytes"] == text["bytes_per_vector"] * after.manifest["text_count"]
    kept = np.arange(before.manifest["text_count"])
    np.testing.assert_allclose(after.text_codes[8].reconstruct(kept), before.text_codes[8].reconstruct(), atol=1e-6)


def test_validation_recall_is_the_stored_codes_on_the_validation_split(run_dir, shapes_dir, tmp_path):
    """--val-data: the recorded recall is the stored code's (its trained quantiser) on the validation images,
    recomputed here through the search path's own embedding of the val split."""
    from triclip.data import load_pairs

    out = tmp_path / "val"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), bytes=[8],
                                 val_data=str(shapes_dir / "val.jsonl")))
    searcher = Searcher.load(out)
    records = load_pairs(str(shapes_dir / "val.jsonl")).records
    gallery = searcher.contents.codes[8].empty_copy()  # the stored code, trained on the indexed images
    gallery.add(searcher.embed_images([r.path for r in records]))  # (n, D) served val image vectors
    positives = {}
    for row, record in enumerate(records):
        for caption in record.captions:
            positives.setdefault(caption, set()).add(row)
    texts = list(positives)
    _, ids = gallery.search(searcher.embed_texts(texts), 10)
    recall = np.mean([bool(positives[t] & set(row.tolist())) for t, row in zip(texts, ids)])
    entry = searcher.manifest["budgets"]["8"]
    assert entry["split"] == "validation" and entry["recall"] == pytest.approx(recall, abs=1e-9)
    # the caption codes: each distinct val caption once, every val image a query (image -> text)
    captions = searcher.contents.text_codes[8].empty_copy()
    captions.add(searcher.embed_texts(texts))
    _, ids = captions.search(searcher.embed_images([r.path for r in records]), 10)
    i2t = np.mean([bool(set(r.captions) & {texts[j] for j in row if j >= 0}) for r, row in zip(records, ids)])
    text = entry["text"]
    assert text["split"] == "validation" and text["recall"] == pytest.approx(i2t, abs=1e-9)


def test_opq_and_rq_on_too_few_vectors_are_skipped_not_a_crash():
    """OPQ trained on fewer than 256 vectors of D = 256 aborted the whole process inside FAISS (RQ raised in its
    PCA); a budget then measures the other codes and says why OPQ and RQ were left out."""
    from triclip.index.budgets import EvalSet, Rules, choose

    rng = np.random.default_rng(0)
    x = rng.standard_normal((190, 256)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    evaluation = EvalSet.of(x[:40], x[:40], np.arange(40), [f"t{i}" for i in range(40)], "indexed", "synthetic")
    rules = Rules(n=len(x), model=GivenLatency())
    choice = choose(16, x, evaluation, rules=rules)
    opq = [c for c in choice.tried if c["codec"] in ("opq", "rq")]
    assert {c["codec"] for c in opq} == {"opq", "rq"}  # not fitted: too few vectors, or a kept code is as good
    assert all(c["recall"] is None and ("at least 256" in c.get("error", "") or "cannot win" in c.get("skipped", ""))
               for c in opq)
    assert choice.recall == max(c["recall"] for c in choice.tried if c["recall"] is not None)
    for codec in ("opq", "rq"):  # alone, each is fitted and refused in one line
        with pytest.raises(UserError, match="could be fitted: .*at least 256"):
            choose(16, x, evaluation, force=codec, rules=rules)


def test_candidates_that_never_measured_best_are_not_fitted_unless_forced():
    """docs/results_bytes.md: plain PQ never beat OPQ below 64 B; fitted on >= 5,000 vectors RQ always beat OPQ
    at 4-16 B. Those are left out of a budget's fits; --codec still fits the codec it names."""
    from triclip.index.budgets import RQ_OVER_OPQ_ROWS, EvalSet, choose, worth_trying

    for budget in (4, 8, 16, 32):
        specs = codecs.candidates(budget, 256)
        big = {s.codec for s in worth_trying(specs, budget, RQ_OVER_OPQ_ROWS)}
        small = {s.codec for s in worth_trying(specs, budget, RQ_OVER_OPQ_ROWS - 1)}
        assert "pq" not in big | small and {"float32", "int8", "binary", "mixed"} <= big  # the cheap peers stay
        has_rq = any(s.codec == "rq" for s in specs)
        assert ("opq" in big) == (not has_rq and budget < 32)  # left out where RQ measures instead, and from 32 B
        assert ("opq" in small) == (budget < 32)  # from 32 B mixed measures level with it (MIXED_OVER_OPQ_FROM)
    assert {s.codec for s in worth_trying(codecs.candidates(64, 256), 64, 10**6)} >= {"pq"}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    evaluation = EvalSet.of(x[:40], x[:40], np.arange(40), [f"t{i}" for i in range(40)], "indexed", "synthetic")
    forced = choose(4, x, evaluation, force="pq")
    assert forced.tried and {c["codec"] for c in forced.tried} == {"pq"} and forced.codec.spec.codec == "pq"


def test_inverted_lists_of_opq_stay_candidates_where_lists_of_rq_are():
    """RQ_OVER_OPQ_ROWS is evidence about flat codes: at N = 1M lists of OPQ measured best (docs/results_scale.md),
    so every inner code of the lists stays a candidate; plain PQ and OPQ beside them are left out as at any N."""
    from triclip.index.budgets import RQ_OVER_OPQ_ROWS, not_worth_trying

    for budget in (4, 8, 16, 32):
        specs = codecs.candidates(budget, 256, 10**6)
        why = not_worth_trying(specs, budget, RQ_OVER_OPQ_ROWS)
        assert not any(specs[i].codec == "ivf" for i in why)
        assert {specs[i].codec for i in why} == {"pq", "opq"}  # opq: RQ beside it (4-16 B), mixed (32 B)
        assert all("docs/results_bytes.md" in reason for reason in why.values())


def test_a_candidate_left_out_by_the_evidence_is_shown_skipped_with_its_reason_and_the_kept_code_is_the_same(
        monkeypatch):
    """At 32 B OPQ is not fitted (mixed measures level with it): the choice lists it as skipped with the reason, the
    build's table prints that line, and on a collection where the unpruned choice does not keep OPQ the kept code
    and its recall are the unpruned choice's (latencies given: nothing timed)."""
    from triclip.index import budgets
    from triclip.index.budgets import EvalSet, Rules, choose
    from triclip.index.report import table

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((30, 256)).astype(np.float32)  # D = 256: OPQ32x8 needs 8 dimensions a code
    x = centres[rng.integers(0, 30, 1200)] + 0.4 * rng.standard_normal((1200, 256)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    evaluation = EvalSet.of(x[:150], x[:150] + 0.05, np.arange(150), [f"t{i}" for i in range(150)], "indexed", "s")
    fast_opq = GivenLatency(codes={"opq": 0.0001})  # its probe the fastest: unpruned, nothing leaves it out unfitted
    rules = lambda: Rules(n=len(x), latency_ms=1000.0, model=fast_opq)  # noqa: E731
    pruned = choose(32, x, evaluation, rules=rules())
    skipped = [c for c in pruned.tried if c["codec"] == "opq"]
    assert skipped and all(c["recall"] is None and "mixed" in c["skipped"] for c in skipped)
    monkeypatch.setattr(budgets, "not_worth_trying", lambda specs, budget, rows: {})
    unpruned = choose(32, x, evaluation, rules=rules())
    fitted = [c for c in unpruned.tried if c["codec"] == "opq"]
    assert fitted and all(c["recall"] is not None for c in fitted)  # without the rule it is fitted and measured
    assert unpruned.codec.spec.codec != "opq"  # this collection: the rule must not change the answer
    assert (pruned.codec.spec, pruned.recall) == (unpruned.codec.spec, unpruned.recall)
    entry = {"code": pruned.codec.spec.to_json(), "recall": pruned.recall, "index_bytes": 32 * len(x),
             "candidates": pruned.tried}
    assert any(line.strip().startswith("- opq") and "not fitted from 32 B" in line
               for line in table({"32": entry}).splitlines())


def test_a_code_kept_by_several_budgets_is_stored_once_read_once_and_served_alike(run_dir, shapes_dir, tmp_path,
                                                                                   monkeypatch, given_latency):
    """A larger budget that keeps a smaller one's code (``budgets.no_worse_than_smaller``: the same fitted object)
    takes that budget's fill instead of encoding every row again, and names that budget's file: one file per code
    (a swap of two identical files would change nothing), read once by a searcher, extended once by ``--add``."""
    import shutil
    from dataclasses import replace

    from tests.index.conftest import split_manifest
    from triclip.index import budgets, scale

    choose_all, fill = budgets.choose_all, scale.fill

    def kept_by_both(*args, **kwargs):  # the 4 B choice kept at 8 B too, as no_worse_than_smaller keeps it
        small, large = choose_all(*args, **kwargs)
        return [small, replace(large, codec=small.codec, recall=small.recall, kept=small.kept, note="kept here too")]

    fills = []
    monkeypatch.setattr(budgets, "choose_all", kept_by_both)
    monkeypatch.setattr(scale, "fill", lambda codec, vectors: fills.append(codec.spec.label()) or fill(codec, vectors))
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    split_manifest(shapes_dir / "train.jsonl", first, second, 50)
    out = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(first), out=str(out), dims=[8], bytes=[4, 8]))
    assert len(fills) == 2  # one code per side (images, captions), each encoded once
    folder = out / current_version(out)
    manifest = json.loads((folder / "manifest.json").read_text())
    four, eight = manifest["budgets"]["4"], manifest["budgets"]["8"]
    assert (eight["file"], eight["text"]["file"]) == (four["file"], four["text"]["file"]) == ("image.b4.codec", "text.b4.codec")
    assert not (folder / "image.b8.codec").exists() and not (folder / "text.b8.codec").exists()
    assert eight["spec"] == four["spec"] and manifest["files"]["image.b4.codec"]["codec"] == four["spec"]
    searcher = Searcher.load(out)
    assert searcher.contents.codes[4] is searcher.contents.codes[8]  # read once, held once
    queries = np.asarray(searcher.contents.text_vectors[:20])
    by4, by8 = (searcher.search_vectors(queries, k=5, bytes=b) for b in (4, 8))
    assert [[h["id"] for h in q] for q in by4] == [[h["id"] for h in q] for q in by8]
    shutil.copy(folder / "image.b4.codec", tmp_path / "before-add.codec")

    build_index(IndexBuildConfig(run=str(run_dir), data=str(second), out=str(out), add=True))
    after = load_contents(out)
    assert len(after.codes[8]) == len(after.codes[4]) == after.manifest["count"] > manifest["count"]  # added once
    assert len(after.text_codes[8]) == after.manifest["text_count"]
    added = out / current_version(out)
    assert json.loads((added / "manifest.json").read_text())["budgets"]["8"]["file"] == "image.b4.codec"
    assert not (added / "image.b8.codec").exists()

    (added / "image.b4.codec").unlink()  # its one file replaced by the version before the --add's (fewer rows):
    shutil.copy(tmp_path / "before-add.codec", added / "image.b4.codec")  # both budgets refused, the rest serves
    searcher = Searcher.load(out)
    for b in (4, 8):
        with pytest.raises(UserError, match="image.b4.codec"):
            searcher.search_vectors(queries[:2], k=5, bytes=b)
    assert len(searcher.search_vectors(queries[:2], k=5)) == 2


def test_at_scale_a_code_kept_by_two_budgets_is_refitted_and_filled_once_and_its_lists_stored_once(
        run_dir, shapes_dir, tmp_path, monkeypatch, given_latency):
    """At N >= IVF_MIN_N (lowered: ~90 rows count as at scale) the 8 B budget keeps the 4 B budget's inverted
    lists: no code is refitted for N twice, each side writes one lists file on disk, both budgets name it, and
    they answer alike."""
    from dataclasses import replace

    from triclip.codecs import ivf
    from triclip.index import budgets, finalists, scale

    monkeypatch.setattr(ivf, "IVF_MIN_N", 50)
    monkeypatch.setattr(ivf, "TRAIN_PER_LIST", 4)
    monkeypatch.setattr(budgets, "FIT_ROWS", 60)
    monkeypatch.setattr(finalists, "FILL_RATIO", float("inf"))  # every finalist filled, however it was timed
    choose_all, sized_for_n, on_disk = budgets.choose_all, scale.sized_for_n, ivf.IVFCodec.filled_on_disk

    def kept_by_both(*args, **kwargs):  # the 4 B choice kept at 8 B too, as no_worse_than_smaller keeps it
        small, large = choose_all(*args, **kwargs)
        return [small, replace(large, codec=small.codec, recall=small.recall, kept=small.kept, note="kept here too")]

    refitted, written = [], []
    monkeypatch.setattr(budgets, "choose_all", kept_by_both)
    monkeypatch.setattr(scale, "sized_for_n", lambda codec, *a, **k: refitted.append(id(codec)) or sized_for_n(
        codec, *a, **k))
    monkeypatch.setattr(ivf.IVFCodec, "filled_on_disk",
                        lambda self, v, path: written.append(path.name) or on_disk(self, v, path))
    out = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"), out=str(out), dims=[8],
                                 factory="IVF8,Flat", bytes=[4, 8], codec="ivf", on_disk="always", latency_ms=1000,
                                 tune_queries=50))
    assert refitted and len(refitted) == len(set(refitted))  # no code refitted for N twice
    assert sorted(written) == ["image.b4.codec.ivfdata", "text.b4.codec.ivfdata"]
    folder = out / current_version(out)
    manifest = json.loads((folder / "manifest.json").read_text())
    four, eight = manifest["budgets"]["4"], manifest["budgets"]["8"]
    for side in (lambda e: e, lambda e: e["text"]):
        assert (side(eight)["file"], side(eight)["lists"]) == (side(four)["file"], side(four)["lists"])
        assert side(eight)["at_n"]["nprobe"] == side(four)["at_n"]["nprobe"] and side(four)["sized_for_n"]
        assert side(eight)["finalists_at_n"]["kept"]["measured_for"] == 4
    assert not list(folder.glob("*.b8.*")) and (folder / "image.b4.codec.ivfdata").exists()
    searcher = Searcher.load(out)
    assert searcher.contents.codes[4] is searcher.contents.codes[8] and searcher.contents.codes[4].on_disk()
    queries = np.asarray(searcher.contents.text_vectors[:20])
    by4, by8 = (searcher.search_vectors(queries, k=5, bytes=b) for b in (4, 8))
    assert [[h["id"] for h in q] for q in by4] == [[h["id"] for h in q] for q in by8] and len(by4[0]) == 5
