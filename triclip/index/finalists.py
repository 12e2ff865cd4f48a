"""At scale, the last word on a budget's code is said at N: its finalists measured as they would be stored.

The choice (``triclip.index.budgets.choose``) ranks codes at N >= ``IVF_MIN_N`` by the share of the exact float
top 10 they hold among a 20,000-row tuning sample, and sizes a re-rank's shortlist by scaling the sample's by
N / 20,000. Both misjudge N:

- two codes can tie on the sample and part at N. At 1M rows and 16 B, a flat ``mixed 16B`` held .595 of the
  sample's exact top 10 and inverted lists of OPQ .586, then .22 against .44 over the 1M rows
  (docs/results_scale.md, "At equal memory"): lists are refitted for N after the choice, a flat code is not;
- a shortlist holds more at N than the scaled sample says. ``rq16x4fs`` (8 B) at 1M: a top 20 of the sample holds
  .60 of its exact top 10, a top 1,000 of the 1M rows .85 of theirs; a top 300 holds .63 at N, where the sample's
  top 6 holds .28. The shortest shortlist the sample offers at N is 50 x its shortest (20): 1,000 rows, which read
  cold from disk take longer than 10 ms, so no re-rank from disk was offered within 10 ms.

So the kept variant's code and up to two more are finalists (``Choice.rival``: another code within
``budgets.FINALIST_MARGIN`` of its score on the sample; ``Choice.first_stage``: among the codes whose codes
alone take at most half the bound, the one whose shortest re-ranked shortlist holds the most on the sample:
``budgets._first_stage``). Each is filled with every row (lists refitted for N), and measured at N for its
codes alone and for each shortlist of :data:`LADDER` re-ranked (latency: the code searched at N, plus the
re-rank; when the vectors are read from disk, the two stages timed end to end, cold: ``scale.cold_ms``;
lists: nprobe tuned at N for each). The variant holding the most of the exact top 10 over all N rows within
the bound (timed cold: ``scale.COLD_HEADROOM`` under it) is kept (then the faster). A re-rank by float32 rows
keeps every exact top-10 row its shortlist holds, so its shortlist is scored by what it holds; by float16 or sq8
rows a shortlist is scored by what its re-rank of those rows keeps (``scale.reranked_at_n``: at 10M, sq8 rows
kept .807 of the val captions' exact top 10 where the shortlist held .901), so a longer shortlist wins only for
what it serves. The cost: the finalists filled
and searched at N, one to three codes; the winner's filled code is the one the build stores (``Choice.filled_at_n``), so the kept code's N rows are
encoded once, and its tuning at N is the one the build records (``Choice.tuned_at_n``): a second tuning of the
same code re-timed it cold, and at 10M, 8 B, once said 10.45 ms where the finalists had measured 9.26.

Filling is most of a build's time at N, and codes encode at very different rates: at 10M and 16 B, lists of RQ
and of OPQ tied on the sample, both were filled, and the build took 3,762 s where OPQ alone took 1,196 (RQ lost at
N: .855 against .947). So a finalist whose N rows would take more than :data:`FILL_RATIO` times the cheapest
finalist's to encode (each code's rate timed filling the sample, ``Variant.encode_us``, times N), while its codes
alone hold at most ``budgets.FINALIST_MARGIN`` more of the sample's exact top 10 than that one's, is not filled (:func:`worth_filling`):
the sample cannot tell the two apart, and the slow one would cost the build, and every ``--add``, its encoding.
Codes are compared alone (each one's codes-alone share of the sample's exact top 10, from ``Choice.tried``): a
finalist may be a code alone or a first stage's shortlist, and a shortlist of 10,000 holds more than the same
code alone (at 10M, 16 B: lists of RQ alone .643, lists of OPQ alone .579, their top 10,000 .767). It is recorded
as not filled, with its estimate; each filled one records its refit and fill time (``fill_s``).

A slow finalist ahead on the sample by more than the margin was still filled for nothing: at 10M and 8 B, lists of
RQ led lists of OPQ by .056 / .072 of the sample's exact top 10, were filled in 730-888 s of 1,510-1,716 s builds,
and held .68-.72 at N against OPQ's .80-.81 (3 seeds; at 16 B .855 against .947). The sample is 20,000 rows; a
million tells them apart: at 1M, 8 B RQ lost on all 3 seeds (.787-.892 against .930-.966), and on 9 of 10 of the
1M builds at 4-16 B. So where N is at least :data:`FIRST_FROM` times :data:`FIRST_ROWS`, a slow finalist and the
cheapest one are first measured as stored on the collection's first ``FIRST_ROWS`` rows (:func:`tried_first`:
the same refit, fill, tuning and bound, a tenth of the cost at 10M), and the slow one is filled at N only where it
holds more there. It is recorded as not filled with both figures; ``finalists["first_rows"]`` keeps what each
held there.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from triclip.index import budgets as bud
from triclip.index import scale
from triclip.index.latency import Latency

LADDER = (100, 200, 300, 400, 500, 1000, 2000, 5000, 10_000)  # shortlists tried at N for a finalist (--rescore):
# at 10M, 8 B, 500 rows read cold were over the bound and 300 held .713 of the exact top 10 (docs/results_scale.md)
FILL_RATIO = 3.0  # a finalist tied with a faster-to-encode one is not filled when its N rows take this many times
# longer to encode (lists of RQ16x8 against lists of OPQ16x8, timed on the 10M sample: 12.4 x)
FIRST_ROWS = 1_000_000  # a slow finalist still worth filling is first tried on the collection's first this many rows
FIRST_FROM = 5  # ... where N is at least this many times FIRST_ROWS (there it costs at most a fifth of its fill)


def settle(choices: list[bud.Choice], vectors, evaluation: bud.EvalSet, rules: bud.Rules,
           seed: int = 0) -> list[bud.Choice]:
    """``choices`` with each one at scale that has another finalist settled at N (``vectors``: every row, shards);
    ``finalists`` records what each held there.

    A code kept by several budgets (``budgets.no_worse_than_smaller``: the very same object) is measured at N
    once: each budget keeping it is settled, alone or beside its own finalists, and where it wins there each one
    takes the same sized, filled and tuned code (so the build encodes its N rows once and stores one file, where it
    filled and stored them once per budget: ~50 min each at 100M). Where a finalist lost at N for a smaller
    budget, the code that beat it there is a finalist of the larger one too (its fill kept), so more bytes never
    hold less at N than fewer. A code measured for a smaller budget is not measured again: its record in a later
    budget's ``finalists`` names the budget it was measured for (``"measured_for"``) instead of a fill time."""
    kept_by = Counter(id(c.kept.codec) for c in choices if c.kept is not None)
    known: dict[tuple, Measured] = {}  # (id of a code, bound) -> what a smaller budget measured of it at N
    out = []
    for choice in choices:
        others = [v for v in (choice.rival, choice.first_stage) if v is not None]
        shared = choice.kept is not None and kept_by[id(choice.kept.codec)] > 1
        if not (others or shared) or choice.kept is None or not bud.at_scale(vectors.count):
            out.append(choice)
            continue
        key = lambda v: (id(v.codec), choice.bound_ms)  # noqa: E731
        distinct = {}  # one variant per code, the kept one first, then what beat any of them for a smaller budget
        for variant in [choice.kept, *others]:
            distinct.setdefault(id(variant.codec), variant)
        for variant in [known[key(v)].beaten_by for v in list(distinct.values()) if key(v) in known]:
            if variant is not None:
                distinct.setdefault(id(variant.codec), variant)
        alone = {t["label"]: t["fidelity"] for t in choice.tried  # each code's codes alone on the sample
                 if not t.get("shortlist") and t.get("fidelity") is not None}
        fresh = [v for v in distinct.values() if key(v) not in known]  # the rest were measured for a smaller budget
        filling, unfilled = worth_filling(fresh, vectors.count, alone)
        filling, lost, first = tried_first(filling, choice, vectors, evaluation, rules, seed)
        unfilled += lost
        shown, best, new = [], None, []  # each finalist's record as this budget shows it; the best one measured
        for variant in [v for v in distinct.values() if key(v) in known or any(v is f for f in filling)]:
            if key(variant) in known:
                was = known[key(variant)]
                shown.append({**{k: v for k, v in was.answer[0].items() if k != "fill_s"}, "measured_for": was.budget})
                if was.beaten_by is not None:
                    continue  # it lost there to a code among these finalists
                measured = was.answer
            else:
                measured = _as_stored(variant, choice, vectors, evaluation, rules, seed)
                shown.append(measured[0])
                new.append((variant, measured))
            if best is None or _rank(measured[0]) > _rank(best[1][0]):
                best = shown[-1], measured  # a loser's filled codes are freed here: at most two held at once
        record, (_, sized, variant, filled, tuned) = best
        for tried, measured in new:  # a later budget keeping one of these takes the winner's fill, or skips a loser
            won = measured is best[1]
            known[key(tried)] = Measured(choice.budget, measured if won else (measured[0],), None if won else variant)
        finalists = {"n": vectors.count, "queries": len(evaluation.queries), "kept": record,
                     "others": [r for r in shown if r is not record], **({"not_filled": unfilled} if unfilled else {}),
                     **({"first_rows": first} if first else {})}
        note = f"kept by the finalists measured at N = {vectors.count:,}" if variant.codec is not choice.kept.codec \
            or variant.shortlist != choice.kept.shortlist else ""
        out.append(replace(choice, codec=variant.codec, recall=variant.recall, kept=variant, finalists=finalists,
                           sized_at_n=sized, filled_at_n=filled, tuned_at_n=tuned,
                           note="; ".join(n for n in (choice.note, note) if n)))
    return out


