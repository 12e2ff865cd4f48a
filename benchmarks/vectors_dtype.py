"""What keeping the full-D vectors as float16 (``index build --vectors float16``) changes in the answers of a re-rank.

    python -m benchmarks.vectors_dtype INDEX [--split SPLIT.jsonl] [-k 10] [--queries 5000]

The queries are the caption vectors of INDEX (those of SPLIT's images, e.g. the demo's ``data/test.jsonl``; else
the first ``--queries``), each searched exactly over every image row twice: against the stored float32 vectors and
against the same vectors rounded to float16. A re-rank of any shortlist is this search restricted to the shortlist,
so what holds here bounds it. Prints the share of the float32 top k that float16 keeps, the queries whose top k
changed at all, the largest change of a score, the largest shortfall (the float32 score of the k-th hit kept
against float16's worst pick, scored in float32), t2i recall@k both ways (a hit: the caption's own image) and the
vectors' bytes per row. Torch-free.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.distinct_captions import split_rows
from triclip.index.store import load_contents
from triclip.index.vectors import exact_topk


def measure(index: str, split: str | None = None, k: int = 10, queries: int = 5000) -> dict:
    contents = load_contents(index)
    if contents.text_vectors is None:
        raise SystemExit(f"{index} has no caption vectors to query with")
    full = np.asarray(contents.vectors, np.float32)  # (N, D)
    half = full.astype(np.float16).astype(np.float32)  # (N, D): what --vectors float16 keeps
    if split is not None:
        wanted = set(split_rows(contents, split))
        picked = [t for t, (row, _) in enumerate(contents.text_rows) if row in wanted]
    else:
        picked = list(range(min(queries, len(contents.text_vectors))))
    q = np.asarray(contents.text_vectors[picked], np.float32)  # (Q, D)
    want, got = exact_topk(full, q, k), exact_topk(half, q, k)  # (Q, k) each
    kept = [len(set(w) & set(g)) / k for w, g in zip(want, got)]
    own = np.asarray([row for row, _ in contents.text_rows[picked]])  # (Q,) each caption's image
    true = np.einsum("qd,qkd->qk", q, full[want]), np.einsum("qd,qkd->qk", q, full[got])  # float32 scores (Q, k)
    change = max(float(np.abs(q[s : s + 256] @ full.T - q[s : s + 256] @ half.T).max()) for s in range(0, len(q), 256))
    return {"index": index, "rows": len(full), "dim": full.shape[1], "queries": len(q), "k": k,
            "top_k_kept": round(float(np.mean(kept)), 5), "queries_changed": int(sum(x < 1 for x in kept)),
            "max_score_change": change, "max_shortfall": float((true[0].min(1) - true[1].min(1)).max()),
            "t2i_recall": {name: float(np.mean((ids == own[:, None]).any(1))) for name, ids in
                           (("float32", want), ("float16", got))}, "bytes_per_row": {"float32": 4 * full.shape[1], "float16": 2 * full.shape[1]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("index")
    p.add_argument("--split", default=None, help="queries: the captions of this split's images (default: the first --queries)")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--queries", type=int, default=5000)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.index, args.split, args.k, args.queries), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
