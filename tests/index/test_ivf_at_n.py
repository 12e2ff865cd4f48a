"""Inverted lists stored at the collection's N: the kept code refitted with nlist = lists_for(N) (not the
sample's capped nlist), filled, and its nprobe tuned at N against exact search over the whole collection.

Latencies come from an injected model (``GivenLatency``): nothing is timed here."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from triclip.codecs import ivf
from triclip.index import budgets as bud
from triclip.index import report
from triclip.index import scale
from triclip.index.budgets import EvalSet, Rules, overlap
from triclip.index.vectors import ShardVectors, SQ8Rows
from tests.index.conftest import GivenLatency, unit_vectors

N, D = 25_000, 32  # the smallest N whose lists_for(N) = 512 lists get >= 39 training rows each


@pytest.fixture(scope="module")
def collection():
    """N clustered unit vectors (float16 shards, as stored) and 200 queries near some of them."""
    rng = np.random.default_rng(0)
    centres = unit_vectors(rng, 300, D)
    x = centres[rng.integers(0, 300, N)] + 0.35 * unit_vectors(rng, N, D)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    q = x[rng.choice(N, 200, replace=False)].astype(np.float32) + 0.2 * unit_vectors(rng, 200, D)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    vectors = ShardVectors.of([x[:9000], x[9000:9000], x[9000:]])
    evaluation = EvalSet.of(x[:2000].astype(np.float32), q, rng.integers(0, 2000, 200), [f"t{i}" for i in range(200)],
                            "validation", "synthetic")
    truth = np.argsort(-(q @ x.astype(np.float32).T), axis=1, kind="stable")[:, :10]  # (Q, 10) brute force, every row
    return vectors, evaluation, truth


@pytest.fixture
def small_sample(monkeypatch):
    """Inverted lists offered from N = 1,000, the choice fitted on a 2,000-row sample (its nlist capped at 51)."""
    monkeypatch.setattr(ivf, "IVF_MIN_N", 1000)
    monkeypatch.setattr(bud, "FIT_ROWS", 2000)




def _spec(inner: str) -> bud.codecs.CodecSpec:
    """8 bytes of ``inner`` in lists (RQ: 4, its encoding's beam search is the slow part), as the candidates name
    them at N (nlist = lists_for(N))."""
    params = {} if inner == "int8" else {"M": 4 if inner == "rq" else 8, "nbits": 8}
    return bud.codecs.CodecSpec("ivf", 8 if inner == "int8" else D, params.get("M", 8),
                                {"inner": inner, **params, "nlist": ivf.lists_for(N), "nprobe": 8})


@pytest.mark.parametrize("inner", ["pq", "opq", "rq", "int8"])
def test_the_stored_lists_are_refitted_for_n_and_nprobe_holds_the_target_at_n(collection, small_sample, inner):
    """The stored code has lists_for(N) lists, trained on coarse_rows rows; its nprobe is the smallest power of two
    whose top 10 holds the target share of what every list holds of the exact top 10 over the whole collection
    (brute force here), the power of two below it does not; the manifest records both."""
    vectors, evaluation, truth = collection
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    spec = _spec(inner)
    sample = vectors.rows(np.sort(np.random.default_rng(0).choice(N, 2000, replace=False)), D)
    fitted = bud.codecs.fit(spec, bud.fit_sample(sample, spec))
    assert fitted.ivf.nlist == 2000 // ivf.TRAIN_PER_LIST < ivf.lists_for(N) == 512  # capped by the sample
    sized, done = scale.sized_for_n(fitted, vectors)
    assert sized.ivf.nlist == 512 and done["nlist"] == 512 and done["coarse_rows"] == ivf.coarse_rows(N, 512) == N
    assert done["inner_rows"] == min(N, ivf.IVFCodec.fit_rows_at_n_of(spec) or N)
    stored = scale.fill(sized, vectors)
    choice = bud.Choice(8, fitted, 0.5, [], bud.Variant(fitted, 0.5, bud.Latency(1.0, "given")), bound_ms=10.0)
    at_n = scale.tune_at_n(stored, vectors, evaluation, choice, rules)
    q = evaluation.queries
    held = lambda p: overlap(stored.search(q, 10, params={"nprobe": p})[1], truth)  # noqa: E731
    whole = held(512)
    assert at_n["whole_lists"] == pytest.approx(whole, abs=1e-4) and at_n["how"] == "tuned at N"
    p = at_n["nprobe"]
    assert stored.spec.params["nprobe"] == stored.ivf.nprobe == p and at_n["reached"]
    assert held(p) >= 0.95 * whole - 1e-9
    assert p == 1 or held(p // 2) < 0.95 * whole
    assert [c["nprobe"] for c in at_n["curve"]] == [2 ** i for i in range(p.bit_length())]
    entry = report.manifest_entry(choice, stored, evaluation, "codes.8.faiss", {**done, "fitted_on_sample": "x"}, at_n)
    assert entry["spec"]["params"]["nlist"] == 512 and entry["spec"]["params"]["nprobe"] == p
    assert entry["sized_for_n"]["nlist"] == 512 and entry["at_n"]["nprobe"] == p
    assert report.held_at_n(entry) == {"n": N, "queries": 200, "of_exact_top10": round(held(p), 4)}
    assert entry["latency"]["how"] == "measured" and entry["latency_on_sample"]["how"] == "given"
    printed = report.table({"8": {**entry, "code": entry["spec"]}})
    assert f"512 lists trained on {N:,} rows" in printed and f"nprobe {p} tuned at N" in printed


def test_the_approximate_lists_at_n_are_exact_search_over_their_codes_scanning_every_list(collection, small_sample):
    """At nprobe = nlist the refitted, filled lists answer as exact search over their decoded vectors does; and
    their top 10 at the tuned nprobe finds most of exact float search's top 10 (clustered data, 8 B of PQ)."""
    vectors, evaluation, truth = collection
    spec = _spec("pq")
    sized, _ = scale.sized_for_n(bud.codecs.fit(spec, vectors.rows(np.arange(2000), D)), vectors)
    stored = scale.fill(sized, vectors)
    q = evaluation.queries
    decoded = np.argsort(-(q @ stored.reconstruct().T), axis=1, kind="stable")[:, :10]
    assert overlap(stored.search(q, 10, params={"nprobe": 512})[1], decoded) >= 0.99
    choice = bud.Choice(8, sized, 0.5, [], None, bound_ms=10.0)
    at_n = scale.tune_at_n(stored, vectors, evaluation, choice, Rules(n=N, model=GivenLatency()))
    assert overlap(stored.search(q, 10)[1], truth) >= 0.95 * overlap(stored.search(q, 10, params={"nprobe": 512})[1],
                                                                       truth) - 1e-9
    assert at_n["whole_lists"] > 0.5


def test_opq_in_lists_at_n_is_refitted_on_its_own_rows_and_is_exact_over_its_codes(collection, small_sample,
                                                                                   monkeypatch, tmp_path):
    """OPQ in lists refitted for N takes ``fit_rows_at_n`` rows (not the 5,000 of a budget's fit); the filled
    lists scanned whole answer as exact search over their decoded vectors, and read back from a file the same."""
    monkeypatch.setattr(bud.codecs.lookup("opq"), "fit_rows_at_n", 7000)
    vectors, evaluation, truth = collection
    spec = _spec("opq")
    assert ivf.IVFCodec.fit_rows_at_n_of(spec) == 7000 > bud.codecs.lookup("opq").fit_rows
    sized, done = scale.sized_for_n(bud.codecs.fit(spec, vectors.rows(np.arange(2000), D)), vectors)
    assert done["inner_rows"] == 7000 and sized.ivf.nlist == 512
    stored = scale.fill(sized, vectors)
    q = evaluation.queries
    decoded = np.argsort(-(q @ stored.reconstruct().T), axis=1, kind="stable")[:, :10]
    found = stored.search(q, 10, params={"nprobe": 512})[1]
    assert overlap(found, decoded) >= 0.99 and overlap(found, truth) > 0.5
    stored.save(tmp_path / "opq.faiss")
    back = bud.codecs.load(tmp_path / "opq.faiss")
    assert back.spec == stored.spec and np.array_equal(back.search(q, 10, params={"nprobe": 512})[1], found)


def test_a_shortlist_is_checked_at_n_and_the_latency_bound_caps_nprobe(collection, small_sample):
    """With a re-rank, nprobe is tuned on what the shortlist holds of the exact top 10 itself; a latency bound
    that only nprobe <= 4 meets keeps 4 and says the target was not reached when 4 does not reach it."""
    vectors, evaluation, truth = collection
    spec = _spec("pq")
    fitted = bud.codecs.fit(spec, vectors.rows(np.arange(2000), D))
    stored = scale.fill(scale.sized_for_n(fitted, vectors)[0], vectors)
    model = GivenLatency()
    model.search = lambda codec, queries, k, n, params=None: bud.Latency(float(params["nprobe"]), "given")
    kept = bud.Variant(fitted, 0.5, bud.Latency(1.0, "given"), shortlist=200)
    at_n = scale.tune_at_n(stored, vectors, evaluation, bud.Choice(8, fitted, 0.5, [], kept, bound_ms=100.0),
                         Rules(n=N, recall_target=0.9, model=model))
    q = evaluation.queries
    p = at_n["nprobe"]
    assert at_n["shortlist"] == 200 and at_n["reached"]
    assert overlap(stored.search(q, 200, params={"nprobe": p})[1], truth) >= 0.9
    assert p == 1 or overlap(stored.search(q, 200, params={"nprobe": p // 2})[1], truth) < 0.9
    capped = scale.tune_at_n(stored, vectors, evaluation, bud.Choice(8, fitted, 0.5, [], kept, bound_ms=4.0),
                           Rules(n=N, recall_target=1.0, model=model))
    assert not capped["reached"] and "fewest lists holding the most" in capped["note"]
    assert capped["curve"][-1]["nprobe"] == 8 and capped["curve"][-1]["ms"] > 4.0
    within = {c["nprobe"]: c["of_exact_top10"] for c in capped["curve"] if c["ms"] <= 4.0}  # nprobe 1, 2, 4
    assert capped["nprobe"] == stored.ivf.nprobe == min(p for p, held in within.items() if held == max(within.values()))
    wide = scale.tune_at_n(stored, vectors, evaluation, bud.Choice(8, fitted, 0.5, [], kept, bound_ms=1e9),
                         Rules(n=N, recall_target=1.01, model=model))  # unreachable: every nprobe is timed
    held = {c["nprobe"]: c["of_exact_top10"] for c in wide["curve"]}
    assert max(held) == stored.ivf.nlist and wide["nprobe"] < max(held)  # a plateau before every list ...
    assert held[wide["nprobe"]] == max(held.values()) > held[wide["nprobe"] // 2]  # ... starts at the one kept


def test_a_shortlist_read_from_disk_is_timed_end_to_end_cold_and_stepped_down_under_the_bound(collection,
                                                                                            small_sample):
    """Where the re-rank reads its rows from disk, the kept nprobe's two stages are timed together, cold, and over
    COLD_HEADROOM under the bound nprobe steps down the curve to the most lists whose scan saves what the cold timing
    is over (here the curve predicts it exactly: one step); where none would, it stays, with a note. The manifest's
    latency is the slower of the two."""
    vectors, evaluation, _ = collection
    fitted = bud.codecs.fit(_spec("pq"), vectors.rows(np.arange(2000), D))
    stored = scale.fill(scale.sized_for_n(fitted, vectors)[0], vectors)
    kept = bud.Variant(fitted, 0.5, bud.Latency(1.0, "given"), shortlist=200, reads="disk")
    for bound, extra, over in ((100.0, 0.5, False), (10.0, 1.5, False), (10.0, 30.0, True)):
        edge = bound * (1 - scale.COLD_HEADROOM)
        model, timed = GivenLatency(per_read=0.01), []
        model.search = lambda codec, queries, k, n, params=None: bud.Latency(float(params["nprobe"]), "given")
        model.cold_search = lambda codes, file, queries, length, k=10, sq8=None: timed.append(codes.ivf.nprobe) or (
            codes.ivf.nprobe + 2.0 + extra)  # the parts summed (nprobe + 2 ms of reads) and extra ms
        choice = bud.Choice(8, fitted, 0.5, [], kept, bound_ms=bound)
        at_n = scale.tune_at_n(stored, vectors, evaluation, choice,
                             Rules(n=N, recall_target=1.01, model=model, reads_from="v.npy"))  # to the bound
        assert stored.ivf.nprobe == at_n["nprobe"] == timed[-1]
        summed = {c["nprobe"]: c["ms"] for c in at_n["curve"]}
        first = timed[0]  # the nprobe the curve kept, timed first
        fits = [p for p in summed if p < first and max(p + 2.0 + extra, summed[p]) <= edge]
        stepped = first + 2.0 + extra > edge and bool(fits)
        assert timed == ([first, max(fits)] if stepped else [first])  # one step, to the most lists that fit
        assert (max(at_n["cold_ms"], summed[at_n["nprobe"]]) <= edge) != over
        assert at_n["cold_ms"] == pytest.approx(at_n["nprobe"] + 2.0 + extra)
        entry = report.manifest_entry(choice, stored, evaluation, "image.b8.codec", at_n=at_n)
        assert entry["latency"] == {"ms": max(at_n["cold_ms"], summed[at_n["nprobe"]]), "how": "measured cold"}
        assert ("over the bound: scanning fewer lists would not save that" in at_n["note"]) == over
        assert over or at_n["nprobe"] < first or "over" not in at_n["note"]
        assert ("stepped down" in at_n["note"]) == stepped == (bound == 10.0 and not over)
    in_memory, before = scale.tune_at_n(stored, vectors, evaluation, choice, Rules(n=N, model=model)), len(timed)
    assert "cold_ms" not in in_memory and len(timed) == before  # vectors in memory: the sum is the cost


def _served(scores: np.ndarray, shortlist: np.ndarray, truth: np.ndarray) -> float:
    """What a re-rank of each query's ``shortlist`` (Q, L) by ``scores`` (Q, N) keeps of ``truth``, brute force:
    the scores outside the shortlist masked."""
    masked = np.full_like(scores, -np.inf)
    np.put_along_axis(masked, shortlist, np.take_along_axis(scores, shortlist, axis=1), axis=1)
    return round(overlap(np.argsort(-masked, axis=1, kind="stable")[:, :10], truth), 4)


def test_a_re_rank_by_sq8_rows_at_n_is_measured_as_the_rows_are_kept_and_reported_as_what_it_holds(collection,
                                                                                                  small_sample):
    """Coarser rows reorder near-ties that the shortlist holds: at N the re-rank is measured by the rows as kept
    (``reranked``), checked here against the shortlist's ids scored over every row sq8-coded at once; that is what
    ``held_at_n`` (the app's and the JSON route's figure) reports. A float32 re-rank keeps what its shortlist holds."""
    vectors, evaluation, truth = collection
    fitted = bud.codecs.fit(_spec("pq"), vectors.rows(np.arange(2000), D))
    stored = scale.fill(scale.sized_for_n(fitted, vectors)[0], vectors)
    model = GivenLatency()
    model.search = lambda codec, queries, k, n, params=None: bud.Latency(float(params["nprobe"]), "given")
    choice = bud.Choice(8, fitted, 0.5, [], bud.Variant(fitted, 0.5, bud.Latency(1.0, "given"), shortlist=200),
                        bound_ms=100.0)
    full = vectors.rows(np.arange(N), D)  # (N, D) float32
    ranges = SQ8Rows.fit(full[:2000])
    at_n = scale.tune_at_n(stored, vectors, evaluation, choice, Rules(n=N, model=model, vector_bytes=1, sq8=ranges))
    q = evaluation.queries
    store = SQ8Rows(np.empty((0, D), np.uint8), ranges)
    scores = q @ store.decode(store.encode(full)).T  # (Q, N) every row as sq8 keeps it
    want = _served(scores, stored.search(q, 200, params={"nprobe": at_n["nprobe"]})[1], truth)  # a top 200 re-ranked
    held = next(c["of_exact_top10"] for c in at_n["curve"] if c["nprobe"] == at_n["nprobe"])
    assert at_n["reranked"] == pytest.approx(want, abs=1e-4) and want < held  # sq8 loses near-ties it was offered
    assert report.held_at_n({"at_n": at_n})["of_exact_top10"] == at_n["reranked"]
    floats = scale.tune_at_n(stored, vectors, evaluation, choice, Rules(n=N, model=model))
    assert "reranked" not in floats and report.held_at_n({"at_n": floats})["of_exact_top10"] == held


def test_a_cold_timing_over_the_edge_that_fewer_lists_would_not_save_keeps_the_lists(collection, small_sample):
    """At 10M, 8 B the parts summed 8.31 ms at 1 list and 8.55 at 16 (the re-rank's cold reads are the cost), and one
    build's cold timings over 9 ms stepped 16 lists down to 4: .720 of the exact top 10 where 16 held .808. Here the
    same curve: the cold timing is 0.7 ms over the parts, more than any step saves, so the lists stay."""
    vectors, evaluation, _ = collection
    fitted = bud.codecs.fit(_spec("pq"), vectors.rows(np.arange(2000), D))
    stored = scale.fill(scale.sized_for_n(fitted, vectors)[0], vectors)
    kept = bud.Variant(fitted, 0.5, bud.Latency(1.0, "given"), shortlist=200, reads="disk")
    model, timed = GivenLatency(), []
    parts = lambda nprobe: 8.3 + 0.015 * nprobe  # noqa: E731
    model.search = lambda codec, queries, k, n, params=None: bud.Latency(parts(params["nprobe"]), "given")
    model.cold_search = lambda codes, file, queries, length, k=10, sq8=None: timed.append(codes.ivf.nprobe) or (
        parts(codes.ivf.nprobe) + 0.7)
    at_n = scale.tune_at_n(stored, vectors, evaluation, bud.Choice(8, fitted, 0.5, [], kept, bound_ms=10.0),
                         Rules(n=N, recall_target=1.01, model=model, reads_from="v.npy"))
    held = {c["nprobe"]: c["of_exact_top10"] for c in at_n["curve"]}
    assert timed == [at_n["nprobe"]] and held[at_n["nprobe"]] > held[1]  # timed once, the lists kept
    assert at_n["cold_ms"] == pytest.approx(parts(at_n["nprobe"]) + 0.7) and 9.0 < at_n["cold_ms"] <= 10.0
    assert f"over {1 - scale.COLD_HEADROOM:.0%} of the bound: scanning fewer lists would not save that" in at_n["note"]


def test_a_resumed_build_reads_back_the_refit_lists_and_their_tuning(collection, small_sample, tmp_path, monkeypatch):
    """``index build``'s ``_stored`` keeps the lists refitted for N and their nprobe tuned at N in the parts folder:
    killed while tuning (here: an error), the same call on the same folder neither refits nor streams the N rows
    again, and stores what an uninterrupted call stores (same lists, nprobe and manifest entry)."""
    from triclip.index import build
    from triclip.index.config import IndexBuildConfig
    from triclip.index.store import IndexContents

    vectors, evaluation, _ = collection
    spec = _spec("pq")
    fitted = bud.codecs.fit(spec, vectors.rows(np.arange(2000), D))
    choice = bud.Choice(8, fitted, 0.5, [], bud.Variant(fitted, 0.5, bud.Latency(1.0, "given")), bound_ms=10.0)
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    cfg = IndexBuildConfig(out=str(tmp_path / "index"), seed=3)

    def stored(work):
        work.mkdir(exist_ok=True)
        contents = IndexContents({}, [], np.zeros((0, D), np.float32), {})
        return build._stored(choice, vectors, evaluation, rules, cfg, 1 << 30, work, "image.b8.codec", contents)

    clean, clean_entry = stored(tmp_path / "clean")
    tune = scale.tune_at_n

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the kill, once the lists are refitted and filled

    monkeypatch.setattr(scale, "tune_at_n", killed)
    with pytest.raises(KeyboardInterrupt):
        stored(tmp_path / "resumed")
    assert (tmp_path / "resumed" / "image.b8.codec.sized.pkl").exists()
    assert not (tmp_path / "resumed" / "image.b8.codec.at_n.pkl").exists()
    monkeypatch.setattr(scale, "tune_at_n", tune)
    monkeypatch.setattr(ivf.IVFCodec, "sized_for", lambda *a, **k: pytest.fail("refitted again"))
    again, entry = stored(tmp_path / "resumed")  # tunes once (the kill came first), from the kept lists
    monkeypatch.setattr(scale, "exact_at_n", lambda *a, **k: pytest.fail("streamed the N rows again"))
    third, third_entry = stored(tmp_path / "resumed")  # everything read back
    q = evaluation.queries
    for codes, e in [(again, entry), (third, third_entry)]:
        assert codes.ivf.nlist == 512 and codes.ivf.nprobe == clean.ivf.nprobe == clean_entry["at_n"]["nprobe"]
        assert np.array_equal(codes.search(q, 10)[1], clean.search(q, 10)[1])
        assert e["sized_for_n"]["seconds"] == entry["sized_for_n"]["seconds"]  # the first refit's, read back
        timeless = lambda x: {**x, "sized_for_n": {**x["sized_for_n"], "seconds": None}}  # noqa: E731
        assert timeless(e) == timeless(clean_entry)


@pytest.fixture
def large_lists(monkeypatch):
    """The collection's 512 lists count as many: two-level k-means, rows assigned through groups of centroids."""
    monkeypatch.setattr(ivf, "LARGE_LISTS", 256)


def _nearest_lists(stored, vectors) -> np.ndarray:
    """Each row's nearest list by the stored (flat) quantiser, as exact assignment would give. Shape: (N,)."""
    x = np.asarray(vectors.rows(np.arange(vectors.count), D), np.float32)
    for i in range(stored.index.chain.size()):
        x = stored.index.chain.at(i).apply(x)
    return stored.ivf.quantizer.search(np.ascontiguousarray(x), 1)[1][:, 0]


def test_many_lists_are_trained_two_level_and_rows_assigned_through_groups_of_centroids(collection, small_sample,
                                                                                        large_lists, tmp_path):
    """From LARGE_LISTS lists on, the refit trains the centroids by two-level k-means (recorded) and the fill
    assigns rows through an IVF over them: nearly every row in its nearest list, the stored quantiser flat
    again (saved and read back as such), and the lists as good as exact assignment's for the queries."""
    vectors, evaluation, truth = collection
    spec = _spec("pq")
    sized, done = scale.sized_for_n(bud.codecs.fit(spec, vectors.rows(np.arange(2000), D)), vectors)
    assert sized.ivf.nlist == 512 and "two-level k-means" in done["large"]
    stored = scale.fill(sized, vectors)
    where = stored._where()[:, 0]  # (N,) each row's list as stored
    nearest = _nearest_lists(stored, vectors)
    assert 0.97 <= np.mean(where == nearest) < 1.0  # a few rows in a near list: the assigner scans 4 of 22 groups
    quantiser = faiss.downcast_index(stored.ivf.quantizer)
    assert isinstance(quantiser, faiss.IndexFlat) and quantiser.ntotal == 512 and len(stored) == N
    q = evaluation.queries
    decoded = np.argsort(-(q @ stored.reconstruct().T), axis=1, kind="stable")[:, :10]
    found = stored.search(q, 10, params={"nprobe": 512})[1]
    assert overlap(found, decoded) >= 0.99
    at_16 = overlap(stored.search(q, 10, params={"nprobe": 16})[1], truth)
    ranks, lists = stored.list_ranks(q)
    held = np.mean([np.mean(ranks[i, nearest[truth[i]]] < 16) for i in range(len(q))])  # exact assignment's
    assert at_16 >= 0.9 * overlap(found, truth) and np.mean(ranks[np.arange(len(q))[:, None], lists[truth]] < 16) \
        >= held - 0.02
    stored.save(tmp_path / "large.faiss")
    back = bud.codecs.load(tmp_path / "large.faiss")
    assert np.array_equal(back.search(q, 10, params={"nprobe": 16})[1], stored.search(q, 10, params={"nprobe": 16})[1])


@pytest.mark.parametrize("inner", ivf.INNER)
def test_rows_added_through_groups_scanning_all_are_the_plain_faiss_add(collection, small_sample, monkeypatch, inner):
    """With every group scanned the assigner is exact, and a fill through it stores what FAISS's own add of the
    same trained code stores, for every inner code: the same answers, the same scores."""
    vectors, evaluation, _ = collection
    spec = _spec(inner) if inner != "pqfs" else bud.codecs.CodecSpec(
        "ivf", D, 8, {"inner": "pqfs", "M": 16, "nbits": 4, "nlist": ivf.lists_for(N), "nprobe": 8})
    sized, _ = scale.sized_for_n(bud.codecs.fit(spec, vectors.rows(np.arange(2000), D)), vectors)
    plain = scale.fill(sized, vectors)
    monkeypatch.setattr(ivf, "LARGE_LISTS", 256)
    monkeypatch.setattr(ivf, "ASSIGN_PROBE", 10_000)
    through = scale.fill(sized, vectors)
    q = evaluation.queries
    (d1, i1), (d2, i2) = plain.search(q, 10, params={"nprobe": 32}), through.search(q, 10, params={"nprobe": 32})
    assert np.array_equal(i1, i2) and np.allclose(d1, d2, atol=1e-6)
    assert np.array_equal(plain._where(), through._where())


def test_many_lists_filled_on_disk_are_the_lists_filled_in_memory(collection, small_sample, large_lists, tmp_path):
    """The on-disk fill (one shard at a time, merged into a mapped lists file) assigns rows through the same
    groups of centroids as the in-memory fill: every row in the same list, the same answers."""
    vectors, evaluation, _ = collection
    sized, _ = scale.sized_for_n(bud.codecs.fit(_spec("opq"), vectors.rows(np.arange(2000), D)), vectors)
    memory = scale.fill(sized, vectors)
    disk = sized.filled_on_disk(vectors, tmp_path / "codes.ivfdata")
    assert disk.on_disk() and np.array_equal(disk._where(), memory._where())
    q = evaluation.queries
    assert np.array_equal(disk.search(q, 10, params={"nprobe": 16})[1], memory.search(q, 10, params={"nprobe": 16})[1])