class Measured(NamedTuple):
    """A finalist as measured at N for one budget (:func:`settle`), for the larger budgets that meet it again."""

    budget: int  # the budget it was measured for
    answer: tuple  # :func:`_as_stored`'s answer; a loser's holds its record only (its fill is freed)
    beaten_by: bud.Variant | None  # the variant that won there, where this one lost


def worth_filling(variants: list[bud.Variant], n: int, alone: dict[str, float] | None = None
                  ) -> tuple[list[bud.Variant], list[dict]]:
    """The finalists to fill with the ``n`` rows, in order, and a record ``{"label", "not_filled"}`` of each one left
    out: its encoding of ``n`` rows (``encode_us`` x n) would take more than :data:`FILL_RATIO` times the cheapest
    finalist's, and its code alone holds at most ``FINALIST_MARGIN`` more of the sample's exact top 10 than that
    one's (``alone``: by code label; a code missing there is compared by its variant's score). Untimed ones are
    filled."""
    timed = [v for v in variants if v.encode_us is not None]
    if not timed:
        return variants, []
    score = lambda v: (alone or {}).get(v.codec.spec.label(), v.score)  # noqa: E731
    cheapest = min(timed, key=lambda v: v.encode_us)
    filling, unfilled = [], []
    for v in variants:
        slow = v.encode_us is not None and v.encode_us > FILL_RATIO * cheapest.encode_us
        if slow and score(v) <= score(cheapest) + bud.FINALIST_MARGIN:
            unfilled.append({"label": v.codec.spec.label(), "not_filled": (
                f"its {n:,} rows would take ~{v.encode_us * n / 1e6:,.0f} s to encode, {v.encode_us / cheapest.encode_us:.1f}"
                f" x {cheapest.codec.spec.label()}'s, whose codes alone the sample puts within {bud.FINALIST_MARGIN:g}"
                f" of its ({score(cheapest):.3f} against {score(v):.3f})")})
        else:
            filling.append(v)
    return filling, unfilled


