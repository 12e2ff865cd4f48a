"""The kept code at the collection's N: filled with every row, lists refitted for N, nprobe tuned there.

The choice (:mod:`triclip.index.budgets`) ranks codes on a sample of at most ``FIT_ROWS`` rows. What it keeps is
then made what the build stores, at N: :func:`fill` encodes every row; inverted lists at N >= ``IVF_MIN_N`` are
first refitted for N (:func:`sized_for_n`: nlist = ``lists_for`` N, not the sample's capped one), and their nprobe
tuned at N against the exact float top 10 of the evaluation queries among all N rows (:func:`tune_at_n`, the exact
top 10 streamed by :func:`exact_at_n`). Where the re-rank reads its rows from disk, the kept nprobe is timed end
to end, cold (:func:`cold_ms`), and stepped down until it stays :data:`COLD_HEADROOM` under the bound. The
finalists (:mod:`triclip.index.finalists`) use the same functions on each code they measure at N.
"""

from __future__ import annotations

import math
import time

import numpy as np

from triclip import codecs
from triclip.core.progress import progress
from triclip.index.budgets import K, TUNE_QUERIES, Choice, EvalSet, Rules, at_scale, exhaustive_ids, overlap
from triclip.index.vectors import exact_topk

EXACT_ROWS = 65_536  # rows read at once for the exact float top 10 at N (tune_at_n): 64 MB at D = 256
COLD_HEADROOM = 0.2  # at N, a re-rank from disk is kept where its slower timing (end to end cold, or the parts
# summed) stays this share under the bound: a served query reads the same rows later, and cold reads on this VM's
# disk move with time. The benchmark's cold median of the kept variant, minutes after the build, was 7.4-13.7%
# over the build's timing at 1M and 10M (the ids; 8.6-26.5% with the hits' meta rows, not bounded); one 1M index
# timed again and again the build's way over 15 minutes gave 7.2-8.7 ms, where its build had timed 7.67
# (docs/results_scale.md, "The build's cold timing against the benchmark's"). At 0.1 the 10M, 32 B build kept
# 8.78 ms under a 10 ms bound and served 10.82.


def fill(codec: codecs.Codec, vectors) -> codecs.Codec:
    """A copy of the trained ``codec`` holding every row of ``vectors`` (shards), in order."""
    full = codec.empty_copy()
    rows = progress(desc=f"encoding {codec.spec.label()}", total=vectors.count, unit="row", disable=None)
    for part in vectors.parts:
        if len(part):
            full.add(np.asarray(part, np.float32))
        rows.update(len(part))
    rows.close()
    return full


def resized_for_n(codec: codecs.Codec, vectors) -> bool:
    """Whether :func:`sized_for_n` refits ``codec`` for the collection ``vectors``: inverted lists at N >=
    ``IVF_MIN_N``."""
    return hasattr(codec, "sized_for") and at_scale(vectors.count)


def sized_for_n(codec: codecs.Codec, vectors, seed: int = 0) -> tuple[codecs.Codec, dict | None]:
    """The kept ``codec`` as it is stored for the collection ``vectors`` (N rows): inverted lists at N >=
    ``IVF_MIN_N`` refitted for N (``IVFCodec.sized_for``: nlist = ``lists_for`` N, not the sample's capped one);
    any other code as it was fitted. Returns it and what was done (None: nothing)."""
    if not resized_for_n(codec, vectors):
        return codec, None
    started = time.perf_counter()
    sized, done = codec.sized_for(vectors, seed)
    return sized, {**done, "fitted_on_sample": codec.spec.label(), "seconds": round(time.perf_counter() - started, 1)}


