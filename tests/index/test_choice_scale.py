"""``index build --bytes B`` at millions of rows: inverted lists measured without scanning every list per query,
nprobe capped at a share of the lists, slow fits on a subset, random filling of lists for timing.

Latencies come from an injected model (``GivenLatency``): nothing is timed here."""

from __future__ import annotations

import numpy as np
import pytest

from triclip import codecs
from triclip.index import budgets as bud
from triclip.index.budgets import EvalSet, Rules, choose, exhaustive_ids, max_nprobe, overlap, tune_nprobe
from triclip.index.vectors import ShardVectors
from tests.index.conftest import GivenLatency, unit_vectors
from tests.index.test_ivf import _ivf, clustered  # noqa: F401 (clustered: the same fixture)

D = 32


@pytest.mark.parametrize("inner", ["pq", "opq", "rq", "int8", "pqfs"])
def test_the_exhaustive_answers_by_decoding_are_faiss_scanning_every_list(clustered, inner):
    """exhaustive_ids (exact search over the decoded lists where the lists score decoded vectors) gives FAISS's
    answers at nprobe = nlist, for the top 10 and for a shortlist of 100; fast scan is FAISS's own search."""
    x, q = clustered
    codec = _ivf(inner, x)
    assert codec.scores_decoded() == (inner != "pqfs")
    for k in (10, 100):
        faiss_ids = codec.search(q, k, params=codec.exhaustive())[1]
        ours = exhaustive_ids(codec, q, k)
        assert ours.shape == (len(q), k)
        assert overlap(ours, faiss_ids) >= (0.999 if inner != "pqfs" else 1.0)
    few = codec.empty_copy()
    few.add(x[:5])
    assert (exhaustive_ids(few, q[:3], 10)[:, 5:] == -1).all()  # fewer vectors than k: -1 beyond, as FAISS


@pytest.mark.parametrize("inner", ["opq", "rq"])
def test_the_lists_decoded_a_group_at_a_time_are_the_reconstruction_and_the_exhaustive_answers(clustered, inner):
    """decoded_lists (what exhaustive_ids and the tuning at N scan, a group of lists at a time, never the whole
    collection) yields every stored id once with its reconstructed vector, in groups of whole lists of about
    ``rows``; exhaustive_ids over it does not depend on the group size."""
    x, q = clustered
    codec = _ivf(inner, x)
    groups = list(codec.decoded_lists(rows=100))
    sizes = [len(ids) for ids, _ in groups]
    biggest = max(codec.ivf.invlists.list_size(i) for i in range(codec.ivf.nlist))
    assert len(groups) > 1 and max(sizes) < 100 + biggest and sum(sizes) == len(codec)
    ids = np.concatenate([i for i, _ in groups])
    assert sorted(ids.tolist()) == list(range(len(codec)))
    np.testing.assert_allclose(np.concatenate([v for _, v in groups]), codec.reconstruct(ids), atol=1e-6)
    one = list(codec.decoded_lists(rows=10**9))
    assert len(one) == 1 and np.array_equal(one[0][0], ids)
    from triclip.index.vectors import exact_topk_of

    assert np.array_equal(exact_topk_of(groups, q, 10), exact_topk_of(one, q, 10))


def test_a_target_the_quarter_of_the_lists_misses_is_capped_and_its_share_reported(clustered):
    """A target only every list meets (1.0 of the exhaustive top 10) stops at a quarter of the lists, and says
    what that keeps (below the target: the candidate's recall is multiplied by it)."""
    x, q = clustered
    codec = _ivf("pq", x)
    nprobe, kept = tune_nprobe(codec, q[:200], 1.0)
    assert nprobe == max_nprobe(32) == 8 and 0.5 < kept < 1.0
    assert kept == overlap(codec.search(q[:200], 10, params={"nprobe": 8})[1], exhaustive_ids(codec, q[:200], 10))
    assert max_nprobe(2) == 1 and max_nprobe(4096) == 1024


