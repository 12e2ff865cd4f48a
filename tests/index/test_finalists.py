"""A budget's finalists settled at N (``triclip.index.finalists``): the kept code, its rival and the best first
stage filled with every row, searched alone and with the shortlists of the ladder, scored against exact search
over all of them, the best within the bound kept and every one recorded.

Latencies come from an injected model (``GivenLatency``): nothing is timed here."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from triclip.codecs import ivf
from triclip.index import budgets as bud
from triclip.index import report
from triclip.index import scale
from triclip.index.budgets import Choice, Latency, Rules, Variant, choose, overlap
from triclip.index.finalists import LADDER, settle
from triclip.index.vectors import SQ8Rows
from tests.index.conftest import GivenLatency
from tests.index.test_ivf_at_n import D, N, _served, _spec, collection, small_sample  # noqa: F401 (the same fixtures)


def _variant(spec, vectors, fidelity: float) -> Variant:
    sample = vectors.rows(np.arange(2000), D)
    return Variant(bud.codecs.fit(spec, sample), 0.5, Latency(1.0, "given"), fidelity=fidelity, by_fidelity=True)


@pytest.fixture
def two(collection, small_sample):  # noqa: F811
    """A flat code of 2 B (PQ2x8) and inverted lists of 8 B of PQ, both fitted on 2,000 rows."""
    vectors = collection[0]
    return _variant(bud.codecs.CodecSpec("pq", D, 2, {"M": 2, "nbits": 8}), vectors, 0.60), \
        _variant(_spec("pq"), vectors, 0.58)


def test_the_rival_that_holds_more_at_n_is_kept_and_every_finalist_is_recorded(collection, two):  # noqa: F811
    vectors, evaluation, truth = collection
    flat, lists = two
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    tied = Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0, rival=lists)
    [settled] = settle([tied], vectors, evaluation, rules)
    stored = scale.fill(flat.codec, vectors)
    flat_held = overlap(stored.search(evaluation.queries, 10)[1], truth)  # brute force over every row
    assert settled.kept.codec is lists.codec and settled.codec is lists.codec and "finalists measured" in settled.note
    assert settled.kept.latency.how == "measured" and settled.kept.shortlist is None
    got = settled.finalists
    nprobe = got["kept"]["nprobe"]  # the lists as stored: refitted for N, their nprobe tuned there
    assert got["n"] == N and got["kept"]["label"] == f"ivf{ivf.lists_for(N)}/{nprobe},pq8x8 m={D}" and nprobe >= 1
    assert settled.kept.fidelity == got["kept"]["of_exact_top10"]
    assert all(f["fill_s"] >= 0 for f in (got["kept"], *got["others"])) and "not_filled" not in got  # untimed: filled
    assert [{k: v for k, v in f.items() if k != "fill_s"} for f in got["others"]] == [
        {"label": flat.codec.spec.label(), "shortlist": None, "of_exact_top10": round(flat_held, 4), "ms": 0.002,
         "nprobe": None}]  # GivenLatency: 0.001 ms a byte
    assert got["kept"]["of_exact_top10"] > got["others"][0]["of_exact_top10"]
    [again] = settle([Choice(8, lists.codec, lists.recall, [], lists, bound_ms=10.0, rival=flat)], vectors,
                     evaluation, rules)
    untimed = lambda record: {k: v for k, v in record.items() if k != "fill_s"}  # noqa: E731 (a wall time)
    assert again.kept.codec is lists.codec and again.note == "" and untimed(again.finalists["kept"]) == untimed(got["kept"])
    entry = report.manifest_entry(settled, stored, evaluation, "image.b8.codec")
    assert entry["finalists_at_n"] == got
    assert "finalists measured as stored at N = 25,000" in report.table({"8": {**entry, "code": entry["spec"]}})
    for done in (settled, again):  # the winner as refitted for N, kept for the build to store
        assert done.sized_at_n[0].ivf.nlist == done.sized_at_n[1]["nlist"] == ivf.lists_for(N)


def test_the_longest_shortlist_within_the_bound_at_n_is_kept_with_its_cold_reads(collection, two):  # noqa: F811
    """A first stage whose re-rank the sample put over the bound: at N each shortlist of the ladder is timed (the
    re-rank 0.01 ms a row, 0.001 more read cold) and of those within 10 ms, the one holding the most (then the
    faster: the shortest) is kept, reading from disk, as the stored code would be searched."""
    vectors, evaluation, truth = collection
    flat, _ = two
    model = GivenLatency(reference=10.0, per_candidate=0.01, per_read=0.001)
    rules = Rules(n=N, recall_target=0.95, rescore=True, model=model, reads_from="vectors.npy")
    over = replace(flat, shortlist=2000, latency=Latency(30.0, "extrapolated"))  # the sample's guess: over 10 ms
    choice = Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0, first_stage=over)
    [settled] = settle([choice], vectors, evaluation, rules)
    within = [n for n in LADDER if 0.002 + 0.011 * n <= 10.0]
    stored = scale.fill(flat.codec, vectors)
    held = {n: round(overlap(stored.search(evaluation.queries, n)[1], truth), 4) for n in within}  # brute force
    fits = min(n for n in within if held[n] == max(held.values()))
    assert within[-1] == 500 and held[fits] > held[100] and settled.kept.shortlist == fits
    assert settled.kept.reads == "disk" and settled.kept.shortlist_how == "measured at N"
    assert settled.kept.latency.ms == pytest.approx(0.002 + 0.011 * fits)
    assert settled.finalists["kept"]["of_exact_top10"] == held[fits]
    assert ("vectors.npy", 500) in model.reads and ("vectors.npy", 1000) in model.reads  # timed, then over


def test_by_sq8_rows_each_finalist_is_scored_by_what_its_re_rank_serves_not_what_its_shortlist_holds(
        collection, two):  # noqa: F811
    """The rows kept as sq8 codes reorder near-ties a shortlist holds: each finalist's record at N (a flat code's
    shortlists, and lists with theirs) is what a re-rank of the sq8 rows keeps of the exact top 10, and the kept
    shortlist is the one that serves the most (then the faster, the shortest)."""
    vectors, evaluation, truth = collection
    flat, lists = two
    full = vectors.rows(np.arange(N), D)  # (N, D) float32
    ranges = SQ8Rows.fit(full[:2000])
    model = GivenLatency(reference=10.0, per_candidate=0.01)
    rules = Rules(n=N, recall_target=0.95, rescore=True, model=model, vector_bytes=1, sq8=ranges)
    over = replace(flat, shortlist=2000, latency=Latency(30.0, "extrapolated"))
    [settled] = settle([Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0, first_stage=over)], vectors,
                       evaluation, rules)
    q = evaluation.queries
    store = SQ8Rows(np.empty((0, D), np.uint8), ranges)
    scores = q @ store.decode(store.encode(full)).T  # (Q, N) every row as sq8 keeps it
    stored = scale.fill(flat.codec, vectors)
    within = [n for n in LADDER if 0.002 + 0.01 * n <= 10.0]
    served = {n: _served(scores, stored.search(q, n)[1], truth) for n in within}
    held = {n: round(overlap(stored.search(q, n)[1], truth), 4) for n in within}
    best = min(n for n in within if served[n] == max(served.values()))
    assert settled.kept.shortlist == best and settled.finalists["kept"]["of_exact_top10"] == served[best]
    assert settled.kept.fidelity == pytest.approx(served[best]) and all(served[n] < held[n] for n in within)
    sized = scale.fill(scale.sized_for_n(lists.codec, vectors)[0], vectors)
    [lists_too] = settle([Choice(8, lists.codec, lists.recall, [], replace(lists, shortlist=200), bound_ms=10.0,
                                 rival=flat)], vectors, evaluation, rules)
    [record] = [r for r in (lists_too.finalists["kept"], *lists_too.finalists["others"]) if r["label"].startswith("ivf")]
    assert record["shortlist"] in LADDER  # the lists with a re-rank: their served share at the nprobe tuned for it
    shortlist = sized.search(q, record["shortlist"], params={"nprobe": record["nprobe"]})[1]
    assert record["of_exact_top10"] == _served(scores, shortlist, truth)


@pytest.mark.parametrize("extra, kept", [(5.0, 200), (6.0, 100)])
def test_a_shortlist_whose_end_to_end_cold_search_is_over_the_bound_is_dropped(collection, two, extra,  # noqa: F811
                                                                               kept):
    """The same first stage, where a search timed end to end cold costs 5 ms more than its parts summed: 500 rows
    sum to 5.5 ms but take 10.5 cold, over the 10 ms bound; 400 and 300 take 9.4 and 8.3 ms, within it but not
    COLD_HEADROOM (20%) under it, so 200 are kept (7.2 ms cold). At 6 ms more, 200 rows take 8.2 ms: 100 are kept."""
    vectors, evaluation, _ = collection
    flat, _ = two
    model = GivenLatency(reference=10.0, per_candidate=0.01, per_read=0.001, cold_extra=extra)
    rules = Rules(n=N, recall_target=0.95, rescore=True, model=model, reads_from="vectors.npy")
    over = replace(flat, shortlist=2000, latency=Latency(30.0, "extrapolated"))
    [settled] = settle([Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0, first_stage=over)], vectors,
                       evaluation, rules)
    assert settled.kept.shortlist == kept and settled.kept.latency.ms == pytest.approx(0.002 + 0.011 * kept + extra)
    assert settled.kept.latency.how == "measured cold" and settled.kept.latency.ms <= 10.0 * (1 - scale.COLD_HEADROOM)
    over = next(n for n in LADDER if 0.002 + 0.011 * n + extra > 10.0)  # 500 at 5 ms more, 400 at 6
    assert [length for _, _, length in model.cold] == [n for n in LADDER if n <= over]  # none timed past it


def test_without_other_finalists_or_below_scale_nothing_is_measured(collection, two, monkeypatch):  # noqa: F811
    vectors, evaluation, _ = collection
    flat, lists = two
    monkeypatch.setattr("triclip.index.finalists._as_stored", lambda *a, **k: pytest.fail("measured"))
    alone = Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0)
    assert settle([alone], vectors, evaluation, Rules(n=N)) == [alone]
    monkeypatch.setattr(ivf, "IVF_MIN_N", N + 1)
    tied = Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0, rival=lists)
    assert settle([tied], vectors, evaluation, Rules(n=N)) == [tied]


def test_the_build_stores_the_winner_from_the_refit_its_settling_made(collection, two, monkeypatch, tmp_path):  # noqa: F811
    from triclip.index import build
    from triclip.index.sources import IndexBuildConfig
    from triclip.index.store import IndexContents

    vectors, evaluation, _ = collection
    flat, lists = two
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    [settled] = settle([Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0, rival=lists)], vectors,
                       evaluation, rules)
    fresh = scale.fill(settled.sized_at_n[0], vectors)  # what encoding the N rows again would store
    monkeypatch.setattr(scale, "sized_for_n", lambda *a, **k: pytest.fail("refitted again"))
    monkeypatch.setattr(scale, "fill", lambda *a, **k: pytest.fail("the N rows encoded again"))
    monkeypatch.setattr(scale, "tune_at_n", lambda *a, **k: pytest.fail("tuned at N again"))
    stored, entry = build._stored(settled, vectors, evaluation, rules, IndexBuildConfig(out=str(tmp_path / "x")),
                                  1 << 30, tmp_path, "image.b8.codec", IndexContents({}, [], None, {}))
    assert stored is settled.filled_at_n and len(stored) == N and stored.ivf.nlist == ivf.lists_for(N)
    every = {"nprobe": stored.ivf.nlist}
    assert np.array_equal(stored.search(evaluation.queries, 10, params=every)[1],
                          fresh.search(evaluation.queries, 10, params=every)[1])
    assert entry["sized_for_n"] == settled.sized_at_n[1] and entry["finalists_at_n"] == settled.finalists
    assert entry["at_n"]["nprobe"] == settled.finalists["kept"]["nprobe"]
    assert entry["at_n"] == settled.tuned_at_n and settled.tuned_at_n["curve"]  # the finalists' own tuning
    from triclip.index.manifest import summary

    printed = summary({"budgets": {"8": entry}}, str(tmp_path), 0.0)["budgets"]["8"]  # what index build prints
    assert printed["finalists_at_n"] == settled.finalists and "finalists measured" in report.table({"8": printed})


def test_the_choice_names_as_rival_the_best_other_code_within_the_margin(collection, small_sample):  # noqa: F811
    """At scale every near-tie within FINALIST_MARGIN of the kept score, within the bound, of another code."""
    vectors, evaluation, _ = collection
    sample = vectors.rows(np.arange(2000), D)
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    choice = choose(8, sample, evaluation, rules=rules)
    kept = min(choice.kept.score, 0.95)
    measured = [t for t in choice.tried if t["recall"] is not None and t["label"] != choice.kept.codec.spec.label()]
    close = [t for t in measured if min(t["fidelity"], 0.95) >= kept - bud.FINALIST_MARGIN and t["latency_ms"] <= 10.0]
    assert close and choice.rival is not None  # here: rq8x8 kept, lists of RQ within the margin
    best = max(close, key=lambda t: (min(t["fidelity"], 0.95), -t["bytes"], -t["latency_ms"]))
    assert choice.rival.codec is not choice.kept.codec and choice.rival.codec.spec.label() == best["label"]
    assert choice.first_stage is None  # no re-rank offered (--no-rescore)


def test_the_choice_names_as_first_stage_the_best_shortlist_of_a_code_fast_enough_alone(collection, small_sample):  # noqa: F811
    """With a re-rank at scale: among codes whose codes alone take at most half the bound, each one's shortest
    staged variant on the sample (within the bound or not), the one holding the most."""
    vectors, evaluation, _ = collection
    sample = vectors.rows(np.arange(2000), D)
    model = GivenLatency(reference=10.0, codes={"rq": 6.0}, per_candidate=0.02)  # rq alone: over half the bound
    choice = choose(8, sample, evaluation, rules=Rules(n=N, recall_target=0.95, rescore=True, model=model))
    alone = {t["label"]: t["latency_ms"] for t in choice.tried if t["recall"] is not None and not t.get("shortlist")}
    staged = [t for t in choice.tried if t["recall"] is not None and t.get("shortlist") and alone[t["label"]] <= 5.0
              and t["label"] != choice.kept.codec.spec.label()]  # the kept code is a finalist already
    assert staged and any(t["latency_ms"] > 10.0 for t in staged)  # some re-ranks the sample puts over the bound
    assert choice.first_stage.shortlist is not None and choice.first_stage.codec.spec.codec != "rq"
    shortest = {}
    for t in staged:
        shortest[t["label"]] = min(shortest.get(t["label"], t), t, key=lambda t: t["shortlist"])
    best = max(shortest.values(), key=lambda t: (t["fidelity"], -t["shortlist"]))
    assert (choice.first_stage.codec.spec.label(), choice.first_stage.shortlist) == (best["label"], best["shortlist"])
    assert round(choice.first_stage.fidelity, 4) == best["fidelity"]


def test_the_first_stage_is_ranked_by_each_codes_shortest_shortlist_not_its_longest():
    """At 1M and 32 B (docs/results_scale.md): flat 4-bit PQ's top 25,000 held the most of the sample's exact top
    10, lists of OPQ's top 1,000 more than its top 1,000; the shortlists that fit at N are the short ones. A code
    whose codes alone take over half the bound is no first stage, however much its shortlists hold."""
    flat, lists, slow = object(), object(), object()

    def variant(codec, shortlist, held, ms=1.0):
        return Variant(codec, 0.5, Latency(ms, "given"), shortlist=shortlist, fidelity=held, by_fidelity=True)
    found = [variant(flat, None, .389), variant(flat, 1000, .560), variant(flat, 25000, .987),
             variant(lists, None, .712), variant(lists, 1000, .866), variant(lists, 25000, .901),
             variant(slow, None, .800, ms=6.8), variant(slow, 1000, .970)]
    picked = bud._first_stage(found, bound=10.0)
    assert picked.codec is lists and picked.shortlist == 1000
    # the kept code is a finalist already (its shortlists measured at N): the first stage is another code's
    assert bud._first_stage(found, bound=10.0, kept=found[3]).codec is flat
    assert bud._first_stage([v for v in found if v.codec is slow], bound=10.0) is None


def test_lists_search_every_list_once_per_code_and_the_ladder_stops_past_the_bound(collection, two, monkeypatch):  # noqa: F811
    """Tuned again for each shortlist, a code's lists are scanned whole only the first time (what every list holds
    does not depend on the shortlist); shortlists whose re-rank alone is over the bound are not tuned."""
    vectors, evaluation, _ = collection
    flat, lists = two
    calls, tune = [], scale.tune_at_n

    def counted(stored, vectors, evaluation, choice, rules, whole=None):
        at_n = tune(stored, vectors, evaluation, choice, rules, whole)
        if at_n is not None:  # the lists (the flat code has none)
            calls.append((choice.kept.shortlist, whole, at_n["whole_lists"]))
        return at_n

    monkeypatch.setattr(scale, "tune_at_n", counted)
    rules = Rules(n=N, recall_target=0.95, rescore=True, model=GivenLatency(reference=10.0, per_candidate=0.02))
    settle([Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0, rival=lists)], vectors, evaluation, rules)
    assert [c[0] for c in calls] == [None, 100, 200, 300, 400, 500]  # 1,000 rows: a re-rank of 20 ms alone, not tuned
    assert calls[0][1] is None and all(c[1] == calls[0][2] for c in calls[1:])


def test_a_finalist_tied_on_the_sample_and_slow_to_encode_is_not_filled():
    """At 10M and 16 B (docs/results_scale.md) lists of RQ and of OPQ tied on the sample and both were filled: RQ
    encodes ~6 x slower and the build took 3,762 s against 1,196. A tied finalist more than FILL_RATIO x slower to
    encode than the cheapest is left out; one ahead by more than the margin, or untimed, is filled."""
    from triclip.index.finalists import FILL_RATIO, worth_filling

    def variant(label, held, encode_us):
        codec = type("C", (), {"spec": type("S", (), {"label": lambda self, label=label: label})()})()
        return Variant(codec, 0.5, Latency(1.0, "given"), fidelity=held, by_fidelity=True, encode_us=encode_us)

    rq, opq = variant("ivf128/8,rq16x8", .62, 210.0), variant("ivf128/16,opq16x8", .60, 35.0)
    filling, unfilled = worth_filling([rq, opq], 10_000_000)
    assert filling == [opq] and [u["label"] for u in unfilled] == ["ivf128/8,rq16x8"]
    assert "~2,100 s to encode, 6.0 x ivf128/16,opq16x8's" in unfilled[0]["not_filled"]
    ahead = variant("ivf128/8,rq16x8", .60 + bud.FINALIST_MARGIN + .01, 210.0)
    assert worth_filling([ahead, opq], 10_000_000) == ([ahead, opq], [])
    near = variant("ivf128/8,rq16x8", .62, 35.0 * FILL_RATIO)  # not more than FILL_RATIO x slower
    assert worth_filling([near, opq], 10_000_000) == ([near, opq], [])
    untimed = variant("ivf128/8,rq16x8", .62, None)
    assert worth_filling([untimed, opq], 10_000_000) == ([untimed, opq], [])


def test_finalists_are_compared_by_their_codes_alone_not_a_shortlist_against_codes():
    """At 10M, 16 B, seed 2: lists of RQ kept alone (.643 of the sample's exact top 10), lists of OPQ a first stage
    whose top 10,000 held .767 (alone .579). By codes alone RQ is .064 ahead, past the margin: it is filled."""
    from triclip.index.finalists import worth_filling

    def variant(label, held, encode_us, shortlist=None):
        codec = type("C", (), {"spec": type("S", (), {"label": lambda self, label=label: label})()})()
        return Variant(codec, 0.5, Latency(1.0, "given"), shortlist=shortlist, fidelity=held, by_fidelity=True,
                       encode_us=encode_us)

    rq, opq = variant("ivf128/16,rq16x8", .643, 145.0), variant("ivf128/8,opq16x8", .767, 11.7, shortlist=10_000)
    alone = {"ivf128/16,rq16x8": .643, "ivf128/8,opq16x8": .579}
    assert worth_filling([rq, opq], 10_000_000, alone) == ([rq, opq], [])
    assert worth_filling([rq, opq], 10_000_000)[0] == [opq]  # shortlist against codes: what the first rule did
    tied = dict(alone, **{"ivf128/16,rq16x8": .60})
    filling, unfilled = worth_filling([rq, opq], 10_000_000, tied)
    assert filling == [opq] and unfilled[0]["not_filled"].endswith("within 0.05 of its (0.579 against 0.600)")


def test_settling_leaves_the_slow_kept_code_unfilled_and_keeps_its_rival(collection, two, monkeypatch):  # noqa: F811
    vectors, evaluation, _ = collection
    flat, lists = two
    slow, fast = replace(flat, encode_us=100.0), replace(lists, encode_us=10.0)
    filled = []
    as_stored = __import__("triclip.index.finalists", fromlist=["_as_stored"])._as_stored

    def recorded(variant, *args):
        filled.append(variant.codec)
        return as_stored(variant, *args)

    monkeypatch.setattr("triclip.index.finalists._as_stored", recorded)
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    [settled] = settle([Choice(8, slow.codec, slow.recall, [], slow, bound_ms=10.0, rival=fast)], vectors,
                       evaluation, rules)
    assert filled == [fast.codec] and settled.kept.codec is fast.codec and "finalists measured" in settled.note
    got = settled.finalists
    assert got["others"] == [] and got["kept"]["fill_s"] >= 0
    assert got["not_filled"] == [{"label": flat.codec.spec.label(), "not_filled": (
        f"its {N:,} rows would take ~2 s to encode, 10.0 x {lists.codec.spec.label()}'s, whose codes alone the"
        f" sample puts within {bud.FINALIST_MARGIN:g} of its (0.580 against 0.600)")}]
    entry = report.manifest_entry(settled, settled.filled_at_n, evaluation, "image.b8.codec")
    printed = report.table({"8": {**entry, "code": entry["spec"]}})
    assert f"{flat.codec.spec.label()} not filled: its {N:,} rows" in printed


def test_the_sample_fill_times_each_codes_encoding(collection, small_sample):  # noqa: F811
    vectors, evaluation, _ = collection
    sample = vectors.rows(np.arange(2000), D)
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    choice = choose(8, sample, evaluation, rules=rules)
    assert choice.kept.encode_us > 0 and (choice.rival is None or choice.rival.encode_us > 0)


def _filled_as(monkeypatch) -> list:
    """Each finalist measured as stored, as (its code, the rows it was filled with), in order."""
    from triclip.index import finalists

    calls, as_stored = [], finalists._as_stored

    def recorded(variant, choice, vectors, *args):
        calls.append((variant.codec, vectors.count))
        return as_stored(variant, choice, vectors, *args)

    monkeypatch.setattr(finalists, "_as_stored", recorded)
    return calls


def test_a_slow_finalist_that_holds_less_on_the_first_rows_is_not_filled_at_n(collection, two, monkeypatch):  # noqa: F811
    """At 10M and 8 B lists of RQ led on the sample and lost at N on 3 seeds, filled for ~800 s each: now tried
    first on the first rows (here 5,000 of 25,000), where the faster-to-encode code holds more, and not filled."""
    from triclip.index import finalists
    from triclip.index.vectors import exact_topk

    monkeypatch.setattr(finalists, "FIRST_ROWS", 5000)
    vectors, evaluation, _ = collection
    flat, lists = two
    slow, fast = replace(flat, encode_us=100.0, fidelity=0.70), replace(lists, encode_us=10.0)  # ahead on the sample
    calls = _filled_as(monkeypatch)
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    [settled] = settle([Choice(8, slow.codec, slow.recall, [], slow, bound_ms=10.0, rival=fast)], vectors,
                       evaluation, rules)
    assert calls == [(fast.codec, 5000), (slow.codec, 5000), (fast.codec, N)]  # the first rows, then N: the fast one only
    head = vectors.head(5000)
    truth = exact_topk(head, evaluation.queries, 10)  # brute force over the first rows
    flat_held = overlap(scale.fill(flat.codec, head).search(evaluation.queries, 10)[1], truth)
    first = settled.finalists["first_rows"]
    assert first["n"] == 5000 and [f["of_exact_top10"] for f in first["finalists"]][1] == round(flat_held, 4)
    lists_held = first["finalists"][0]["of_exact_top10"]
    assert lists_held > flat_held and settled.kept.codec is fast.codec and settled.finalists["others"] == []
    [left] = settled.finalists["not_filled"]
    assert left["label"] == flat.codec.spec.label() and left["not_filled"].startswith(
        f"on the first 5,000 rows, as stored, it held {flat_held:.3f} of their exact top 10 in 0.002 ms against"
        f" {lists_held:.3f}") and left["not_filled"].endswith(f"whose {N:,} rows encode 10.0 x faster")
    entry = report.manifest_entry(settled, settled.filled_at_n, evaluation, "image.b8.codec")
    assert f"{flat.codec.spec.label()} not filled: on the first 5,000 rows" in report.table(
        {"8": {**entry, "code": entry["spec"]}})


def test_a_slow_finalist_that_holds_more_on_the_first_rows_is_filled_at_n(collection, two, monkeypatch):  # noqa: F811
    from triclip.index import finalists

    monkeypatch.setattr(finalists, "FIRST_ROWS", 5000)
    vectors, evaluation, _ = collection
    flat, lists = two
    slow, fast = replace(lists, encode_us=100.0, fidelity=0.70), replace(flat, encode_us=10.0)
    calls = _filled_as(monkeypatch)
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    [settled] = settle([Choice(8, slow.codec, slow.recall, [], slow, bound_ms=10.0, rival=fast)], vectors,
                       evaluation, rules)
    assert calls == [(fast.codec, 5000), (slow.codec, 5000), (slow.codec, N), (fast.codec, N)]
    assert "not_filled" not in settled.finalists and settled.kept.codec is slow.codec
    monkeypatch.setattr(finalists, "FIRST_ROWS", N // finalists.FIRST_FROM + 1)  # N < FIRST_FROM x FIRST_ROWS
    calls.clear()
    [again] = settle([Choice(8, slow.codec, slow.recall, [], slow, bound_ms=10.0, rival=fast)], vectors,
                     evaluation, rules)
    assert calls == [(slow.codec, N), (fast.codec, N)] and "first_rows" not in again.finalists


def test_a_code_kept_by_two_budgets_is_measured_at_n_once_and_both_keep_the_same_fill(collection, two, monkeypatch,
                                                                                    tmp_path):  # noqa: F811
    """A larger budget keeping a smaller one's very code (``budgets.no_worse_than_smaller``) at scale: the code is
    sized, filled and tuned at N once, for the smaller budget (settled alone: it has no other finalist); the
    larger takes that very fill beside its own rival, and the build stores it once, lists on disk included: one
    lists file, which both budgets name. Before, the smaller budget was not settled and each budget refitted and
    filled the code (~50 min a budget at 100M)."""
    from triclip.index import build, finalists
    from triclip.index.sources import IndexBuildConfig
    from triclip.index.store import IndexContents

    vectors, evaluation, _ = collection
    flat, lists = two
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    measured, as_stored = [], finalists._as_stored
    monkeypatch.setattr(finalists, "_as_stored", lambda v, *a, **k: measured.append(v.codec) or as_stored(v, *a, **k))
    small = Choice(4, lists.codec, lists.recall, [], lists, bound_ms=10.0)  # alone
    large = Choice(8, lists.codec, lists.recall, [], lists, bound_ms=10.0, rival=flat, note="kept here too")
    a, b = settle([small, large], vectors, evaluation, rules)
    assert [c is lists.codec for c in measured] == [True, False]  # the lists once, the rival once
    assert a.filled_at_n is not None and len(a.filled_at_n) == N and a.kept.codec is lists.codec
    assert (b.kept, b.filled_at_n, b.sized_at_n, b.tuned_at_n) == (a.kept, a.filled_at_n, a.sized_at_n, a.tuned_at_n)
    assert b.kept is a.kept and b.filled_at_n is a.filled_at_n  # the very same objects
    assert a.finalists["kept"]["fill_s"] >= 0 and b.finalists["kept"]["measured_for"] == 4
    assert {k: v for k, v in b.finalists["kept"].items() if k != "measured_for"} == \
        {k: v for k, v in a.finalists["kept"].items() if k != "fill_s"}
    assert [f["label"] for f in b.finalists["others"]] == [flat.codec.spec.label()] and "fill_s" in b.finalists["others"][0]
    assert "measured for the 4 B budget" in report._finalists_line(b.finalists)

    again = build.kept_in(tmp_path / "choices.pkl", lambda: [a, b], D)  # as a resumed build reads them back
    again = build.kept_in(tmp_path / "choices.pkl", lambda: pytest.fail("made again"), D)
    assert again[1].kept is again[0].kept and again[1].codec is again[0].codec and again[0] is not a

    monkeypatch.setattr(scale, "fill", lambda *a, **k: pytest.fail("the N rows encoded in memory again"))
    written = []
    on_disk = type(a.sized_at_n[0]).filled_on_disk
    monkeypatch.setattr(type(a.sized_at_n[0]), "filled_on_disk",
                        lambda self, v, path: written.append(path.name) or on_disk(self, v, path))
    contents, fills, entries = IndexContents({}, [], None, {}), {}, {}
    cfg = IndexBuildConfig(out=str(tmp_path / "x"), on_disk="always")
    for choice in again:
        contents.codes[choice.budget], entries[str(choice.budget)] = build._stored(
            choice, vectors, evaluation, rules, cfg, 0, tmp_path, f"image.b{choice.budget}.codec", contents, fills)
    assert written == ["image.b4.codec.ivfdata"] and contents.codes[8] is contents.codes[4]
    assert contents.codes[4].on_disk() and list(contents.files) == ["image.b4.codec.ivfdata"]
    build._share_files(entries, contents.codes, "image")
    assert (entries["8"]["file"], entries["8"]["lists"]) == ("image.b4.codec", "image.b4.codec.ivfdata") == \
        (entries["4"]["file"], entries["4"]["lists"])
    assert entries["8"]["at_n"] == entries["4"]["at_n"] and contents.codes[8].ivf.nprobe == entries["4"]["at_n"]["nprobe"]


def test_a_larger_budget_keeping_a_code_that_lost_at_n_for_a_smaller_one_takes_the_winner_unmeasured(
        collection, two, monkeypatch):  # noqa: F811
    """The 4 B budget kept a flat code whose rival, inverted lists, held more at N (the first test here); the 8 B
    budget keeps the 4 B budget's code (no_worse_than_smaller, decided on the sample). At N it keeps what beat that
    code there, the same fill, and nothing is measured again: more bytes never hold less at N than fewer."""
    from triclip.index import finalists

    vectors, evaluation, _ = collection
    flat, lists = two
    rules = Rules(n=N, recall_target=0.95, rescore=False, model=GivenLatency(reference=10.0))
    measured, as_stored = [], finalists._as_stored
    monkeypatch.setattr(finalists, "_as_stored", lambda v, *a, **k: measured.append(v.codec) or as_stored(v, *a, **k))
    small = Choice(4, flat.codec, flat.recall, [], flat, bound_ms=10.0, rival=lists)
    large = Choice(8, flat.codec, flat.recall, [], flat, bound_ms=10.0, note="the 4 B budget's code: kept here too")
    a, b = settle([small, large], vectors, evaluation, rules)
    assert len(measured) == 2 and {id(c) for c in measured} == {id(flat.codec), id(lists.codec)}  # once each
    assert a.kept.codec is lists.codec and b.kept is a.kept and b.filled_at_n is a.filled_at_n
    assert b.codec is lists.codec and "finalists measured" in b.note
    shown = [b.finalists["kept"], *b.finalists["others"]]
    assert [f["label"] for f in shown] == [a.finalists["kept"]["label"], flat.codec.spec.label()]
    assert all(f["measured_for"] == 4 and "fill_s" not in f for f in shown)
    assert b.finalists["others"][0]["of_exact_top10"] == a.finalists["others"][0]["of_exact_top10"]
