"""How much identical captions cap text->image recall on a validation set.

When n images share one caption text, the n queries are the same vector and get the
same top-k, so at most ``min(n, k)`` of them can find their own image: the best
possible t2i recall@k is ``sum over texts of min(n, k) / queries``. With ``--run`` it
also prints the run's t2i recall@k per group size (scored like ``triclip eval``).

    .venv/bin/python -m benchmarks.duplicate_queries --data data/openclipart/val.jsonl [--run RUN]
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Sequence

import torch

GROUPS = ((1, 1), (2, 10), (11, None))  # images sharing a caption text: unique, a few, many


def recall_ceiling(captions: Sequence[str], k: int) -> float:
    """Best possible t2i recall@k when every caption is one query (identical texts tie)."""
    if k < 1 or not captions:
        raise ValueError("need k >= 1 and at least one caption")
    counts = Counter(captions)
    return sum(min(n, k) for n in counts.values()) / len(captions)


def group_sizes(captions: Sequence[str]) -> torch.Tensor:
    """For each caption, how many captions (of any image) have the same text. Shape: (M,)."""
    counts = Counter(captions)
    return torch.tensor([counts[c] for c in captions])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--run", default=None)
    p.add_argument("-k", type=int, default=10)
    ns = p.parse_args(argv)

    from triclip.data import load_pairs

    pairs = load_pairs(ns.data)
    captions = [c for r in pairs.records for c in r.captions]
    print(f"{len(pairs.records)} images, {len(captions)} caption queries, {len(set(captions))} distinct texts")
    for text, n in Counter(captions).most_common(5):
        print(f"  {n:5d} x {text[:70]!r}")
    print(f"best possible t2i recall@{ns.k}: {recall_ceiling(captions, ns.k):.3f}")
    if ns.run is None:
        return 0

    from triclip.compact.metrics import retrieval_ranks
    from triclip.training import checkpoint as ckpt
    from triclip.model.embed import embed_pairs
    from triclip.training.evaluate import model_score_embeddings

    model, _ = ckpt.load_run(ns.run)
    image, text, owner, keep, _ = embed_pairs(model, pairs, "cpu")
    image, text = model_score_embeddings(image, text, model.importance().detach())
    _, ranks = retrieval_ranks(image, text, owner)  # (M,)
    sizes = group_sizes([c for i in keep.tolist() for c in pairs.records[i].captions])
    print(f"{ns.run}: t2i recall@{ns.k} {(ranks < ns.k).double().mean():.3f}")
    for lo, hi in GROUPS:
        sel = (sizes >= lo) & (sizes <= (hi or sizes.max()))
        if sel.any():
            name = f"{lo}" if lo == hi else f"{lo}-{hi}" if hi else f">={lo}"
            print(f"  text shared by {name} images: {int(sel.sum())} queries, recall@{ns.k} {(ranks[sel] < ns.k).double().mean():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
