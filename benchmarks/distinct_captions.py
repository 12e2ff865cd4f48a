"""What listing distinct caption strings changes in image -> text: a top 10 of caption rows against a top 10 of strings.

    python -m benchmarks.distinct_captions INDEX SPLIT.jsonl [-k 10] [--bytes B]

Each image of INDEX that SPLIT lists (e.g. the demo's ``data/test.jsonl``, which the demo indexes
too) is a query, by its stored vector, against every caption row of the index (the app's and
``search --target text``'s gallery: all splits). "rows" is the top k caption rows as they rank (identical
strings of different images each take a place); "distinct" is ``Searcher.search_vectors(...,
target="text")``: the top k distinct strings. Prints, for both: the mean number of distinct strings
shown in a top k, the share of queries whose top k holds one string more than once, and i2t
recall@k (a hit: one of the image's own caption strings among the k shown). Torch-free.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from triclip.index.search import Searcher
from triclip.index.store import load_contents


def split_rows(contents, split: str) -> list[int]:
    """The image rows of ``contents`` whose file SPLIT lists."""
    folder = os.path.dirname(os.path.abspath(split))
    with open(split, encoding="utf-8") as fh:
        paths = {os.path.join(folder, json.loads(line)["image"]) for line in fh if line.strip()}
    return [i for i, row in enumerate(contents.meta) if row["image"] in paths]


def summary(lists: list[list[str]], own: list[set[str]]) -> dict:
    """Mean distinct strings per list, share of lists with a repeat, and recall (a list holding an own string)."""
    distinct = [len(set(shown)) for shown in lists]
    return {
        "distinct_shown": float(np.mean(distinct)),
        "repeats": float(np.mean([d < len(shown) for d, shown in zip(distinct, lists)])),
        "recall": float(np.mean([bool(mine & set(shown)) for shown, mine in zip(lists, own)])),
    }


def measure(index: str, split: str, k: int = 10, budget: int | None = None) -> dict:
    """The two top-k's of every SPLIT image, summarised (:func:`summary`), and the query count."""
    contents = load_contents(index)
    searcher = Searcher(contents, None, None, None)  # stored vectors only: no model
    rows = split_rows(contents, split)
    queries = np.asarray(contents.vectors[rows], np.float32)  # (Q, D)
    scores, ids = searcher._ranked(queries, k, None, "text", None, budget, None)  # caption rows, as they rank
    by_rows = [[h["caption"] for h in searcher._hits(s, i, "text")] for s, i in zip(scores, ids)]
    distinct = [[h["caption"] for h in hits] for hits in searcher.search_vectors(queries, k, target="text", bytes=budget)]
    own = [set(contents.meta[r]["captions"]) for r in rows]
    return {"queries": len(rows), "k": k, "bytes": budget, "rows": summary(by_rows, own),
            "distinct": summary(distinct, own)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("index")
    p.add_argument("split")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--bytes", type=int, default=None, help="search the caption codes of B bytes (default: full D)")
    args = p.parse_args(argv)
    result = measure(args.index, args.split, args.k, args.bytes)
    where = f"{args.bytes} B caption codes" if args.bytes else "full D"
    print(f"{result['queries']} images of {args.split} as queries, {where}, top {args.k}:")
    for name in ("rows", "distinct"):
        r = result[name]
        print(f"  {name:<8} distinct strings shown {r['distinct_shown']:.2f} of {args.k}, lists with a repeat"
              f" {r['repeats']:.1%}, i2t recall@{args.k} {r['recall']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
