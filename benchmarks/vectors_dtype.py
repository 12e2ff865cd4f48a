"""What keeping the full-D vectors as float16 or sq8 (``index build --vectors``) changes in the answers of a re-rank.

    python -m benchmarks.vectors_dtype INDEX [--split SPLIT.jsonl] [-k 10] [--queries 5000]

The queries are the caption vectors of INDEX (those of SPLIT's images, e.g. the demo's ``data/test.jsonl``; else
the first ``--queries``), each searched exactly over every image row twice: against the stored float32 vectors and
against the same vectors as each smaller precision keeps them (float16; sq8 as a build keeps it: FAISS's 8-bit
scalar quantiser after a fixed random rotation, ranges fitted on the first rows; "sq8 unrotated": the same
quantiser on the rows as they are, for comparison). A re-rank of any shortlist is this search restricted to the
shortlist, so what holds here bounds it. Prints, per precision, the share of the float32 top k it keeps, the
queries whose top k changed at all, the largest change of a score, the largest shortfall (the float32 score of the
k-th hit kept against its worst pick, scored in float32); t2i recall@k each way (a hit: the caption's own image) and
the vectors' bytes per row. Torch-free.
"""

from __future__ import annotations

import argparse
import json

import faiss
import numpy as np

from benchmarks.distinct_captions import split_rows
from triclip.index.store import load_contents
from triclip.index.vectors import SQ8_SAMPLE, VECTOR_BYTES, SQ8Rows, exact_topk


def measure(index: str, split: str | None = None, k: int = 10, queries: int = 5000) -> dict:
    contents = load_contents(index)
    if contents.text_vectors is None:
        raise SystemExit(f"{index} has no caption vectors to query with")
    full = np.asarray(contents.vectors, np.float32)  # (N, D)
    if split is not None:
        wanted = set(split_rows(contents, split))
        picked = [t for t, (row, _) in enumerate(contents.text_rows) if row in wanted]
    else:
        picked = list(range(min(queries, len(contents.text_vectors))))
    q = np.asarray(contents.text_vectors[picked], np.float32)  # (Q, D)
    own = np.asarray([row for row, _ in contents.text_rows[picked]])  # (Q,) each caption's image
    want = exact_topk(full, q, k)  # (Q, k)
    out = {"index": index, "rows": len(full), "dim": full.shape[1], "queries": len(q), "k": k,
           "t2i_recall": {"float32": _recall(want, own)},
           "bytes_per_row": {name: size * full.shape[1] for name, size in VECTOR_BYTES.items()}}
    for name, kept_rows in kept_precisions(full).items():
        got = exact_topk(kept_rows, q, k)  # (Q, k)
        out[name] = _changes(full, kept_rows, q, want, got)
        out["t2i_recall"][name] = _recall(got, own)
    return out


def kept_precisions(full: np.ndarray) -> dict[str, np.ndarray]:
    """What each smaller precision keeps of ``full`` (N, D), decoded to float32: float16, sq8 (as ``--vectors
    sq8`` keeps it: turned by its fixed rotation, coded, turned back), and sq8 of the rows as they are."""
    return {name: keep(full) for name, keep in precisions(full[:SQ8_SAMPLE]).items()}


def precisions(first: np.ndarray) -> dict:
    """Per smaller precision, a function (n, D) rows -> (n, D) float32 what it keeps of them; the sq8 ranges are
    fitted on ``first``, a collection's first :data:`SQ8_SAMPLE` rows, as a build fits them (so a collection can
    be kept a part at a time)."""
    first = np.ascontiguousarray(first, np.float32)
    turned = SQ8Rows(np.empty((0, first.shape[1]), np.uint8), SQ8Rows.fit(first))
    plain = faiss.ScalarQuantizer(first.shape[1], faiss.ScalarQuantizer.QT_8bit)
    plain.train(first)
    return {"float16": lambda x: np.asarray(x, np.float32).astype(np.float16).astype(np.float32),
            "sq8": lambda x: turned.decode(turned.encode(x)),
            "sq8 unrotated": lambda x: plain.decode(plain.compute_codes(np.ascontiguousarray(x, np.float32)))}


def _changes(full: np.ndarray, kept_rows: np.ndarray, q: np.ndarray, want: np.ndarray, got: np.ndarray) -> dict:
    """What searching ``kept_rows`` instead of ``full`` changes: the share of the top k kept, the queries whose top
    k moved, the largest change of a score, and the largest shortfall (the k-th float32 score against the worst
    pick's, scored in float32)."""
    k = want.shape[1]
    kept = [len(set(w) & set(g)) / k for w, g in zip(want, got)]
    true = np.einsum("qd,qkd->qk", q, full[want]), np.einsum("qd,qkd->qk", q, full[got])  # float32 scores (Q, k)
    change = max(float(np.abs(q[s : s + 256] @ full.T - q[s : s + 256] @ kept_rows.T).max())
                 for s in range(0, len(q), 256))
    return {"top_k_kept": round(float(np.mean(kept)), 5), "queries_changed": int(sum(x < 1 for x in kept)),
            "max_score_change": change, "max_shortfall": float((true[0].min(1) - true[1].min(1)).max())}


def _recall(ids: np.ndarray, own: np.ndarray) -> float:
    """Share of queries whose own image is among their hits ``ids`` (Q, k)."""
    return float(np.mean((ids == own[:, None]).any(1)))


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