def tried_first(filling: list[bud.Variant], choice: bud.Choice, vectors, evaluation: bud.EvalSet, rules: bud.Rules,
                seed: int = 0) -> tuple[list[bud.Variant], list[dict], dict | None]:
    """``filling`` without each finalist slow to encode (``encode_us`` over :data:`FILL_RATIO` times the cheapest
    one's) that, measured as stored on the first :data:`FIRST_ROWS` rows of ``vectors``, holds less of their exact
    top 10 within the bound than the cheapest one there (:func:`_rank`); a record ``{"label", "not_filled"}`` of each
    one left out; and what each held there ``{"n", "finalists": [records]}`` (None where none was run: fewer than
    :data:`FIRST_FROM` x ``FIRST_ROWS`` rows, or no slow finalist)."""
    timed = [v for v in filling if v.encode_us is not None]
    if not timed or vectors.count < FIRST_FROM * FIRST_ROWS:
        return filling, [], None
    cheapest = min(timed, key=lambda v: v.encode_us)
    slow = [v for v in timed if v.encode_us > FILL_RATIO * cheapest.encode_us]
    if not slow:
        return filling, [], None
    head = vectors.head(FIRST_ROWS)
    held = {id(v): _as_stored(v, choice, head, evaluation, rules, seed)[0] for v in [cheapest, *slow]}
    base = held[id(cheapest)]
    lost = [v for v in slow if _rank(held[id(v)]) < _rank(base)]
    unfilled = [{"label": v.codec.spec.label(), "not_filled": (
        f"on the first {FIRST_ROWS:,} rows, as stored, it held {held[id(v)]['of_exact_top10']:.3f} of their exact"
        f" top 10 in {held[id(v)]['ms']:.3g} ms against {base['of_exact_top10']:.3f} in {base['ms']:.3g} ms for"
        f" {cheapest.codec.spec.label()}, whose {vectors.count:,} rows encode {v.encode_us / cheapest.encode_us:.1f}"
        f" x faster")} for v in lost]
    first = {"n": FIRST_ROWS, "finalists": list(held.values())}
    return [v for v in filling if all(v is not gone for gone in lost)], unfilled, first


