"""``index build --bytes 8,16,32``: for each budget, the code that retrieves best, measured; torch-free.

For each budget B (bytes per vector, codes only) every codec and m that fits
(``triclip.index.codecs.candidates``) is fitted on the collection's vectors (a sample of at most
``FIT_ROWS``), then measured on an evaluation set: the validation split's served vectors
(``--val-data``), else the indexed data's first images. The image codes are measured by
text->image recall@10 over distinct caption texts (a text's positives are every image
carrying it); the caption codes, when the index holds captions, by image->text recall@10
over the same distinct texts (:meth:`EvalSet.reverse`). Either is searched through the
code itself (float queries against the codes; binary codes binarise the query, as their
users do). The best code is kept (``--codec`` forces the codec, the best m of it is kept);
the very codec that was measured is filled with the collection and stored, so the recall
the manifest records is the measured recall of the codes actually stored. Every
candidate's recall goes to ``curves.json`` (``bytes``; ``text_bytes`` for the captions),
beside float pruning (the index ordering's curve at 4m bytes): the frontier the app draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from triclip.index import codecs
from triclip.core.errors import UserError
from triclip.core.progress import progress

FIT_ROWS = 20_000  # collection vectors a code is fitted on (a seeded sample beyond)
EVAL_MAX_IMAGES = 5000  # without --val-data: the indexed data's first this many images
K = 10  # recall@K


@dataclass
class EvalSet:
    """Served vectors to measure a code on: a gallery, queries and each query's positives.

    As :meth:`of` makes it, the gallery is images and the queries distinct caption texts
    (text->image); :meth:`reverse` swaps them (image->text, for the caption codes).
    """

    gallery: np.ndarray  # (n, D) float32 full-D compact vectors searched (images; texts when reversed)
    queries: np.ndarray  # (Q, D) float32: one vector per distinct caption text (per image when reversed)
    positives: list[set[int]]  # per query: the gallery rows that answer it
    split: str  # "validation" (--val-data) or "indexed" (the indexed data's first images)
    data: str  # where it came from
    metric: str = "t2i_r10"  # what recall@10 measures: t2i_r10 (image codes) or i2t_r10 (caption codes)

    @classmethod
    def of(cls, image: np.ndarray, text: np.ndarray, owner: np.ndarray, texts: list[str], split: str, data: str):
        """From caption vectors (T, D), their image rows ``owner`` (T,) and strings ``texts`` (T)."""
        first: dict[str, int] = {}
        positives: dict[str, set[int]] = {}
        for t, (caption, row) in enumerate(zip(texts, np.asarray(owner).tolist())):
            first.setdefault(caption, t)
            positives.setdefault(caption, set()).add(int(row))
        rows = list(first.values())
        queries = np.ascontiguousarray(np.asarray(text, np.float32)[rows])
        return cls(np.ascontiguousarray(image, dtype=np.float32), queries, [positives[c] for c in first], split, data)

    def reverse(self) -> "EvalSet":
        """Image -> text over the same distinct texts: an image's positives are the texts it carries.
        Images carrying none of them are left out (they have no answer)."""
        answers: list[set[int]] = [set() for _ in range(len(self.gallery))]
        for text, rows in enumerate(self.positives):
            for row in rows:
                answers[row].add(text)
        keep = [row for row, texts in enumerate(answers) if texts]
        metric = "i2t_r10" if self.metric == "t2i_r10" else "t2i_r10"
        return EvalSet(self.queries, np.ascontiguousarray(self.gallery[keep]), [answers[r] for r in keep], self.split,
                       self.data, metric)


def recall_at_k(ids: np.ndarray, positives: list[set[int]], k: int = K) -> float:
    """Share of queries with a positive among their first k ids. ids: (Q, >= k), -1 for none."""
    hits = [bool(positives[q] & set(row[:k].tolist())) for q, row in enumerate(np.asarray(ids))]
    return float(np.mean(hits)) if hits else 0.0


def measure(codec: codecs.Codec, evaluation: EvalSet) -> float:
    """Recall@10 of ``codec``'s trained code on the evaluation set (a copy holding its gallery)."""
    gallery = codec.empty_copy()
    gallery.add(evaluation.gallery)
    _, ids = gallery.search(evaluation.queries, K)
    return recall_at_k(ids, evaluation.positives)


@dataclass
class Choice:
    """The code kept for one budget, and what every candidate measured."""

    budget: int
    codec: codecs.Codec  # fitted, holding no vectors
    recall: float  # measured on the evaluation set, by this very codec
    tried: list[dict]  # {"label", "codec", "m", "bytes", "recall"} per candidate, in the order tried


