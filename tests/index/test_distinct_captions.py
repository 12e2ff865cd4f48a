"""Image -> text lists distinct caption strings: one hit per string, at its best-scoring image, with the count of
indexed images carrying it (identical captions of different images would otherwise fill a top k)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from triclip.index.search import Searcher
from triclip.index.sources import IndexBuildConfig, build_index

SHARED = "a shape"  # the caption a third of the images carry, as a clip-art set's "Dino" on ten pictures


@pytest.fixture(scope="module")
def shared_captions(tmp_path_factory, run_dir, shapes_dir):
    """An index of the shapes images where every third image's only caption is ``SHARED``, with 8 B codes."""
    rows = [json.loads(line) for line in (shapes_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        row["image"] = str((shapes_dir / row["image"]).resolve())
        if i % 3 == 0:
            row["captions"] = [SHARED]
    out = tmp_path_factory.mktemp("distinct")
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_index(IndexBuildConfig(run=str(run_dir), data=str(out / "data.jsonl"), out=str(out / "index"), dims=[8, 16],
                                 factory="Flat", bytes=[8]))
    return Searcher.load(out / "index"), rows, out / "index"


def _reference(searcher: Searcher, query: np.ndarray, k: int) -> list[tuple[str, set[str], float]]:
    """(caption, ids of the images scoring best with it (ties), score) of the k best distinct strings, by exact
    full-D scores over every caption row."""
    contents = searcher.contents
    scores = np.asarray(contents.text_vectors, np.float32) @ query  # (T,)
    best: dict[str, tuple[float, set[str]]] = {}
    for t in np.argsort(-scores, kind="stable").tolist():
        row, c = contents.text_rows[t].tolist()
        caption, score = contents.meta[row]["captions"][c], float(scores[t])
        top, ids = best.setdefault(caption, (score, set()))
        if score >= top - 1e-5:
            ids.add(contents.meta[row]["id"])
    ranked = sorted(best.items(), key=lambda kv: -kv[1][0])
    return [(caption, ids, score) for caption, (score, ids) in ranked[:k]]


def test_image_to_text_lists_each_caption_once_with_its_image_count(shared_captions):
    searcher, rows, _ = shared_captions
    shared = sum(1 for i in range(len(rows)) if i % 3 == 0)
    shared_row = next(t for t, (r, c) in enumerate(searcher.contents.text_rows.tolist())
                      if searcher.contents.meta[r]["captions"][c] == SHARED)
    queries = [searcher.vectors_of([searcher.contents.meta[r]["id"]]) for r in (0, 10)]  # images, (1, D) each
    queries.append(np.asarray(searcher.contents.text_vectors[shared_row : shared_row + 1]))  # its 30 copies tie first
    listed = 0
    for query in queries:
        hits = searcher.search_vectors(query, k=12, target="text")[0]
        captions = [h["caption"] for h in hits]
        assert len(hits) == 12 and len(set(captions)) == 12
        reference = _reference(searcher, query[0], 12)
        assert [h["score"] for h in hits] == pytest.approx([s for _, _, s in reference], abs=1e-5)
        assert {h["caption"] for h in hits} == {c for c, _, _ in reference}  # the same strings (ties in any order)
        best = {c: ids for c, ids, _ in reference}
        assert all(h["id"] in best[h["caption"]] for h in hits)  # each at an image scoring best with it
        counts = {h["caption"]: h["images"] for h in hits}
        listed += SHARED in counts
        assert counts.get(SHARED, shared) == shared  # 30 images carry it: listed once, with its count
        assert all(n == sum(c in row["captions"] for row in rows) for c, n in counts.items())
    assert listed  # the shared caption was among the hits at least once (else the test shows nothing)


@pytest.mark.parametrize("how", [{"m": 8}, {"funnel": 8}, {"bytes": 8}, {"bytes": 8, "rescore": "float"}])
def test_every_search_of_the_captions_lists_distinct_strings(shared_captions, how):
    searcher, _, _ = shared_captions
    queries = searcher.vectors_of([searcher.contents.meta[r]["id"] for r in (0, 1, 3)])
    image = searcher.search_vectors(queries, k=5, **how)  # the image side is not collapsed
    assert all(len(h) == 5 and "images" not in h[0] for h in image)
    for hits in searcher.search_vectors(queries, k=40, target="text", **how):
        assert len({h["caption"] for h in hits}) == len(hits) == 40  # searched deeper until 40 strings were found
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)


def test_asking_for_more_captions_than_there_are_strings_gives_each_once(shared_captions):
    searcher, rows, _ = shared_captions
    distinct = {c for row in rows for c in row["captions"]}
    query = searcher.vectors_of([searcher.contents.meta[0]["id"]])
    hits = searcher.search_vectors(query, k=len(distinct) + 10, target="text")[0]
    assert {h["caption"] for h in hits} == distinct and len(hits) == len(distinct)


def test_the_cli_lists_distinct_captions_with_their_image_counts(shared_captions, capsys):
    from triclip.app.cli import main

    searcher, rows, index = shared_captions
    index = str(index)
    shared = sum(1 for i in range(len(rows)) if i % 3 == 0)
    assert main(["search", "--index", index, "--text", SHARED, "--target", "text", "-k", "6", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len({h["caption"] for h in hits}) == len(hits) == 6
    assert hits[0]["caption"] == SHARED and hits[0]["images"] == shared  # its 30 identical rows: one line
    assert main(["search", "--index", index, "--text", SHARED, "--target", "text", "-k", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and lines[0].endswith(f"{SHARED}  ({shared} images carry this caption)")