def tune_at_n(stored: codecs.Codec, vectors, evaluation: EvalSet, choice: Choice, rules: Rules,
              whole: float | None = None) -> dict | None:
    """nprobe of the filled inverted lists ``stored`` (every row of ``vectors``), tuned at N on the evaluation
    queries against their exact float top 10 among all N rows (streamed: :data:`EXACT_ROWS` rows at a time).

    Codes alone: the smallest power of two nprobe whose top 10 holds ``rules.recall_target`` of what the lists
    scanned whole hold of the exact top 10 (a code alone cannot hold more than that); with a re-rank (the kept
    variant's shortlist): whose shortlist holds ``rules.recall_target`` of the exact top 10 itself. Each within the
    choice's latency bound (one query, one thread, at N; the re-rank's time added); where no nprobe reaches it,
    the smallest of those within the bound holding the most (``note`` says so): a shortlist that holds all it can
    at 32 lists holds no more at 256, and only costs the time of scanning them. Where the re-rank reads its rows
    from disk, the nprobe so kept is timed end to end cold and stepped down until that, and its parts summed, stay
    :data:`COLD_HEADROOM` under the bound (:func:`_cold_within`). Sets it on ``stored``; returns the manifest's
    ``at_n`` entry (nprobe, its curve, "tuned at N"); None for a code without lists. ``whole``: what every list
    holds, when known (the same lists tuned again for another shortlist: ``triclip.index.finalists``), else searched
    here."""
    if stored.exhaustive() is None:
        return None
    queries = np.ascontiguousarray(evaluation.queries, np.float32)  # (Q, D)
    truth = exact_at_n(vectors, evaluation)  # (Q, K)
    nlist, length = stored.exhaustive()["nprobe"], (choice.kept.shortlist if choice.kept is not None else None) or K
    timed = queries[:TUNE_QUERIES]
    extra = 0.0 if length == K else rules.rerank_ms(evaluation.gallery, timed, length)
    bound = choice.bound_ms or math.inf
    if whole is None:
        whole = overlap(exhaustive_ids(stored, queries, K), truth)
    goal = rules.recall_target * (whole if length == K else 1.0)
    curve, nprobe, reached = [], 0, False
    for p in _powers(nlist):
        held = overlap(stored.search(queries, length, params={"nprobe": p})[1], truth)
        ms = rules.model.search(stored, timed, length, len(stored), params={"nprobe": p}).ms + extra
        curve.append({"nprobe": p, "of_exact_top10": round(held, 4), "ms": round(ms, 4)})
        if ms > bound:
            break
        nprobe, reached = p, held >= goal
        if reached:
            break
    within = [c for c in curve if c["ms"] <= bound]
    if not reached and within:  # the fastest of those holding the most: past a plateau, more lists cost time only
        most = max(c["of_exact_top10"] for c in within)
        nprobe = min(c["nprobe"] for c in within if c["of_exact_top10"] == most)
    nprobe = nprobe or 1
    stored.set_nprobe(nprobe)
    note = "" if reached else (f"no nprobe within {bound:g} ms holds {goal:.3f} of the exact top 10 at N = "
                               f"{len(stored):,}: the fewest lists holding the most within it kept")
    cold = None
    if length != K and rules.reads_from:  # the re-rank reads from disk: timed end to end cold, stepped down
        kept, (nprobe, cold) = nprobe, _cold_within(stored, rules, timed, length, curve, nprobe, bound)
        if nprobe < kept:
            reached = next(c["of_exact_top10"] for c in curve if c["nprobe"] == nprobe) >= goal
            note = "; ".join(n for n in (note, f"nprobe {kept} stepped down to {nprobe}: end to end, cold, within "
                                               f"{1 - COLD_HEADROOM:.0%} of the bound") if n)
        slowest = max(cold, curve_ms(curve, nprobe))
        if slowest > cold_limit(bound):
            over = "the bound" if slowest > bound else f"{1 - COLD_HEADROOM:.0%} of the bound"
            why = "" if nprobe < kept else ": scanning fewer lists would not save that"
            note = "; ".join(n for n in (note, f"end to end, cold: {cold:.3g} ms, over {over}{why}") if n)
    coarse = length != K and coarse_rows(rules)
    reranked = reranked_at_n(stored, vectors, queries, truth, length, rules, {"nprobe": nprobe}) if coarse else None
    return {"how": "tuned at N", "n": len(stored), "queries": len(queries), "nlist": int(nlist), "nprobe": nprobe,
            "shortlist": None if length == K else length, "target": round(goal, 4),
            "whole_lists": round(whole, 4), "curve": curve, "reached": reached, "note": note,
            **({} if cold is None else {"cold_ms": round(cold, 4)}),
            **({} if reranked is None else {"reranked": round(reranked, 4)})}


def coarse_rows(rules: Rules) -> bool:
    """Whether a re-rank reads rows coarser than float32 (float16 or sq8): its shortlist's share of the exact top
    10 is then more than it serves (:func:`reranked_at_n`)."""
    return rules.sq8 is not None or rules.vector_bytes < 4


def reranked_at_n(stored: codecs.Codec, vectors, queries: np.ndarray, truth: np.ndarray, length: int, rules: Rules,
                  params: dict | None = None, batch: int = 64) -> float:
    """Share of ``truth`` (Q, K), the exact float top 10 at N, that a re-rank of ``stored``'s top ``length``
    (searched with ``params``: lists, their nprobe) holds when it scores the rows as the stored vectors keep them
    (``rules.kept``: float16 rounded, sq8 coded and decoded). A float32 re-rank keeps every exact top-10 row its
    shortlist holds; coarser rows reorder near-ties, and a large N crowds them together (sq8 at 10M:
    docs/results_scale.md). The rows of ``batch`` queries are read and kept at once (each read opens every shard)."""
    ids = stored.search(queries, length, params=params)[1]  # (Q, length), -1 for none
    top = np.full((len(queries), K), -1, np.int64)
    for lo in range(0, len(queries), batch):
        rows = np.unique(ids[lo : lo + batch])
        rows = rows[rows >= 0]  # sorted, as ShardVectors.rows reads them
        kept = rules.kept(vectors.rows(rows, vectors.dim))  # (R, D) as the stored vectors hold them
        for q in range(lo, min(lo + batch, len(queries))):
            mine = np.unique(ids[q][ids[q] >= 0])
            scores = kept[np.searchsorted(rows, mine)] @ queries[q]  # (len(mine),)
            best = mine[np.argsort(-scores, kind="stable")[:K]]
            top[q, : len(best)] = best
    return overlap(top, truth)


