"""Recall among everything the index holds (``triclip.index.in_index``): the served searches, checked against an
exhaustive search of the index's own vectors, the build's record of it, and what the app shows."""

from __future__ import annotations

import numpy as np
import pytest

from tests.app.conftest import GivenLatency
from tests.index.conftest import make_run

K = 10


@pytest.fixture(scope="module")
def split_index(tmp_path_factory):
    """An index of every image of a shapes split folder (train, val and test), with the 4 B codes of both sides."""
    from triclip.data.builtin import prepare
    from triclip.index.sources import IndexBuildConfig, build_index

    root = tmp_path_factory.mktemp("in_index")
    prepare("shapes", str(root / "data"), num=120, seed=0)
    run = make_run(root / "run", seed=0)
    with pytest.MonkeyPatch.context() as patch:  # the choice of a budget's code is by recall, not by this machine's load
        patch.setattr("triclip.index.budgets.latency_model", lambda: GivenLatency())
        build_index(IndexBuildConfig(run=str(run), data=str(root / "data"), out=str(root / "index"), dims=[8, 16],
                                     bytes=[4]))
    return root


def _own_queries(searcher, images: list[int]):
    """An EvalSet of ``images`` (indexed rows) with their own caption vectors, as a validation set would be."""
    from triclip.index.budgets import EvalSet

    contents = searcher.contents
    rows = np.flatnonzero(np.isin(contents.text_rows[:, 0], images))
    owner = np.searchsorted(np.asarray(images), contents.text_rows[rows, 0])  # caption row -> its image's place
    texts = [contents.meta[int(i)]["captions"][int(c)] for i, c in contents.text_rows[rows]]
    return EvalSet.of(np.asarray(contents.vectors)[images], np.asarray(contents.text_vectors)[rows], owner, texts,
                      "validation", "test")


def _exact_t2i(searcher, evaluation) -> float:
    """Text -> image recall@10 of the queries among every indexed image, by brute force at full D."""
    vectors = np.asarray(searcher.contents.vectors, np.float32)
    top = np.argsort(-(evaluation.queries @ vectors.T), axis=1, kind="stable")[:, :K]
    carried = [set(row["captions"]) for row in searcher.contents.meta]
    return float(np.mean([any(text in carried[r] for r in row) for text, row in zip(evaluation.texts, top)]))


def _exact_i2t(searcher, evaluation) -> float:
    """Image -> text recall@10: each image's own captions among the 10 best distinct caption strings, each string
    scored by its best caption row, by brute force at full D."""
    contents = searcher.contents
    strings = [contents.meta[int(i)]["captions"][int(c)] for i, c in contents.text_rows]
    scores = evaluation.gallery @ np.asarray(contents.text_vectors, np.float32).T  # (I, T)
    hits = []
    for image, row in enumerate(scores):
        best: dict[str, float] = {}
        for string, score in zip(strings, row.tolist()):
            best[string] = max(score, best.get(string, -np.inf))
        top = sorted(best, key=lambda s: -best[s])[:K]
        own = {evaluation.texts[t] for t, rows in enumerate(evaluation.positives) if image in rows}
        hits.append(bool(own & set(top)))
    return float(np.mean(hits))


def test_recall_in_the_index_is_what_an_exhaustive_search_and_the_served_search_find(split_index):
    from triclip.index import in_index
    from triclip.index.search import Searcher

    searcher = Searcher.load(split_index / "index")
    evaluation = _own_queries(searcher, list(range(0, len(searcher), 3)))
    found = in_index.measure(searcher, evaluation, [4], [4])
    dim = searcher.dim
    assert found["images"] == len(searcher) and found["queries"] == len(evaluation.texts) and found["left_out"] == 0
    assert found["t2i"]["m"][dim] == pytest.approx(_exact_t2i(searcher, evaluation))
    assert found["i2t"]["m"][dim] == pytest.approx(_exact_i2t(searcher, evaluation))
    assert 0 < found["t2i"]["m"][dim] < 1 and 0 < found["i2t"]["m"][dim] < 1  # a measure that can tell
    # the budget's codes: what the served search answers, hit dicts and all
    carried = {row["id"]: set(row["captions"]) for row in searcher.contents.meta}
    hits = searcher.search_vectors(evaluation.queries, K, bytes=4)
    served = np.mean([any(text in carried[h["id"]] for h in row) for text, row in zip(evaluation.texts, hits)])
    assert found["t2i"]["bytes"][4] == pytest.approx(served)
    own = [{evaluation.texts[t] for t, rows in enumerate(evaluation.positives) if image in rows}
           for image in range(len(evaluation.gallery))]
    hits = searcher.search_vectors(evaluation.gallery, K, target="text", bytes=4)
    served = np.mean([any(h["caption"] in mine for h in row) for mine, row in zip(own, hits)])
    assert found["i2t"]["bytes"][4] == pytest.approx(served)


