"""The stored codes of an index (``index build --bytes``) measured on one split of its images, and re-scoring.

    python -m benchmarks.index_codes INDEX SPLIT.jsonl

Takes the rows of INDEX whose images SPLIT lists (e.g. the demo's ``data/test.jsonl``, which
the demo indexes too) and their caption vectors; prints text->image recall@10 over distinct
captions (``triclip.index.budgets``) of float32 at full D, float top-m (pruning), each budget's stored
code (its trained quantiser, filled with the split's images), each code's shortlist of
100 / 200 re-ranked with the float vectors (``triclip.index.search.rerank_from``), and the stages the build
recorded (a shortlist the same share of the split as of the index). Then the same for
image->text over the split's distinct captions (``EvalSet.reverse``) and the stored caption
codes, where the index has them. Torch-free.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from triclip.index.budgets import EvalSet, measure, recall_at_k
from triclip.index.search import rerank_from
from triclip.index.store import load_contents
from triclip.index.vectors import exact_topk, prefix


def split_set(index: str, split: str) -> tuple[EvalSet, dict, dict, dict]:
    """The split's images and distinct captions as served vectors of ``index``, its image and caption codes, and
    its manifest."""
    contents = load_contents(index)
    folder = os.path.dirname(os.path.abspath(split))
    with open(split, encoding="utf-8") as fh:
        paths = {os.path.join(folder, json.loads(line)["image"]) for line in fh if line.strip()}
    rows = [i for i, row in enumerate(contents.meta) if row["image"] in paths]
    position = {r: j for j, r in enumerate(rows)}
    keep = [t for t, (r, _) in enumerate(contents.text_rows.tolist()) if r in position]
    texts = [contents.meta[r]["captions"][c] for r, c in contents.text_rows[keep].tolist()]
    owner = np.array([position[r] for r in contents.text_rows[keep, 0].tolist()])
    image, text = np.asarray(contents.vectors[rows]), np.asarray(contents.text_vectors[keep])  # (n, D), (T, D)
    return EvalSet.of(image, text, owner, texts, "split", split), contents.codes, contents.text_codes, contents.manifest


def report(ev: EvalSet, codes: dict, what: str, entries: dict | None = None, count: int = 0) -> None:
    """Full D, float top-m and every budget's stored code (filled with ``ev``'s gallery), plain and re-scored;
    ``entries`` (the manifest's budgets of this side, by budget): also the stages the build recorded, the
    shortlist the same share of this gallery as of the index's ``count`` rows."""
    dim = ev.gallery.shape[1]
    print(f"{len(ev.gallery)} gallery rows, {len(ev.queries)} queries; {what} recall@10")
    full = recall_at_k(exact_topk(ev.gallery, ev.queries, 10), ev.positives)
    print(f"float32 full D = {dim} ({4 * dim} B): {full:.3f}")
    for m in (2, 4, 8, 16, 32):
        found = exact_topk(prefix(ev.gallery, m), prefix(ev.queries, m), 10)
        print(f"float32 top-m m = {m} ({4 * m} B): {recall_at_k(found, ev.positives):.3f}")
    for budget, codec in sorted(codes.items()):
        recall = measure(codec, ev)
        gallery = codec.empty_copy()
        gallery.add(ev.gallery)
        rescored = []
        for count in (100, 200):
            _, ids = rerank_from(ev.gallery, ev.queries, gallery.search(ev.queries, count)[1], 10)
            rescored.append(f"{recall_at_k(ids, ev.positives):.3f} ({count})")
        stage = ((entries or {}).get(budget) or {}).get("rescore")
        staged = ""
        if stage:
            share = max(10, min(len(ev.gallery), -(-stage["shortlist"] * len(ev.gallery) // max(count, 1))))
            kept = measure(codec, ev, share)
            staged = f"; as stored (codes + float top {stage['shortlist']} of {count:,}, here {share}): {kept:.3f}" \
                     f" ({kept / full:.0%} of full D)"
        print(f"{budget} B {codec.spec.label()}: {recall:.3f} ({recall / full:.0%} of full D);"
              f" re-scored with float from a shortlist of: {', '.join(rescored)}{staged}")


def main(index: str, split: str) -> None:
    ev, codes, text_codes, manifest = split_set(index, split)
    budgets = {int(b): e for b, e in (manifest.get("budgets") or {}).items()}
    print(f"# {split}: image codes, text -> image")
    report(ev, codes, "t2i", budgets, manifest["count"])
    if text_codes:
        print(f"\n# {split}: caption codes, image -> text")
        report(ev.reverse(), text_codes, "i2t", {b: e.get("text") for b, e in budgets.items()}, manifest["text_count"])


if __name__ == "__main__":
    main(*sys.argv[1:3])