def test_the_choice_of_inverted_lists_reports_the_capped_share_in_its_recall(clustered):
    """At N >= IVF_MIN_N, inverted lists are candidates; with a target the capped nprobe cannot keep, each keeps
    nprobe <= a quarter of its lists and its recall is its codes' recall times the share kept."""
    x, q = clustered
    evaluation = EvalSet.of(x, q[:150], np.arange(150), [f"t{i}" for i in range(150)], "validation", "synthetic")
    choice = choose(8, x, evaluation, force="ivf",
                    rules=Rules(n=1_000_000, recall_target=1.0, rescore=False, model=GivenLatency()))
    measured = [t for t in choice.tried if t["recall"] is not None]
    assert measured and all(t["codec"] == "ivf" for t in measured)
    for t in measured:
        nlist, nprobe = (int(v) for v in t["label"].split(",")[0][3:].split("/"))
        assert nprobe <= max_nprobe(nlist) and t["keeps"] < 1.0
        assert t["recall"] == pytest.approx(t["code_recall"] * t["keeps"], abs=1e-4)


def test_slow_fits_take_a_subset_of_the_sample_and_the_rest_the_whole():
    """RQ, RQ fast scan, OPQ and lists of RQ are fitted on SLOW_FIT_ROWS of a larger sample (seeded: the same
    rows each time); the others, lists of PQ included, on all of it."""
    sample = np.random.default_rng(0).standard_normal((6000, 8)).astype(np.float32)
    spec = lambda codec, **p: codecs.CodecSpec(codec, 8, 4, p)  # noqa: E731
    for slow in (spec("rq", M=4, nbits=8), spec("rqfs", M=8, nbits=4), spec("opq", M=4, nbits=8),
                 spec("ivf", inner="rq", M=4, nbits=8, nlist=16)):
        rows = bud.fit_sample(sample, slow)
        assert len(rows) == codecs.base.SLOW_FIT_ROWS < len(sample)
        np.testing.assert_array_equal(rows, bud.fit_sample(sample, slow))
        assert len({r.tobytes() for r in rows} & {r.tobytes() for r in sample}) == len(rows)  # rows of the sample
    for quick in (spec("pq", M=4, nbits=8), spec("int8"), spec("ivf", inner="pq", M=4, nbits=8, nlist=16)):
        assert bud.fit_sample(sample, quick) is sample


@pytest.mark.parametrize("inner", ["rq", "int8", "pqfs"])
def test_random_filling_of_lists_adds_that_many_codes_after_the_real_ones(clustered, inner):
    """add_random (what a timing fills a copy with up to its size) adds n codes with the ids after the real
    rows, spread over the lists, and leaves the real rows' codes as they were."""
    x, q = clustered
    codec = _ivf(inner, x[:500])
    before = codec.reconstruct()  # (500, D)
    codec.add_random(4000, np.random.default_rng(1))
    assert len(codec) == 4500 and codec.ivf.ntotal == 4500
    lists = codec.ivf.invlists
    sizes = np.array([lists.list_size(i) for i in range(codec.ivf.nlist)])
    assert sizes.sum() == 4500 and (sizes > 0).all()
    ids = codec.search(q[:20], 4500, params=codec.exhaustive())[1]
    assert sorted(ids[0].tolist()) == list(range(4500))  # every id once
    np.testing.assert_array_equal(codec.reconstruct(np.arange(500)), before)


@pytest.mark.parametrize("inner", ["pq", "opq", "rq", "int8"])
def test_the_nprobe_ladder_by_decoding_is_faiss_at_each_nprobe(clustered, inner):
    """The decoded lists a query scans at nprobe p, searched exactly, give FAISS's top 10 at p (p = 1 .. nlist);
    so tune_nprobe picks what FAISS's own searches would."""
    x, q = clustered
    codec = _ivf(inner, x)
    search = bud._probed_by_decoding(codec, q[:200])
    for nprobe in (1, 2, 4, 8, 32):
        assert overlap(search(nprobe), codec.search(q[:200], 10, params={"nprobe": nprobe})[1]) >= 0.995
    shortlist = codec.search(q[:200], 100, params={"nprobe": 4})[1]  # a shortlist, as tune_shortlist searches it
    assert overlap(search(4, 100), shortlist) >= 0.995 and search(4, 100).shape == (200, 100)
    ranks, lists = codec.list_ranks(q[:5])
    assert ranks.shape == (5, 32) and (np.sort(ranks, axis=1) == np.arange(32)).all() and lists.shape == (3000,)



