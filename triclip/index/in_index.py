"""Recall as a user of the index meets it: the validation queries searched among everything the index holds.

The curves and each budget's recall are measured with the validation images as the whole gallery: a few hundred
images, where most codes tie. The served index holds the whole collection, and its other images are distractors:
on the demo's index t2i recall@10 at full D is .618 among the 676 validation images and .416 among all 6,794.
This module measures the second, through the very rankings the index serves (``Searcher.ranked``, as
``search_vectors`` ranks: each m, each budget's codes with the stages the build chose, image -> text as distinct
caption strings):

- text -> image: a validation caption hits when one of its 10 answers carries that caption (the images trained on
  included: an image with that very caption is a right answer, as the metric counts texts);
- image -> text: a validation image hits when one of its 10 distinct caption answers is one of its own captions.

Queries whose answer the index does not hold (a caption no indexed image carries) are left out and counted.
"""

from __future__ import annotations

import numpy as np

from triclip.index.metafile import meta_rows
from triclip.index.search import DISTINCT_DEPTH, _caption_texts

K = 10  # recall@K
MAX_ROWS = 200_000  # above this many images the build does not measure it: every row's captions are read, and
# inverted lists there have their own measure at N (held_at_n)
I2T_QUERIES = 200  # validation images asked for their captions (a seeded sample beyond): a deep distinct-caption
# search re-ranks thousands of caption rows per image, ~20 ms each on the demo's caption codes


def measure(searcher, evaluation, budgets: list[int], text_budgets: list[int]) -> dict | None:
    """``{"images", "queries", "t2i": {"m": {m: r}, "bytes": {b: r}}, "i2t": {...}, "left_out"}`` for the index
    ``searcher`` serves (``triclip.index.search.Searcher``, queries given as vectors) and ``evaluation``
    (``triclip.index.budgets.EvalSet`` with its caption ``texts``); None when it cannot be measured (no texts,
    more than :data:`MAX_ROWS` images, or no query the index can answer)."""
    n = len(searcher)
    if evaluation is None or not evaluation.texts or n == 0 or n > MAX_ROWS:
        return None
    images = meta_rows(searcher.contents.meta, list(range(n)))  # read once: both halves use them
    carried = [frozenset(row.get("captions") or ()) for row in images]
    held = set().union(*carried)
    t2i = [q for q, text in enumerate(evaluation.texts) if text in held]
    if not t2i:
        return None
    texts = [evaluation.texts[q] for q in t2i]
    queries = evaluation.queries[t2i]  # (Q, D)

    def text_to_image(**how) -> float:
        rows = searcher.ranked(queries, K, **how)[1].tolist()  # (Q, K)
        return float(np.mean([any(r >= 0 and text in carried[r] for r in found) for text, found in zip(texts, rows)]))

    out = {"images": n, "queries": len(t2i), "left_out": len(evaluation.texts) - len(t2i),
           "t2i": {"m": {m: text_to_image(m=m) for m in searcher.dims},
                   "bytes": {b: text_to_image(bytes=b) for b in budgets}}}
    if searcher.has_text:
        out["i2t"] = _image_to_text(searcher, evaluation, images, held, text_budgets)
    return out


def _image_to_text(searcher, evaluation, images: list[dict], held: set[str], text_budgets: list[int]) -> dict:
    """The image -> text half of :func:`measure`: the validation images' own captions among the 10 distinct
    caption strings the index answers with."""
    own: list[set[str]] = [set() for _ in range(len(evaluation.gallery))]
    for text, rows in zip(evaluation.texts, evaluation.positives):
        for row in rows:
            own[row].add(text)
    asked = [row for row, texts in enumerate(own) if texts & held]
    if len(asked) > I2T_QUERIES:
        asked = sorted(np.random.default_rng(0).choice(asked, I2T_QUERIES, replace=False).tolist())
    strings, string_of = caption_strings(images, searcher.contents.text_rows)  # (T,) string ids
    wanted = [{strings[t] for t in own[row] if t in strings} for row in asked]
    queries = evaluation.gallery[asked]  # (Q', D)

    def image_to_text(**how) -> float:
        found = distinct_hits(lambda q, depth: searcher.ranked(queries[q], depth, target="text", **how)[1],
                              string_of, wanted)
        return float(np.mean(found))

    return {"queries": len(asked), "m": {m: image_to_text(m=m) for m in searcher.dims},
            "bytes": {b: image_to_text(bytes=b) for b in text_budgets}}


def distinct_hits(rows_of, string_of: np.ndarray, wanted: list[set[int]]) -> list[bool]:
    """Per query, whether one of its ``wanted`` strings is among the first :data:`K` distinct strings of its ranked
    caption rows (``rows_of(queries, depth)``: (Q, depth) row ids, -1 for none), searched deeper (x4) for the
    queries whose first rows hold fewer than K strings, as the served image -> text search is
    (``triclip.index.search.distinct_captions``)."""
    total = len(string_of)
    out: list[bool | None] = [None] * len(wanted)
    todo, depth = np.arange(len(wanted)), min(total, K * DISTINCT_DEPTH)
    while len(todo):
        short = []
        for q, rows in zip(todo.tolist(), rows_of(todo, depth)):
            seen: set[int] = set()
            for row in rows.tolist():
                if row < 0:
                    break
                string = int(string_of[row])
                if string in wanted[q]:
                    out[q] = True
                    break
                seen.add(string)
                if len(seen) == K:
                    out[q] = False
                    break
            if out[q] is None:
                if depth < total:
                    short.append(q)
                else:
                    out[q] = False
        todo, depth = np.asarray(short, np.int64), min(total, depth * 4)
    return [bool(hit) for hit in out]


def caption_strings(images: list[dict], text_rows: np.ndarray) -> tuple[dict[str, int], np.ndarray]:
    """Each distinct caption string's id, and the id of each caption row's string (T,); ``images``: the meta rows."""
    strings: dict[str, int] = {}
    ids = (strings.setdefault(text, len(strings)) for _, text in _caption_texts(images, text_rows))
    return strings, np.fromiter(ids, np.int64, len(text_rows))
