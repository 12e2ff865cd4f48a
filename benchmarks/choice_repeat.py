"""Does ``index build --bytes B`` keep the same code when run again? The choice at a small N, repeated.

Usage::

    .venv/bin/python -m benchmarks.choice_repeat INDEX --val-embeddings VAL --bytes 4,8,16 [--repeats 5]
        [--side image|text|both]

At a few thousand rows a query takes 0.05-0.2 ms, as does the default latency bound (the float32 scan at N), so
a candidate near it can be kept in one build and left out in the next. This runs ``budgets.choose_all`` on the
index's own vectors with ``VAL`` (``triclip embed --split val``) as the evaluation set, ``--repeats`` times in one
process, each with a fresh latency model. Nothing is written. Per side and budget: the codes kept (how often), the
bound's median and range, the candidates within the bound in some repeats and over it in others (flips), and the
median spread ((max - min) / median over the repeats) of a candidate's latency and of its latency over the bound
(a spread that the ratio does not shrink is not a drift of the whole machine).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict

import numpy as np

from triclip.index import budgets as bud
from triclip.index.store import load_contents
from triclip.index.val_embeddings import validation_set
from triclip.index.vectors import ShardVectors


def sides(index: str, val: str, which: str) -> dict:
    """{side: (gallery ShardVectors, EvalSet)} of the index's live version (its files checked on reading)."""
    contents = load_contents(index, indexes=False)
    evaluation = validation_set(val, contents.manifest)
    out = {"image": (ShardVectors.of([contents.vectors]), evaluation),
           "text": (ShardVectors.of([contents.text_vectors]), evaluation.reverse())}
    return {s: out[s] for s in (("image", "text") if which == "both" else (which,))}


def summary(choices: list[list[bud.Choice]], budget: int) -> str:
    """The printed line of one budget over the repeats."""
    picks = [next(c for c in run if c.budget == budget) for run in choices]
    kept = Counter(f"{bud._words(c.kept)} ({c.recall:.3f})" for c in picks)
    bounds = np.array([c.bound_ms for c in picks])
    timed = defaultdict(list)  # (label, shortlist) -> [(ms, bound ms)], one per repeat that measured it
    for c, t in ((c, t) for c in picks for t in c.tried if t.get("latency_ms") is not None):
        timed[t["label"], t.get("shortlist")].append((t["latency_ms"], c.bound_ms))
    flips = sorted(f"{label}{'' if s is None else f' + {s}'}" for (label, s), v in timed.items()
                   if len({ms <= bound for ms, bound in v}) == 2)
    every = [np.array(v) for v in timed.values() if len(v) == len(picks)]  # (repeats, 2) each
    spread = {name: np.median([(x.max() - x.min()) / np.median(x) for x in map(of, every)])
              for name, of in (("latency", lambda a: a[:, 0]), ("latency / bound", lambda a: a[:, 0] / a[:, 1]))}
    return (f"  {budget} B: kept {dict(kept)}; bound {np.median(bounds):.3g} ms [{bounds.min():.3g}, {bounds.max():.3g}];"
            f" {len(flips)} flips {flips}; spread {', '.join(f'{k} {v:.0%}' for k, v in spread.items())}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("index", help="an index folder (index build)")
    p.add_argument("--val-embeddings", required=True, help="triclip embed --split val output of the index's run")
    p.add_argument("--bytes", default="4,8,16", help="budgets, e.g. 4,8,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--side", choices=("image", "text", "both"), default="both")
    ns = p.parse_args(argv)
    budgets = bud.parse_budgets([int(b) for b in ns.bytes.split(",")])
    for side, (vectors, evaluation) in sides(ns.index, ns.val_embeddings, ns.side).items():
        runs = [bud.choose_all(budgets, vectors, evaluation, rules=bud.Rules(n=vectors.count))
                for _ in range(ns.repeats)]
        print(f"{side}, N = {vectors.count:,}, {ns.repeats} repeats:", flush=True)
        print("\n".join(summary(runs, b) for b in budgets), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