def test_at_scale_the_choice_ranks_by_the_share_of_the_exact_top_10_it_holds(clustered):
    """At N >= IVF_MIN_N every variant carries its fidelity (the share of the exact float top 10 among the tuning
    sample its answers hold; the kept code's computed here again from its codes) and the kept one is the best by
    (fidelity up to the recall target, fewer bytes, faster); below IVF_MIN_N by (recall up to the float recall,
    fewer bytes, faster). Both report recall and fidelity."""
    x, q = clustered
    evaluation = EvalSet.of(x[:300], q[:150], np.argmax(q[:150] @ x[:300].T, axis=1), [f"t{i}" for i in range(150)],
                            "validation", "synthetic")
    truth = bud.exact_topk(x, q[:150], 10)  # (Q, 10) the tuning queries' exact top 10 in the sample (x, in order)
    model = FillingLatency(reference=1.0, per_candidate=0.0001)
    for n, rescore in ((1_000_000, False), (1_000_000, True), (len(x), True)):
        scale = n > len(x)
        choice = choose(8, x, evaluation, rules=Rules(n=n, recall_target=0.9, rescore=rescore, model=model))
        assert choice.ranked_by == ("fidelity" if scale else "recall")
        measured = [t for t in choice.tried if t["recall"] is not None]
        assert len(measured) >= 2 and all(0.0 <= t["fidelity"] <= 1.0 for t in measured)
        assert any(t["shortlist"] for t in measured) == rescore
        cap = 0.9 if scale else choice.full_recall
        score = lambda t: (min(t["fidelity"] if scale else t["recall"], cap), -t["bytes"], -t["latency_ms"])  # noqa: E731
        within = [t for t in measured if t["latency_ms"] <= choice.bound_ms]
        assert score(choice.kept.entry(D)) == max(score(t) for t in within)
        if not rescore:  # codes alone: its fidelity is its top 10's overlap with the exact one
            filled = choice.kept.codec.empty_copy()
            filled.add(x)
            assert choice.kept.fidelity == pytest.approx(overlap(filled.search(q[:150], 10)[1], truth), abs=1e-9)


class FillingLatency(GivenLatency):
    """Given latencies, with the real model's side effect: a timed copy is filled up with random entries
    (``LatencyModel.search``), which must not count in any figure measured on it."""

    def search(self, codec, queries, k, n, params=None):
        codec.add_random(500, np.random.default_rng(len(codec)))
        return super().search(codec, queries, k, n, params)


def test_a_budget_keeps_a_smaller_budgets_code_that_ranks_above_its_own(clustered):
    """A smaller budget's kept code that ranks above a larger budget's (fidelity up to the target, fewer bytes,
    faster) and answers within the larger one's bound is kept at the larger budget too, with a note; one over the
    bound, or ranking below, is not."""
    x, _ = clustered
    fit = lambda spec: codecs.fit(spec, x)  # noqa: E731
    small = fit(codecs.CodecSpec("binary", D, 4, {}))  # 4 B stored
    large = fit(codecs.CodecSpec("int8", 8, 8, {}))  # 8 B stored

    def choice(budget, codec, fidelity, ms, bound=1.0):
        kept = bud.Variant(codec, 0.5, bud.Latency(ms, "given"), fidelity=fidelity, by_fidelity=True)
        return bud.Choice(budget, codec, 0.5, [], kept, bound_ms=bound)

    out = bud.no_worse_than_smaller({4: choice(4, small, 0.97, 0.5), 8: choice(8, large, 0.6, 0.2)}, 0.95)
    assert out[8].codec is small and out[8].kept.fidelity == 0.97 and "4 B budget's code" in out[8].note
    assert out[4].codec is small and out[8].budget == 8 and out[8].bound_ms == 1.0
    slow = bud.no_worse_than_smaller({4: choice(4, small, 0.97, 2.0, bound=5.0), 8: choice(8, large, 0.6, 0.2)}, 0.95)
    assert slow[8].codec is large  # 2 ms is over the 8 B budget's 1 ms bound
    worse = bud.no_worse_than_smaller({4: choice(4, small, 0.5, 0.1), 8: choice(8, large, 0.6, 0.2)}, 0.95)
    assert worse[8].codec is large and worse[8].note == ""
    tie = bud.no_worse_than_smaller({4: choice(4, small, 0.96, 0.5), 8: choice(8, large, 0.99, 0.2)}, 0.95)
    assert tie[8].codec is small  # both reach the target: the fewer bytes