def _cold_within(stored: codecs.Codec, rules: Rules, queries: np.ndarray, shortlist: int, curve: list[dict],
                 nprobe: int, bound: float) -> tuple[int, float]:
    """``nprobe`` of the filled lists ``stored``, stepped down ``curve``'s powers of two until its slower timing, end
    to end cold (:func:`cold_ms`) or its parts summed (the curve's), is :data:`COLD_HEADROOM` under ``bound``. A step
    goes to the most lists whose scan, by the curve, saves what the last cold timing is over; where no step would
    save that (the re-rank's reads are the cost: at 10M, 8 B the parts summed 8.31 ms at 1 list and 8.55 at 16), it
    stays: fewer lists would lose answers for a cold timing's noise (one such build kept 4 lists, holding .720 of the
    exact top 10 where 16 held .808). Sets it on ``stored``; returns it and its cold milliseconds."""
    edge, summed = cold_limit(bound), {c["nprobe"]: c["ms"] for c in curve}
    stored.set_nprobe(nprobe)
    cold = cold_ms(stored, rules, queries, shortlist)
    while max(cold, summed.get(nprobe, 0.0)) > edge:
        saves = [p for p in sorted(summed, reverse=True) if p < nprobe
                 and max(cold - summed.get(nprobe, 0.0) + summed[p], summed[p]) <= edge]
        if not saves:
            break
        nprobe = saves[0]
        stored.set_nprobe(nprobe)
        cold = cold_ms(stored, rules, queries, shortlist)
    return nprobe, cold


def cold_limit(bound: float) -> float:
    """The most a search timed end to end cold may take under a latency ``bound``: :data:`COLD_HEADROOM` less."""
    return bound * (1 - COLD_HEADROOM)


def curve_ms(curve: list[dict], nprobe: int) -> float:
    """The parts summed of ``nprobe`` on a ``tune_at_n`` curve (0: not on it)."""
    return next((c["ms"] for c in curve if c["nprobe"] == nprobe), 0.0)


def cold_ms(stored: codecs.Codec, rules: Rules, queries: np.ndarray, shortlist: int | None) -> float | None:
    """One query of the filled code ``stored`` at N (its nprobe set) with a re-rank of ``shortlist`` rows read
    from disk (``rules.reads_from``), timed end to end, cold (``LatencyModel.cold_search``): what it costs as
    stored, where the sum of its parts timed apart (the code's search, the re-rank, the rows' cold reads) says
    less. None without a re-rank from disk: the sum is then what it costs."""
    if not shortlist or not rules.reads_from:
        return None
    return rules.model.cold_search(stored, rules.reads_from, queries, shortlist, sq8=rules.sq8)


def shortlist_held(at_n: dict) -> float:
    """The share of the exact top 10 the kept nprobe's top 10 (or shortlist) holds: its point on the curve."""
    return next(c["of_exact_top10"] for c in at_n["curve"] if c["nprobe"] == at_n["nprobe"])


def served_at_n(at_n: dict) -> float:
    """The share of the exact top 10 the kept nprobe serves: by float16 or sq8 rows, what their re-rank keeps
    (``reranked``); else what its shortlist holds (a float32 re-rank keeps every exact top-10 row it is given)."""
    return at_n.get("reranked", shortlist_held(at_n))


def at_n_latency(at_n: dict) -> dict:
    """The latency (``Latency.to_json``) of the nprobe kept at N: from its curve (the parts summed), or where its
    re-rank reads from disk the slower of that and its time end to end cold (``cold_ms``): two timings of one
    search, and cold reads vary."""
    summed = curve_ms(at_n["curve"], at_n["nprobe"])
    if at_n.get("cold_ms") is not None:
        return {"ms": max(at_n["cold_ms"], summed), "how": "measured cold"}
    return {"ms": summed, "how": "measured"}


_EXACT_AT_N: list = []  # the last two (vectors, evaluation, exact top 10) of exact_at_n: a side's budgets share one
# scan, and the finalists measured first on the first rows (triclip.index.finalists) does not push N's out


def exact_at_n(vectors, evaluation: EvalSet) -> np.ndarray:
    """(Q, K) the exact float top 10 of the evaluation queries among every row of ``vectors``, streamed
    (:data:`EXACT_ROWS` rows at a time); the last two are kept, so the budgets of one side read the rows once."""
    for seen, asked, truth in _EXACT_AT_N:
        if seen is vectors and asked is evaluation:
            return truth
    truth = exact_topk(vectors.chunked(EXACT_ROWS), np.ascontiguousarray(evaluation.queries, np.float32), K)
    _EXACT_AT_N[:] = [(vectors, evaluation, truth), *_EXACT_AT_N[:1]]  # and the one before: N's, over the first rows'
    return truth


def _powers(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    out = [1]
    while out[-1] * 2 < limit:
        out.append(out[-1] * 2)
    return out + ([limit] if limit > 1 else [])