def _rank(record: dict) -> tuple:
    """How finalists compare: the most of the exact top 10 held at N, then the faster."""
    return record["of_exact_top10"], -record["ms"]


def _as_stored(variant: bud.Variant, choice: bud.Choice, vectors, evaluation: bud.EvalSet, rules: bud.Rules,
               seed: int) -> tuple[dict, tuple | None, bud.Variant, bud.codecs.Codec, dict | None]:
    """The best way to search ``variant``'s code when stored, within the choice's bound, and what it holds of the
    exact float top 10 over every row of ``vectors``: ``{"label", "shortlist", "of_exact_top10", "ms", "nprobe"}``.
    The code is sized for N (``scale.sized_for_n``), filled in memory ((B + 8) N bytes for lists), and searched
    alone and (``rules.rescore``) with each shortlist of :data:`LADDER`. Also returns what ``sized_for_n`` gave
    (None for a code it leaves as fitted: the build stores the winner from it instead of refitting it), the
    variant measured best, the code filled with every row (the build stores the winner's as it is instead of
    encoding the N rows again), and that variant's ``scale.tune_at_n`` on it (None for a flat code: nothing
    to tune), which the build records instead of tuning the same code again."""
    started = time.perf_counter()
    codec, done = scale.sized_for_n(variant.codec, vectors, seed)
    stored = scale.fill(codec, vectors)
    fill_s = round(time.perf_counter() - started, 1)  # the refit for N and the fill: what this finalist cost
    lengths = [None] + ([n for n in LADDER if n < len(stored) // 4] if rules.rescore and variant.codec.spec.codec
                        != "float32" else [])
    tried, whole = [], None
    timed = np.ascontiguousarray(evaluation.queries[: bud.TUNE_QUERIES], np.float32)  # (q, D)
    for length in lengths:
        if length and tried and rules.rerank_ms(evaluation.gallery, timed, length) > choice.bound_ms:
            break  # its re-rank alone is over the bound, and a longer one's costs more
        tried.append(_at_n(stored, variant, length, choice, vectors, evaluation, rules, whole))
        whole = tried[-1][0].pop("whole")  # what every list holds: searched once per code
        if length and choice.bound_ms is not None and tried[-1][0]["ms"] > choice.bound_ms:
            break  # this shortlist is over the bound as measured, and a longer one reads more rows
    within = ([t for t in tried if t[0]["ms"] <= _limit(t[1], choice.bound_ms)]
              or [min(tried, key=lambda t: t[0]["ms"])])
    record, best, tuned = max(within, key=lambda t: _rank(t[0]))
    record["fill_s"] = fill_s
    return record, None if done is None else (codec, done), best, stored, tuned


def _limit(staged: bud.Variant, bound: float) -> float:
    """The most a finalist's variant may take: ``bound``, less ``scale.COLD_HEADROOM`` where it was timed end to
    end cold (cold reads vary)."""
    return scale.cold_limit(bound) if staged.latency.how == "measured cold" else bound


def _at_n(stored, variant: bud.Variant, length: int | None, choice: bud.Choice, vectors, evaluation: bud.EvalSet,
          rules: bud.Rules, whole: float | None = None) -> tuple[dict, bud.Variant, dict | None]:
    """The stored code searched at N alone (``length`` None) or for a shortlist of ``length`` re-ranked: what it
    holds of the exact top 10 (re-ranked by the rows as stored: by float16 or sq8 rows, what it serves, not what
    its shortlist holds) and its latency (lists: at the nprobe tuned at N for it; ``whole``: what their every
    list holds, when known; the record's "whole" gives it back), the variant so measured, and the tuning (lists)."""
    queries = np.ascontiguousarray(evaluation.queries, np.float32)  # (Q, D)
    timed = queries[: bud.TUNE_QUERIES]
    staged = replace(variant, shortlist=length, shortlist_how="measured at N",
                     reads="disk" if rules.reads_from and length else "memory")
    at_n = scale.tune_at_n(stored, vectors, evaluation, replace(choice, codec=variant.codec, kept=staged), rules, whole)
    if at_n is not None:  # lists: nprobe tuned at N for this length, within the bound where one is
        latency = scale.at_n_latency(at_n)
        held, ms, how, nprobe, whole = scale.served_at_n(at_n), latency["ms"], latency["how"], at_n["nprobe"], \
            at_n["whole_lists"]
    else:
        truth = scale.exact_at_n(vectors, evaluation)
        held = scale.reranked_at_n(stored, vectors, queries, truth, length, rules) \
            if length and scale.coarse_rows(rules) else bud.overlap(stored.search(queries, length or bud.K)[1], truth)
        ms, how, nprobe = scale.cold_ms(stored, rules, timed, length), "measured cold", None
        if ms is None:
            ms = rules.model.search(stored, timed, length or bud.K, len(stored)).ms
            ms += rules.rerank_ms(evaluation.gallery, timed, length) if length else 0.0
            how = "measured"
    n_eval = len(evaluation.gallery)
    recall = bud.measure(variant.codec, evaluation, None if length is None else
                         max(bud.K, min(n_eval, math.ceil(length * n_eval / len(stored)))))
    staged = replace(staged, recall=recall, latency=Latency(ms, how), fidelity=held)
    return {"label": stored.spec.label(), "shortlist": length, "of_exact_top10": round(float(held), 4),  # lists: at
            "ms": round(ms, 4), "nprobe": nprobe, "whole": whole}, staged, at_n  # the nprobe tune_at_n just set