def choose(budget: int, train: np.ndarray, evaluation: EvalSet, force: str | None = None, seed: int = 0) -> Choice:
    """Fit every candidate code of ``budget`` bytes on ``train`` (N, D), measure each, keep the best.

    ``force``: only that codec's candidates. Ties go to the fewer bytes, then to the earlier candidate.
    """
    dim = train.shape[1]
    specs = codecs.candidates(budget, dim)
    specs = worth_trying(specs, budget, len(train)) if force is None else [s for s in specs if s.codec == force]
    if not specs:
        raise UserError(f"--codec {force} has no code that fits {budget} bytes per vector at D={dim}")
    sample = _sample(train, seed)
    best, tried = None, []
    for spec in progress(specs, desc=f"codes of {budget} B", unit="code", disable=None):
        try:
            codec = codecs.fit(spec, sample)
        except UserError as err:  # e.g. too few vectors for this code: it is not a candidate here
            tried.append({"label": spec.label(), "codec": spec.codec, "m": spec.m, "bytes": spec.bytes_per_vector,
                          "recall": None, "error": str(err)})
            continue
        recall = measure(codec, evaluation)
        fitted = codec.spec
        tried.append({"label": fitted.label(), "codec": fitted.codec, "m": fitted.m, "bytes": fitted.bytes_per_vector,
                      "recall": recall})
        if best is None or (recall, -fitted.bytes_per_vector) > (best[1], -best[0].spec.bytes_per_vector):
            best = (codec, recall)
    if best is None:
        raise UserError(f"no code of {budget} bytes per vector could be fitted: {tried[-1]['error']}")
    return Choice(budget, best[0], best[1], tried)


NEVER_BEST_BELOW = {  # codec -> the budget (bytes per vector) below which it never measured best: not fitted there
    # docs/results_bytes.md, 8-32 B on openclipart, Tux Paint and fashion-mnist (3 seeds each): plain PQ below OPQ
    # (its rotated form, also a candidate) at every budget and data set, at both of its m's
    "pq": 64,
}
RQ_OVER_OPQ_ROWS = 5000  # fitted on at least this many vectors, RQ measured above OPQ at 4, 8 and 16 B (openclipart,
# 5,443 train vectors, every seed; on Tux Paint's 627 OPQ won): where RQ is a candidate, OPQ (the slowest fit,
# about 2x RQ's CPU time at 8 and 16 B) is not fitted


def worth_trying(specs: list[codecs.CodecSpec], budget: int, rows: int) -> list[codecs.CodecSpec]:
    """The candidates of ``budget`` that the evidence leaves a chance of measuring best, for a code fitted on
    ``rows`` vectors (:data:`NEVER_BEST_BELOW`, :data:`RQ_OVER_OPQ_ROWS`); the cheap ones stay whatever they
    measured, as the frontier's peers. ``--codec`` bypasses this."""
    kept = [s for s in specs if budget >= NEVER_BEST_BELOW.get(s.codec, 0)]
    if rows >= RQ_OVER_OPQ_ROWS and any(s.codec == "rq" for s in kept):
        kept = [s for s in kept if s.codec != "opq"]
    return kept


def _sample(train: np.ndarray, seed: int) -> np.ndarray:
    """At most ``FIT_ROWS`` rows of ``train`` (N, D), drawn by ``seed``, float32."""
    if len(train) <= FIT_ROWS:
        return np.ascontiguousarray(train, dtype=np.float32)
    rows = np.sort(np.random.default_rng(seed).choice(len(train), size=FIT_ROWS, replace=False))
    return np.ascontiguousarray(train[rows], dtype=np.float32)


def choose_all(budgets: list[int], vectors, evaluation: EvalSet, force: str | None = None,
               seed: int = 0) -> list[Choice]:
    """:func:`choose` for every budget, fitted on a sample of ``vectors`` (``triclip.index.vectors.ShardVectors``: the
    image rows, or the caption rows with a reversed ``evaluation``)."""
    rows = np.arange(vectors.count)
    if len(rows) > FIT_ROWS:
        rows = np.sort(np.random.default_rng(seed).choice(vectors.count, size=FIT_ROWS, replace=False))
    train = vectors.rows(rows, vectors.dim)  # (n, D) unit rows, as stored
    return [choose(b, train, evaluation, force, seed) for b in budgets]


