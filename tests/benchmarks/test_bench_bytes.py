"""benchmarks.bench_bytes: recall from ranked ids over distinct texts, re-scoring, and one small measurement."""

import json

import numpy as np
import pytest

from benchmarks import bench_bytes as bb
from triclip.index import codecs


def _split(n: int, dim: int, seed: int, texts=None) -> dict:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, dim)).astype(np.float32) * np.linspace(2, 0.2, dim).astype(np.float32)
    image = z + 0.3 * rng.standard_normal((n, dim)).astype(np.float32)
    text = z + 0.3 * rng.standard_normal((n, dim)).astype(np.float32)
    unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)  # noqa: E731
    return {"image": unit(image), "text": unit(text), "owner": np.arange(n), "texts": texts or [f"t{i}" for i in range(n)]}


def test_queries_merge_repeated_texts_and_mark_every_image_carrying_them():
    split = _split(4, 8, 0, texts=["a", "b", "a", "c"])
    q, relevant = bb.queries(split)
    assert q.shape == (3, 8)
    assert relevant.tolist() == [[True, False, True, False], [False, True, False, False], [False, False, False, True]]


def test_recall_counts_a_relevant_id_in_the_top_k_and_ignores_padding():
    relevant = np.zeros((2, 20), bool)
    relevant[0, 5] = relevant[1, 19] = True
    ids = np.array([[5] + list(range(6, 15)), [-1] * 10])
    assert bb.recall(ids, relevant) == {"r1": 0.5, "r10": 0.5}
    ids[1, 9] = 19
    assert bb.recall(ids, relevant) == {"r1": 0.5, "r10": 1.0}


def test_rescore_reranks_the_shortlist_by_the_stored_vectors():
    stored = np.eye(4, dtype=np.float32)
    q = np.array([[0.1, 0.2, 0.9, 0.3]], np.float32)
    shortlist = np.array([[0, 1, 2, 3, -1] + [-1] * 10])
    assert bb.rescore(shortlist, q, stored)[0, :4].tolist() == [2, 3, 1, 0]


def test_image_to_text_sides_swap_gallery_and_queries_and_drop_images_without_a_text():
    split = _split(4, 8, 0, texts=["a", "b", "a"])
    split["owner"] = np.array([0, 1, 3])  # image 2 carries no text
    gallery, q, relevant = bb.sides(split, "i2t")
    assert gallery.shape == (2, 8) and q.shape == (3, 8)
    np.testing.assert_array_equal(q, split["image"][[0, 1, 3]])
    assert relevant.tolist() == [[True, False], [False, True], [True, False]]


@pytest.mark.parametrize("direction", ["t2i", "i2t"])
def test_recall_matches_retrieval_metrics(direction, monkeypatch):
    split = _split(60, 16, 1, texts=[f"t{i % 45}" for i in range(60)])  # some texts on two images
    bb.check_against_metrics(split, direction)  # raises SystemExit when the two disagree
    sides = bb.sides
    monkeypatch.setattr(bb, "sides", lambda s, d: (lambda g, q, r: (g, q, np.roll(r, 1, axis=1)))(*sides(s, d)))
    with pytest.raises(SystemExit, match="recall check failed"):  # relevance off by one row here, not there
        bb.check_against_metrics(split, direction)


@pytest.mark.slow
def test_measure_run_gives_every_method_a_recall_within_its_budget():
    splits = {"train": _split(400, 32, 0), "val": _split(80, 32, 1), "test": _split(80, 32, 2)}
    out = json.loads(json.dumps(bb.measure_run(splits, [4], log=lambda s: None)))
    assert out["float32 full D"]["128"]["r10"] == pytest.approx(1.0, abs=0.05)
    for name in ("triclip (chosen on val)", "mixed", "int8", "binary", "ST binary+rescore", "ST binary->int8 (rescore)"):
        assert 0.0 < out[name]["4"]["r10"] <= 1.0, name
    chosen = out["triclip (chosen on val)"]["4"]
    families = {codecs.family(name) for name in codecs.names()}
    assert chosen["val_r10"] == max(out[f][str(4)]["val_r10"] for f in families if f in out)
    assert out["triclip rescore (float32 on disk)"]["4"]["r10"] >= chosen["r10"] - 0.05
    assert "PCA+PQ" in out and "float32 top-m (today)" in out
    flipped = json.loads(json.dumps(bb.measure_run(splits, [4], log=lambda s: None, direction="i2t")))
    assert flipped["float32 full D"]["128"]["r10"] == pytest.approx(1.0, abs=0.05)
    assert 0.0 < flipped["triclip (chosen on val)"]["4"]["r10"] <= 1.0