def test_choose_all_keeps_a_smaller_budgets_code_at_any_size(clustered, monkeypatch):
    """Below the size of inverted lists too (a few thousand rows, as the demo): a larger budget whose own
    candidates measured below a smaller budget's kept code keeps that code (the demo's 16 B budget had kept
    int8 m=16 alone at recall .509 under the 4 B budget's .606); one whose own ranks higher keeps its own; with a
    codec forced (``--codec``) each budget keeps that codec at its own size there."""
    x, _ = clustered
    small = codecs.fit(codecs.CodecSpec("binary", D, 4, {}), x)
    own = {8: codecs.fit(codecs.CodecSpec("int8", 8, 8, {}), x), 16: codecs.fit(codecs.CodecSpec("int8", 16, 16, {}), x)}
    recall = {4: 0.606, 8: 0.70, 16: 0.509}

    def given(budget, *args, **kwargs):
        codec = small if budget == 4 else own[budget]
        kept = bud.Variant(codec, recall[budget], bud.Latency(0.1, "given"))
        return bud.Choice(budget, codec, recall[budget], [], kept, bound_ms=0.2)

    monkeypatch.setattr(bud, "choose", given)
    vectors = ShardVectors.of([x[:2000]])
    assert not bud.at_scale(vectors.count)
    out = {c.budget: c for c in bud.choose_all([4, 8, 16], vectors, None)}
    assert out[4].codec is small and out[8].codec is own[8] and out[8].note == ""
    assert out[16].codec is own[8] and out[16].recall == 0.70 and "8 B budget's code" in out[16].note
    forced = {c.budget: c for c in bud.choose_all([4, 8, 16], vectors, None, force="int8")}
    assert forced[16].codec is own[16] and forced[16].note == ""  # --codec C: C at each budget, as asked


@pytest.mark.parametrize("queries, k, length, ids", [(200, 10, 5000, 6000), (7, 10, 30, 12), (3, 1, 1, 2)])
def test_overlap_equals_the_per_row_set_intersection(queries, k, length, ids, monkeypatch):
    """The vectorised overlap against its loop over rows of sets, with -1 (none found) and ids repeated within a
    row on both sides; rows compared in blocks give the same share as all at once."""
    rng = np.random.default_rng(queries)
    found, truth = rng.integers(-1, ids, (queries, length)), rng.integers(-1, ids, (queries, k))
    slow = np.mean([len(set(f.tolist()) & set(t.tolist())) / len(t) for f, t in zip(found, truth)])
    assert bud.overlap(found, truth) == slow
    monkeypatch.setattr(bud, "OVERLAP_CELLS", 1)  # one row per block
    assert bud.overlap(found, truth) == slow
    assert bud.overlap(truth, truth) == np.mean([len(set(t.tolist())) / k for t in truth])


def test_overlap_within_counts_near_ties_of_the_kth_as_ann_benchmarks_knn_recall_does():
    rng = np.random.default_rng(0)
    q, x = unit_vectors(rng, 50, 16), unit_vectors(rng, 3000, 16)
    exact = np.sort(q @ x.T, axis=1)[:, ::-1]  # (Q, N) descending
    found = np.sort(rng.choice(exact[:, :40].T, 10, replace=False).T, axis=1)[:, ::-1]  # (Q, 10): 10 of the top 40
    found[0, -1] = -np.inf  # a query that found only 9
    for eps in (0.0, 1e-3, 0.05):
        slow = [sum(1 for s in found[i] if 1 - s <= (1 - exact[i, 9]) + eps) / 10 for i in range(len(q))]  # its loop
        assert bud.overlap_within(found, exact[:, 9], eps) == pytest.approx(np.mean(slow))
    assert bud.overlap_within(exact[:, :10], exact[:, 9], 0.0) == 1.0  # the exact top 10: all found
    assert bud.overlap_within(found, exact[:, 9], 0.0) < bud.overlap_within(found, exact[:, 9], 0.05)
    with pytest.raises(ValueError, match="eps"):
        bud.overlap_within(found, exact[:, 9], -1.0)