def fill(codec: codecs.Codec, vectors) -> codecs.Codec:
    """A copy of the trained ``codec`` holding every row of ``vectors`` (shards), in order."""
    full = codec.empty_copy()
    for part in vectors.parts:
        if len(part):
            full.add(np.asarray(part, np.float32))
    return full


def indexed_evaluation(image, text, text_rows: np.ndarray, meta: list[dict], max_images: int, data: str) -> EvalSet:
    """The evaluation set from the indexed collection itself: its first ``max_images`` images and their captions."""
    n = min(image.count, max_images)
    keep = np.flatnonzero(text_rows[:, 0] < n)  # caption vectors of those images
    texts = [meta[int(r)]["captions"][int(c)] for r, c in text_rows[keep]]
    return EvalSet.of(image.rows(np.arange(n), image.dim), text.rows(keep, text.dim), text_rows[keep, 0], texts,
                      "indexed", data)


def manifest_entry(choice: Choice, stored: codecs.Codec, evaluation: EvalSet, file: str) -> dict:
    """The manifest's ``budgets[str(B)]``: the stored code, its measured recall and its size."""
    size = stored.spec.bytes_per_vector * len(stored)  # the codes (FAISS's files add a header)
    return {"spec": stored.spec.to_json(), "file": file, "recall": choice.recall, "split": evaluation.split,
            "index_bytes": int(size), "bytes_per_vector": stored.spec.bytes_per_vector}


def parse_budgets(values) -> list[int]:
    """``--bytes`` values as sorted unique positive ints."""
    budgets = sorted(set(int(b) for b in ([values] if isinstance(values, int) else values)))
    if not budgets or budgets[0] < 1:
        raise UserError(f"--bytes must be positive integers (bytes per vector), got {values}")
    return budgets


def frontier(choices: list[Choice], float_curve: dict[str, float] | None, evaluation: EvalSet) -> dict:
    """The ``bytes`` entry of ``curves.json`` (``text_bytes`` for the caption codes): recall against bytes
    per vector for the kept codes, every candidate (the peers: int8, binary, PQ, OPQ, RQ, float top-m) and
    float pruning (4m bytes per m; the t2i curve, so the image codes only)."""
    return {
        "metric": evaluation.metric,
        "split": evaluation.split,
        "data": evaluation.data,
        "gallery": int(len(evaluation.gallery)),
        "queries": int(len(evaluation.queries)),
        "chosen": {str(c.budget): {**_entry(c.codec.spec), "recall": c.recall} for c in choices},
        "candidates": {str(c.budget): c.tried for c in choices},
        "float_pruning": {str(4 * int(m)): r for m, r in (float_curve or {}).items() if r is not None},
        "full_d": exact_recall(evaluation),  # the same metric by exact float search at full D: what the codes lose
    }


def exact_recall(evaluation: EvalSet) -> float:
    """Recall@10 of exact inner-product search at full D on the evaluation set (the codes' reference)."""
    scores = evaluation.queries @ evaluation.gallery.T  # (Q, n)
    k = min(K, scores.shape[1])
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (Q, k)
    return recall_at_k(top, evaluation.positives)


def _entry(spec: codecs.CodecSpec) -> dict:
    return {"label": spec.label(), "codec": spec.codec, "m": spec.m, "bytes": spec.bytes_per_vector}


def table(budgets: dict) -> str:
    """The lines ``index build`` prints: bytes / codes / code / m / recall / index size per budget and side
    (summary["budgets"]; the caption codes under ``"text"``)."""
    lines = [f"{'bytes':>6}  {'codes':<6} {'code':<20} {'m':>5}  {'recall@10':>9}  {'index size':>11}  stored"]
    for b, entry in sorted(budgets.items(), key=lambda kv: int(kv[0])):
        for side, e in (("image", entry), ("text", entry.get("text"))):
            if e is None:
                continue
            spec = codecs.CodecSpec.from_json(e["code"])
            recall = "-" if e.get("recall") is None else f"{e['recall']:.4f}"
            lines.append(f"{b:>6}  {side:<6} {spec.label():<20} {spec.m:>5}  {recall:>9}"
                         f"  {human_bytes(e['index_bytes']):>11}  {spec.bytes_per_vector} B/vector")
    if any(entry.get("text") for entry in budgets.values()):
        lines.append("recall@10: text->image for the image codes, image->text for the caption (text) codes")
    lines.append("stored: the bytes each vector's code holds (a code smaller than its budget can measure best)")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KB`` (powers of 1024)."""
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
