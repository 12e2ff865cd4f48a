"""RQ's codebooks reused: a fit of M codebooks cut from an earlier fit of more on the same rows is the code a fit
of M trains (triclip.codecs.rq.RQBooks), byte for byte; other rows, or more codebooks, are fitted anew."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from triclip import codecs
from triclip.codecs import rq as rq_module
from triclip.codecs.spec import CodecSpec
from triclip.index import budgets as bud
from triclip.index.vectors import ShardVectors
from tests.index.conftest import GivenLatency

D = 32


def _rows(seed: int, n: int = 600) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _spec(name: str, books: int) -> CodecSpec:
    nbits = 8 if name == "rq" else 4
    return CodecSpec(name, D, books * nbits // 8, {"M": books, "nbits": nbits})


def _fresh(spec: CodecSpec, x: np.ndarray) -> codecs.Codec:
    rq_module._BOOKS.clear()
    return codecs.fit(spec, x)


def _same(a: codecs.Codec, b: codecs.Codec) -> bool:
    return np.array_equal(faiss.serialize_index(a.index), faiss.serialize_index(b.index))


@pytest.mark.parametrize("name,big,small", [("rq", 4, 2), ("rqfs", 8, 4)])
def test_fewer_codebooks_cut_from_a_larger_fit_are_the_fit_of_fewer(name, big, small, monkeypatch):
    x = _rows(0)
    direct = _fresh(_spec(name, small), x)
    rq_module._BOOKS.clear()
    codecs.fit(_spec(name, big), x)
    trains = []
    monkeypatch.setattr(faiss.IndexPreTransform, "train", lambda self, *a: trains.append(a))  # a cut trains nothing
    cut = codecs.fit(_spec(name, small), x)
    assert not trains and _same(cut, direct)
    q = _rows(1, 50)
    for codec in (cut, direct):
        codec.add(x)
    assert np.array_equal(cut.search(q, 10)[1], direct.search(q, 10)[1])


def test_other_rows_or_more_codebooks_are_fitted_anew():
    x, other = _rows(0), _rows(0).copy()
    other[7] = _rows(2, 1)[0]  # one row changed
    rq_module._BOOKS.clear()
    codecs.fit(_spec("rq", 4), x)
    assert _same(codecs.fit(_spec("rq", 2), other), _fresh(_spec("rq", 2), other))
    rq_module._BOOKS.clear()
    codecs.fit(_spec("rq", 2), x)
    assert _same(codecs.fit(_spec("rq", 4), x), _fresh(_spec("rq", 4), x))  # more codebooks: a fit of its own


def test_budgets_are_measured_largest_first_and_returned_in_the_order_asked(monkeypatch):
    x = _rows(0, 1200)
    evaluation = bud.EvalSet.of(x, x[:100], np.arange(100), [f"t{i}" for i in range(100)], "validation", "synthetic")
    seen = []
    choose = bud.choose
    monkeypatch.setattr(bud, "choose", lambda b, *a, **k: seen.append(b) or choose(b, *a, **k))
    rules = bud.Rules(n=len(x), model=GivenLatency())
    choices = bud.choose_all([2, 4, 1], ShardVectors.of([x]), evaluation, force="rq", rules=rules)
    assert seen == [4, 2, 1] and [c.budget for c in choices] == [2, 4, 1]
