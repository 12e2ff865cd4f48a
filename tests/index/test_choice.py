"""``index build --bytes B [--latency-ms L]``: the best recall within a latency, the two stages, the table.

Latencies come from an injected model (``GivenLatency``): nothing is timed here; the timed model is measured
in benchmarks (docs/benchmarks.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from triclip.core.errors import UserError
from triclip.index import budgets as bud
from triclip.index import report
from triclip import codecs
from triclip.index.budgets import EvalSet, Rules, choose
from triclip.index.vectors import SQ8Rows
from triclip.index.store import current_version
from tests.index.conftest import GivenLatency, unit_vectors

D = 32


@pytest.fixture(scope="module")
def collection():
    """1,200 clustered unit vectors; an evaluation set over all of them whose queries are noisy copies of 150 (each
    answered by its own row): the float vectors find 99% of them, 4-byte codes alone 80% at best."""
    rng = np.random.default_rng(0)
    centres = unit_vectors(rng, 30, D)
    x = centres[rng.integers(0, 30, 1200)] + 0.8 * unit_vectors(rng, 1200, D)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    q = x[:150] + 1.0 * unit_vectors(rng, 150, D)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    evaluation = EvalSet.of(x, q, np.arange(150), [f"t{i}" for i in range(150)], "validation", "synthetic")
    return x, evaluation


def _kept(choice) -> dict:
    return next(t for t in choice.tried if t.get("label") == choice.codec.spec.label()
                and t.get("shortlist") == choice.kept.shortlist)


def test_no_bound_keeps_the_best_recall_and_a_tight_one_a_fast_code(collection):
    x, evaluation = collection
    slow = {"float32": 0.5, "int8": 0.5, "mixed": 0.5, "pq": 0.5, "opq": 0.5, "rq": 0.5, "binary": 0.5,
            "rabitq": 0.5}
    model = GivenLatency(reference=1.0, codes={**slow, "pqfs": 0.01, "rqfs": 0.02, "rabitqfs": 0.03})
    free = choose(8, x, evaluation, rules=Rules(n=len(x), rescore=False, model=model))
    measured = [t for t in free.tried if t["recall"] is not None]
    # the best, none excluded; recalls above full D's tie with it (RQ's encoding varies with the thread count)
    assert min(free.recall, free.full_recall) == max(min(t["recall"], free.full_recall) for t in measured)
    assert free.kept.latency.ms <= 1.0 == free.bound_ms and free.note == ""
    tight = choose(8, x, evaluation, rules=Rules(n=len(x), latency_ms=0.015, rescore=False, model=model))
    assert tight.codec.spec.codec == "pqfs" and tight.kept.latency.ms == 0.01 and tight.bound_ms == 0.015
    assert tight.recall <= free.recall
    skipped = {t["codec"]: t["skipped"] for t in tight.tried if t.get("skipped")}
    assert {"rq", "rqfs"} <= set(skipped)  # slow to fit and slower than the bound: left out unfitted
    assert "not fitted below 64 B" in skipped["pq"]  # below 64 B plain PQ never measured best: shown, not fitted
    assert all("over 0.015 ms" in why for codec, why in skipped.items() if codec != "pq")
    assert "float32" not in skipped  # quick to fit: fitted, measured, then over the bound
    assert all(t["latency_ms"] > 0.015 for t in tight.tried if t["recall"] is not None and t["codec"] != "pqfs")


def test_a_re_rank_is_measured_on_the_rows_as_the_stored_vectors_keep_them(collection):
    """float32 rows as they are, float16 rounded, sq8 coded and decoded: a re-ranked variant's recall is the
    re-rank of its shortlist by those rows; with sq8 ranges made 101 times too wide (2-3 steps over the rows) it
    falls."""
    x, evaluation = collection
    ranges = SQ8Rows.fit(x)
    coarse = np.r_[ranges[:D] - 50 * ranges[D:], 101 * ranges[D:]].astype(np.float32)  # steps 101x as wide
    model = GivenLatency(reference=1.0, per_candidate=0.0)
    rules = {"float32": Rules(n=len(x), recall_target=0.9, model=model),
             "float16": Rules(n=len(x), recall_target=0.9, model=model, vector_bytes=2),
             "sq8": Rules(n=len(x), recall_target=0.9, model=model, vector_bytes=1, sq8=coarse)}
    np.testing.assert_array_equal(rules["float32"].kept(x), x)
    assert 0 < np.abs(rules["float16"].kept(x) - x).max() <= 2**-11
    store = SQ8Rows(np.empty((0, D), np.uint8), coarse)
    np.testing.assert_array_equal(rules["sq8"].kept(x), store.decode(store.encode(x)))
    tune = bud.TuneSet.of(x, evaluation)
    spec = next(s for s in codecs.candidates(4, D, len(x)) if s.codec == "pq")
    codec = codecs.fit(spec, x)
    recalls = {}
    for name, rule in rules.items():
        staged = [v for v in bud.evaluate(codec, evaluation, tune, rule) if v.shortlist is not None]
        assert staged
        for v in staged:  # N = the sample = the evaluation gallery: its shortlist as it is, nothing probed
            assert v.recall == bud.measure(codec, evaluation, v.shortlist, rule.kept(evaluation.gallery))
        recalls[name] = [v.recall for v in staged]
    assert recalls["sq8"][-1] < recalls["float32"][-1] - 0.05


def test_a_bound_nothing_meets_is_one_line_and_the_default_keeps_the_fastest(collection):
    x, evaluation = collection
    model = GivenLatency(reference=0.0001)  # every code slower than the float scan
    with pytest.raises(UserError, match=r"no code of 8 bytes per vector answers within 0.0001 ms at N = 1,200"):
        choose(8, x, evaluation, rules=Rules(n=len(x), latency_ms=0.0001, model=model))
    kept = choose(8, x, evaluation, rules=Rules(n=len(x), model=model))
    assert "the fastest kept" in kept.note
    assert kept.kept.latency.ms == min(t["latency_ms"] for t in kept.tried if t["recall"] is not None)


def test_two_stages_re_rank_a_tuned_shortlist_by_the_float_vectors(collection):
    """With a free re-rank, a small fast code plus the float vectors reaches full-D recall and is kept; its
    shortlist is the shortest that holds the target share of the exact top 10 on the sample; --no-rescore
    keeps the codes alone."""
    x, evaluation = collection
    model = GivenLatency(reference=1.0, per_candidate=0.0)
    two = choose(4, x, evaluation, rules=Rules(n=len(x), recall_target=0.9, model=model))
    assert two.kept.shortlist is not None and two.kept.shortlist in bud.SHORTLISTS
    assert min(two.recall, two.full_recall) == two.full_recall  # the float vectors' own recall
    entry = _kept(two)
    assert entry["stages"] == "codes + float re-rank" and entry["disk_bytes_per_query"] == 4 * D * two.kept.shortlist
    half = choose(4, x, evaluation, rules=Rules(n=len(x), recall_target=0.9, model=model, vector_bytes=2))
    assert _kept(half)["disk_bytes_per_query"] == 2 * D * half.kept.shortlist  # float16 vectors: half the reads
    stored = half.codec.empty_copy()
    stored.add(x)
    rescore = report.manifest_entry(half, stored, evaluation, "image.b4.codec", vector_bytes=2)["rescore"]
    assert rescore["disk_bytes_per_query"] == 2 * D * half.kept.shortlist
    tune = bud.TuneSet.of(x, evaluation)
    copy = two.codec.empty_copy()
    copy.add(x)
    shortlist = copy.search(tune.queries, two.kept.shortlist)[1]
    assert bud.overlap(shortlist, tune.truth) >= 0.9  # holds the target ...
    shorter = max((n for n in bud.SHORTLISTS if n < two.kept.shortlist), default=None)
    if shorter is not None:  # ... and the next shorter one does not
        assert bud.overlap(copy.search(tune.queries, shorter)[1], tune.truth) < 0.9
    alone = choose(4, x, evaluation, rules=Rules(n=len(x), recall_target=0.9, rescore=False, model=model))
    assert alone.kept.shortlist is None and all(t.get("shortlist") is None for t in alone.tried)
    costly = choose(4, x, evaluation, rules=Rules(n=len(x), recall_target=0.9,
                                                  model=GivenLatency(reference=1.0, per_candidate=1.0)))
    assert costly.kept.shortlist is None  # a re-rank slower than the float scan is not kept


def test_a_larger_collection_scales_the_shortlist_and_says_so(collection):
    x, evaluation = collection
    model = GivenLatency(reference=1.0, per_candidate=0.0)
    small = choose(4, x, evaluation, rules=Rules(n=len(x), recall_target=0.9, model=model))
    large = choose(4, x, evaluation, rules=Rules(n=10 * len(x), recall_target=0.9, model=model))
    staged = [t for t in large.tried if t.get("shortlist")]
    assert staged and large.kept.shortlist_how == "extrapolated" and small.kept.shortlist_how == "measured"
    same = [t for t in staged if t["label"] == small.codec.spec.label()]
    if same and small.kept.shortlist:
        assert same[0]["shortlist"] == 10 * small.kept.shortlist


def test_the_build_records_the_stages_search_uses_them_and_the_table_shows_latency(run_dir, shapes_dir, tmp_path,
                                                                                  given_latency, capsys):
    from triclip.app.cli import main
    from triclip.index.search import Searcher

    given_latency.per_candidate = 0.0  # a free re-rank: the codes and their shortlist re-ranked find more here
    out = tmp_path / "index"
    assert main(["index", "build", "--run", str(run_dir), "--data", str(shapes_dir / "train.jsonl"), "--out", str(out),
                 "--bytes", "4", "--latency-ms", "0.5", "--recall-target", "0.8", "--codec", "pqfs"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    header = next(line for line in lines if line.split()[:3] == ["bytes", "codes", "code"])
    assert "latency" in header.split() and "RAM" in header.split() and "disk/query" in header.split()
    rows = [line for line in lines if line.strip().startswith("4 ")]
    assert len(rows) == 2 and all("ms (given)" in row for row in rows)
    candidates = [line for line in lines if line.strip().startswith("- ")]
    assert len(candidates) == 4 and all("ms (given)" in c or "not fitted" in c or "its scan" in c or "cannot win" in c
                                        for c in candidates)
    assert any("one query, one thread" in line and "extrapolated" in line for line in lines)
    manifest = json.loads((out / current_version(out) / "manifest.json").read_text())
    entry = manifest["budgets"]["4"]
    assert entry["latency"]["how"] == "given" and entry["latency_bound_ms"] == 0.5
    assert entry["rescore"] is not None and entry["rescore"]["with"] == "float"  # a free re-rank finds more
    assert entry["recall"] > entry["code_recall"]
    searcher = Searcher.load(out)
    queries = np.asarray(searcher.contents.text_vectors[:20])
    staged = searcher.search_vectors(queries, k=5, bytes=4)
    codes = searcher.contents.codes[4]
    shortlist = codes.search(queries, -(-entry["rescore"]["shortlist"] * 5 // 10))[1]
    vectors = np.asarray(searcher.contents.vectors)
    for row, hits, short in zip(queries, staged, shortlist):
        order = short[np.argsort(-(vectors[short] @ row), kind="stable")[:5]]
        assert [h["id"] for h in hits] == [searcher.contents.meta[i]["id"] for i in order]
    alone = searcher.search_vectors(queries, k=5, bytes=4, rescore="none")
    assert [[h["id"] for h in r] for r in alone] == [[searcher.contents.meta[i]["id"] for i in r]
                                                      for r in codes.search(queries, 5)[1].tolist()]
    assert main(["index", "build", "--run", str(run_dir), "--data", str(shapes_dir / "train.jsonl"), "--out",
                 str(tmp_path / "x"), "--latency-ms", "1"]) == 2
    assert "--latency-ms bounds the codes of --bytes" in capsys.readouterr().err


def test_the_default_bound_never_leaves_a_budget_without_a_code(collection):
    """Every candidate left out unfitted by its probe (slower than the float scan, e.g. a timer's noise on a tiny
    collection): without --latency-ms they are fitted after all and the fastest is kept; with it, one line."""
    x, evaluation = collection
    model = GivenLatency(reference=0.0001)  # every probe over the float scan's time
    kept = choose(8, x, evaluation, force="rq", rules=Rules(n=len(x), model=model))
    assert kept.codec.spec.codec == "rq" and "the fastest kept" in kept.note
    assert not any(t.get("skipped") for t in kept.tried)  # fitted after all
    with pytest.raises(UserError, match="could be fitted: its scan alone takes"):
        choose(8, x, evaluation, force="rq", rules=Rules(n=len(x), latency_ms=0.0001, model=model))


def test_a_slow_fit_takes_a_capped_seeded_sample_and_two_fits_of_it_are_the_same_code():
    """The collection's sample is at most FIT_ROWS rows drawn by the seed, a slow codec's fit at most its fit_rows of
    it (seeded too): two choices fit the very same code, and another seed draws other rows."""
    import faiss

    from triclip import codecs
    from triclip.codecs.base import SLOW_FIT_ROWS
    from triclip.index.budgets import FIT_ROWS, _sample, fit_sample

    rng = np.random.default_rng(3)
    x = rng.standard_normal((FIT_ROWS + 500, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    sample = _sample(x, 0)
    assert sample.shape == (FIT_ROWS, 16) and np.array_equal(sample, _sample(x, 0))
    assert not np.array_equal(sample, _sample(x, 1))
    spec = codecs.candidates(2, 16)[[s.codec for s in codecs.candidates(2, 16)].index("rq")]
    rows = fit_sample(sample, spec)
    assert len(rows) == SLOW_FIT_ROWS == codecs.lookup("rq").fit_rows and np.array_equal(rows, fit_sample(sample, spec))
    first, second = (codecs.fit(spec, fit_sample(sample, spec)) for _ in range(2))
    assert np.array_equal(faiss.serialize_index(first.index), faiss.serialize_index(second.index))
    cheap = codecs.candidates(2, 16)[[s.codec for s in codecs.candidates(2, 16)].index("int8")]
    assert fit_sample(sample, cheap) is sample  # a cheap fit takes the whole sample


def test_a_quick_slow_fit_goes_first_and_its_full_recall_leaves_the_slower_one_unfitted(collection, monkeypatch):
    """RQ16x4fs (256 centroids to train) is fitted before RQ8x8 (2,048), though RQ comes first among the candidates:
    its shortlist re-ranked by the float vectors already finds what they find, faster than RQ8x8's probe, so RQ8x8
    cannot win and is never fitted (the demo's caption codes at 8 B spent 14 s fitting it)."""
    x, evaluation = collection
    both = [s for s in codecs.candidates(8, D, len(x)) if s.codec in ("rq", "rqfs")]
    assert [s.codec for s in both] == ["rq", "rqfs"]
    assert codecs.lookup("rqfs").fit_work(both[1]) < codecs.lookup("rq").fit_work(both[0]) == 8 * 256
    monkeypatch.setattr(codecs, "candidates", lambda budget, dim, n=None: list(both))
    fitted, fit = [], codecs.fit
    monkeypatch.setattr(codecs, "fit", lambda spec, rows, *args: fitted.append(spec.codec) or fit(spec, rows, *args))
    choice = choose(8, x, evaluation, rules=Rules(n=len(x), model=GivenLatency(codes={"rq": 0.5, "rqfs": 0.02})))
    assert fitted == ["rqfs"] and choice.codec.spec.codec == "rqfs" and choice.kept.shortlist
    assert choice.recall >= choice.full_recall
    rq = next(t for t in choice.tried if t["codec"] == "rq")
    assert rq["recall"] is None and "cannot win" in rq["skipped"]