def test_queries_the_index_cannot_answer_are_left_out_and_counted(split_index):
    from triclip.index import in_index
    from triclip.index.search import Searcher

    searcher = Searcher.load(split_index / "index")
    evaluation = _own_queries(searcher, [0, 1, 2, 3])
    evaluation.texts[0] = "a caption no indexed image carries"
    found = in_index.measure(searcher, evaluation, [], [])
    assert found["left_out"] == 1 and found["queries"] == len(evaluation.texts) - 1
    evaluation.texts[:] = ["nothing here"] * len(evaluation.texts)
    assert in_index.measure(searcher, evaluation, [], []) is None


def test_an_index_above_the_size_limit_is_not_measured(split_index, monkeypatch):
    from triclip.index import in_index
    from triclip.index.search import Searcher

    searcher = Searcher.load(split_index / "index")
    evaluation = _own_queries(searcher, [0, 1, 2, 3])
    assert in_index.measure(searcher, evaluation, [], []) is not None
    monkeypatch.setattr(in_index, "MAX_ROWS", len(searcher) - 1)
    assert in_index.measure(searcher, evaluation, [], []) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distinct_hits_match_the_first_ten_distinct_strings_of_the_whole_ranking(seed):
    from triclip.index.in_index import distinct_hits

    rng = np.random.default_rng(seed)
    string_of = rng.integers(0, 15, size=400)  # many rows share a string: the search must go deeper
    order = np.stack([rng.permutation(400) for _ in range(30)])  # (Q, T): each query's whole ranking
    wanted = [set(rng.choice(15, size=2, replace=False).tolist()) for _ in range(30)]
    depths = []

    def rows_of(queries, depth):
        depths.append(depth)
        return order[queries, :depth]

    got = distinct_hits(rows_of, string_of, wanted)
    for q in range(30):
        first = list(dict.fromkeys(string_of[order[q]].tolist()))[:K]
        assert got[q] == bool(wanted[q] & set(first))
    assert depths[0] == 40 and depths == sorted(depths)


def test_the_build_records_it_the_app_shows_it_and_an_add_drops_it(split_index, tmp_path):
    import json
    import shutil

    from triclip.app.endpoints import AppConfig, SearchApp
    from triclip.app.panels import choices_text
    from triclip.data.builtin import prepare
    from triclip.index.search import Searcher
    from triclip.index.sources import IndexBuildConfig, build_index

    searcher = Searcher.load(split_index / "index")
    whole = searcher.manifest["in_index"]
    val = sum(1 for _ in open(split_index / "data" / "val.jsonl"))
    assert whole["images"] == len(searcher) and whole["i2t"]["queries"] == val  # every validation image, indexed
    view = SearchApp(searcher, AppConfig(index=str(split_index / "index"), follow=0)).live.view()
    text = choices_text(view)
    assert "text→image R@10 (validation / all)" in text and f"among all {len(searcher):,} images" in text
    assert "- **m** (8, 16, 32): the first m of the 32 dimensions" in text  # m, not k: k is the results' count
    row = next(line for line in text.splitlines() if line.startswith("| 4 B budget |"))
    entry = searcher.manifest["budgets"]["4"]
    assert f"{entry['recall']:.3f} / {whole['t2i']['bytes']['4']:.3f}" in row
    assert f"{entry['text']['recall']:.3f} / {whole['i2t']['bytes']['4']:.3f}" in row

    index = tmp_path / "index"
    shutil.copytree(split_index / "index", index)
    prepare("shapes", str(tmp_path / "more"), num=30, seed=5)
    build_index(IndexBuildConfig(run=str(split_index / "run"), data=str(tmp_path / "more" / "train.jsonl"),
                                 out=str(index), add=True))
    grown = Searcher.load(index)
    assert len(grown) > len(searcher) and "in_index" not in grown.manifest  # measured on fewer images: not kept
    text = choices_text(SearchApp(grown, AppConfig(index=str(index), follow=0)).live.view())
    assert "(validation / all)" not in text and "images this index holds" not in text
    assert json.loads((index / (index / "CURRENT").read_text().strip() / "manifest.json").read_text())["count"] == len(grown)
    prepare("shapes", str(tmp_path / "again"), num=30, seed=6)  # an add given --val-data measures it again
    build_index(IndexBuildConfig(run=str(split_index / "run"), data=str(tmp_path / "again" / "train.jsonl"),
                                 out=str(index), add=True, val_data=str(split_index / "data" / "val.jsonl")))
    again = Searcher.load(index)
    assert len(again) > len(grown) and again.manifest["in_index"]["images"] == len(again)
    assert "(validation / all)" in choices_text(SearchApp(again, AppConfig(index=str(index), follow=0)).live.view())
