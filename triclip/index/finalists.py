"""At scale, a near-tie on the sample settled as stored: the kept code and its closest rival measured at N.

The choice (``triclip.index.budgets.choose``) ranks codes at N >= ``IVF_MIN_N`` by the share of the exact float
top 10 they hold among a 20,000-row tuning sample. Two codes can tie there and part at N: at 1M rows and 16 B, a
flat ``mixed 16B`` held .595 of it on the sample and inverted lists of OPQ .586, then .22 against .44 over the
1M rows (docs/results_scale.md, "At equal memory"). Inverted lists are refitted for N after the choice and a flat
code is not, and the neighbours among N rows are closer than among 20,000. So when another code's score on the
sample is within ``budgets.FINALIST_MARGIN`` of the kept one's (``Choice.rival``), both are measured as they would be
stored: filled with every row, lists refitted for N and their nprobe tuned at N within the bound, and scored by
the share of the exact float top 10 over all N rows their answers hold (a re-rank keeps every exact top-10 row
its shortlist holds, so a two-stage code is scored by its shortlist). The better one is kept; a tie keeps the
sample's choice. The cost: one more code filled and tuned at N for each budget with a near-tie.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from triclip.index import budgets as bud


def settle(choices: list[bud.Choice], vectors, evaluation: bud.EvalSet, rules: bud.Rules,
           seed: int = 0) -> list[bud.Choice]:
    """``choices`` with each near-tie at scale settled at N (``vectors``: every row, shards); ``finalists`` records
    what both held there."""
    out = []
    for choice in choices:
        rival = choice.rival
        if rival is None or choice.kept is None or not bud.at_scale(vectors.count):
            out.append(choice)
            continue
        kept_at, kept_sized = _as_stored(choice.kept, choice, vectors, evaluation, rules, seed)
        rival_at, rival_sized = _as_stored(rival, choice, vectors, evaluation, rules, seed)
        finalists = {"n": vectors.count, "queries": len(evaluation.queries), "kept": kept_at, "rival": rival_at}
        sized = kept_sized
        if rival_at["of_exact_top10"] > kept_at["of_exact_top10"]:
            note = (f"{rival_at['label']} holds {rival_at['of_exact_top10']:.3f} of the exact top 10 at N ="
                    f" {vectors.count:,} against {kept_at['label']}'s {kept_at['of_exact_top10']:.3f}: kept instead")
            choice = replace(choice, codec=rival.codec, recall=rival.recall, kept=rival,
                             note="; ".join(n for n in (choice.note, note) if n))
            finalists["kept"], finalists["rival"], sized = rival_at, kept_at, rival_sized
        out.append(replace(choice, finalists=finalists, sized_at_n=sized))
    return out


def held_as_stored(variant: bud.Variant, choice: bud.Choice, vectors, evaluation: bud.EvalSet, rules: bud.Rules,
                   seed: int = 0) -> dict:
    """What ``variant`` holds of the exact float top 10 over every row of ``vectors`` when stored: its code sized
    for N (``budgets.sized_for_n``), filled, its nprobe tuned at N (``budgets.tune_at_n``, within the choice's
    bound), its top 10 (or shortlist) searched for the evaluation queries. The code is filled in memory here,
    (B + 8) N bytes for lists, and freed on return."""
    return _as_stored(variant, choice, vectors, evaluation, rules, seed)[0]


def _as_stored(variant: bud.Variant, choice: bud.Choice, vectors, evaluation: bud.EvalSet, rules: bud.Rules,
               seed: int) -> tuple[dict, tuple | None]:
    """:func:`held_as_stored`, and what ``budgets.sized_for_n`` gave (None for a code it leaves as fitted): the
    build stores the winner from it instead of refitting it."""
    codec, done = bud.sized_for_n(variant.codec, vectors, seed)
    stored = bud.fill(codec, vectors)
    at_n = bud.tune_at_n(stored, vectors, evaluation, replace(choice, codec=variant.codec, kept=variant), rules)
    if at_n is not None:
        held = bud.held_at_n({"at_n": at_n})["of_exact_top10"]
    else:
        queries = np.ascontiguousarray(evaluation.queries, np.float32)  # (Q, D)
        held = bud.overlap(stored.search(queries, variant.shortlist or bud.K)[1], bud.exact_at_n(vectors, evaluation))
    record = {"label": stored.spec.label(), "shortlist": variant.shortlist, "of_exact_top10": round(float(held), 4),
              "nprobe": None if at_n is None else at_n["nprobe"]}
    return record, None if done is None else (codec, done)
