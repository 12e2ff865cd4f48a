"""Retrieval metrics (docs/CONTRACT.md, "Metrics"), computed in query chunks.

Only a ``(chunk_size, gallery)`` block of similarities exists at a time, so a
100k x 100k evaluation never holds the full matrix. Scores are inner products of
the given embeddings (cosine for L2-normalised ones), in float32 (float64 stays
float64). Ties are resolved conservatively: a wrong item scoring exactly as high as
the right one ranks ahead of it, so duplicates never inflate a metric.

- Recall@k both directions with several captions per image (CLIP, Radford et al. 2021,
  https://arxiv.org/abs/2103.00020, as in clip-retrieval / open_clip's evaluation), over
  distinct caption texts when the texts are given (docs/CONTRACT.md "Metrics": a repeated title is one
  query with every image carrying it relevant, so duplicates neither reward nor punish).
- Class-level mean average precision.
- Zero-shot classification accuracy.
- ``align`` / ``uniform`` of Wang & Isola 2020, https://arxiv.org/abs/2005.10242.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from triclip.core.progress import progress as progress_bar

CHUNK = 256  # default rows of queries scored at once


def _check_emb(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating (n, dim) tensor, got {got}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} is empty")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} has non-finite values")


def _pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked embeddings of the same width, as float32 (float64 kept) on ``a``'s device."""
    _check_emb(name_a, a)
    _check_emb(name_b, b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{name_a} and {name_b} differ in width: {a.shape[1]} vs {b.shape[1]}")
    dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    return a.to(dtype), b.to(device=a.device, dtype=dtype)


def _index(name: str, idx: torch.Tensor | Sequence[int], length: int, upper: int, device) -> torch.Tensor:
    """Checked integer vector of ``length`` values in [0, upper)."""
    idx = torch.as_tensor(idx, device=device)
    if idx.shape != (length,) or idx.is_floating_point() or idx.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer vector of length {length}, got {idx.dtype} {tuple(idx.shape)}")
    if length and (int(idx.min()) < 0 or int(idx.max()) >= upper):
        raise ValueError(f"{name} values must be in [0, {upper})")
    return idx.long()


def _chunks(n: int, chunk_size: int, desc: str, progress: bool) -> Iterator[slice]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    starts = range(0, n, chunk_size)
    for start in progress_bar(starts, desc=desc, disable=not progress, leave=False):
        yield slice(start, min(start + chunk_size, n))


# ---------------------------------------------------------------------------- recall@k


def first_captions(text_to_image: torch.Tensor, num_images: int | None = None) -> torch.Tensor:
    """Row of each image's first caption, for text rows grouped by image in image order. Shape: (T,) -> (N,).

    ``num_images`` counts images past the last caption's (their rows point past their predecessor's
    captions, like an image with none). Example: ``[0, 0, 1, 2, 2]`` -> ``[0, 2, 3]``.
    """
    counts = torch.bincount(text_to_image, minlength=num_images or 0)  # (N,) captions per image
    return torch.cat([torch.zeros(1, dtype=torch.long, device=counts.device), counts.cumsum(0)[:-1]])


def distinct_texts(texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Group captions by exact text.

    Args:
        texts: one string per caption row. Length: M.

    Returns:
        ``(text_id (M,), first_row (U,))``: the distinct text of each caption (numbered in order
        of first appearance) and the first caption row carrying each distinct text.
    """
    ids: dict[str, int] = {}
    text_id = torch.tensor([ids.setdefault(t, len(ids)) for t in texts], dtype=torch.long)
    first_row = torch.full((len(ids),), len(text_id), dtype=torch.long).scatter_reduce(
        0, text_id, torch.arange(len(text_id)), reduce="amin"
    )
    return text_id, first_row


def best_positive_ranks(
    query: torch.Tensor,
    gallery: torch.Tensor,
    pair_query: torch.Tensor,
    pair_gallery: torch.Tensor,
    chunk_size: int = CHUNK,
    desc: str = "ranks",
    progress: bool = False,
) -> torch.Tensor:
    """0-based rank of each query's best-scoring relevant gallery item.

    The rank is the number of irrelevant gallery items scoring at least as high as the best
    relevant one (ties count against the query), so "some relevant item in the top k" is
    ``rank < k``; ``-1`` for a query without a relevant item.

    Args:
        query: query embeddings. Shape: (Q, D).
        gallery: gallery embeddings. Shape: (G, D).
        pair_query: query row of each (query, relevant gallery item) pair. Shape: (P,).
        pair_gallery: gallery row of each pair. Shape: (P,).
        chunk_size: queries scored at once.
        desc: progress label.
        progress: show progress over chunks.

    Returns:
        Long tensor (Q,).
    """
    order = torch.argsort(pair_query, stable=True)
    pq, pg = pair_query[order].to(query.device), pair_gallery[order].to(query.device)  # pairs sorted by query
    ranks = torch.full((query.shape[0],), -1, dtype=torch.long, device=query.device)
    for part in _chunks(query.shape[0], chunk_size, desc, progress):
        scores = query[part] @ gallery.t()  # (c, G)
        lo, hi = torch.searchsorted(pq, torch.tensor([part.start, part.stop], device=pq.device)).tolist()
        positive = torch.zeros_like(scores, dtype=torch.bool)  # (c, G)
        positive[pq[lo:hi] - part.start, pg[lo:hi]] = True
        best = scores.masked_fill(~positive, -math.inf).amax(dim=1, keepdim=True)  # (c, 1)
        ahead = ((scores >= best) & ~positive).sum(dim=1)  # (c,)
        ranks[part] = torch.where(positive.any(dim=1), ahead, torch.full_like(ahead, -1))
    return ranks


def retrieval_ranks(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    text_to_image: torch.Tensor | Sequence[int],
    chunk_size: int = CHUNK,
    progress: bool = False,
    texts: Sequence[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based rank of the right answer for every query, both directions.

    Without ``texts`` every caption row is its own text (per-caption ranks). Image->text: the
    rank of the image's best-scoring caption, i.e. the number of other images' captions
    scoring at least as high (so "any caption within top-k" is ``rank < k``); ``-1`` for an
    image without captions (a distractor, not a query). Text->image: the number of other
    images scoring at least as high as its own.

    With ``texts`` (docs/CONTRACT.md "Metrics": over distinct texts) captions with the same exact text
    are one text: each distinct text is one text->image query, every image carrying it is
    relevant; image->text searches the distinct texts, a hit being any of the image's own.
    Equal to the per-caption ranks when every caption is unique.

    Args:
        image_emb: image embeddings. Shape: (N, D).
        text_emb: caption embeddings. Shape: (M, D).
        text_to_image: row of each caption's image. Shape: (M,).
        chunk_size: queries scored at once.
        progress: show progress over chunks.
        texts: the caption strings, one per row of ``text_emb`` (None: all distinct).

    Returns:
        ``(i2t_rank (N,), t2i_rank (U,))`` as long tensors; U = number of distinct texts (M without ``texts``).
    """
    image, text = _pair("image_emb", image_emb, "text_emb", text_emb)
    owner = _index("text_to_image", text_to_image, text.shape[0], image.shape[0], image.device)
    if texts is None:
        text_id = torch.arange(text.shape[0], device=image.device)
    else:
        if len(texts) != text.shape[0]:
            raise ValueError(f"texts must give one string per caption row: {len(texts)} for {text.shape[0]} rows")
        text_id, first_row = distinct_texts(texts)
        text_id, text = text_id.to(image.device), text[first_row.to(image.device)]  # (U, D) one row per text
    pairs = torch.unique(torch.stack([owner, text_id]), dim=1)  # (2, P) distinct (image, text) pairs
    i2t = best_positive_ranks(image, text, pairs[0], pairs[1], chunk_size, "recall i2t", progress)
    t2i = best_positive_ranks(text, image, pairs[1], pairs[0], chunk_size, "recall t2i", progress)
    return i2t, t2i


def retrieval_recall(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    text_to_image: torch.Tensor | Sequence[int],
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = CHUNK,
    progress: bool = False,
    texts: Sequence[str] | None = None,
) -> dict[str, float]:
    """Recall@k image->text and text->image, several captions per image.

    Image->text is correct when any of the image's captions is in the top k; text->image
    when its own image is (with ``texts``: any image carrying that exact text is; each
    distinct text is one query and the gallery holds each distinct text once: docs/CONTRACT.md
    "Metrics"). Images without captions only act as distractors. Ties count against the
    query (see :func:`retrieval_ranks`).

    Args:
        image_emb: image embeddings. Shape: (N, D).
        text_emb: caption embeddings. Shape: (M, D).
        text_to_image: row of each caption's image. Shape: (M,).
        ks: the cut-offs.
        chunk_size: queries scored at once.
        progress: show progress over chunks.
        texts: caption strings, one per row of ``text_emb``: recall over distinct texts
            (None: every caption counts as its own text, per-caption recall).

    Returns:
        ``{"i2t_r1": .., "i2t_r5": .., ..., "t2i_r10": ..}``: fractions in [0, 1].
    """
    if not ks or any(int(k) != k or k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks!r}")
    i2t, t2i = retrieval_ranks(image_emb, text_emb, text_to_image, chunk_size, progress, texts)
    i2t = i2t[i2t >= 0]
    if i2t.numel() == 0:
        raise ValueError("no image has a caption: image->text recall is undefined")
    out = {f"i2t_r{k}": float((i2t < k).double().mean()) for k in ks}
    out.update({f"t2i_r{k}": float((t2i < k).double().mean()) for k in ks})
    return out


# ---------------------------------------------------------------------------- align / uniform


def _log_mean_exp_distinct(z: torch.Tensor, t: float, chunk_size: int, progress: bool) -> float:
    """``log mean_{i != j} exp(-t ||z_i - z_j||^2)`` accumulated over row chunks in log space."""
    n = z.shape[0]
    sq_norm = z.square().sum(dim=1)  # (n,)
    total = torch.tensor(-math.inf, dtype=z.dtype, device=z.device)
    for part in _chunks(n, chunk_size, "uniformity", progress):
        sq = (sq_norm[part].unsqueeze(1) + sq_norm.unsqueeze(0) - 2.0 * (z[part] @ z.t())).clamp_min(0.0)  # (c, n)
        rows = torch.arange(part.start, part.stop, device=z.device)
        scores = (-t * sq).scatter(1, rows.unsqueeze(1), -math.inf)  # drop i == j
        total = torch.logaddexp(total, torch.logsumexp(scores.reshape(-1), dim=0))
    return float(total) - math.log(n * (n - 1))


def align_uniform(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    alpha: float = 2.0,
    t: float = 2.0,
    chunk_size: int = CHUNK,
    progress: bool = False,
) -> dict[str, float]:
    """Alignment and uniformity (Wang & Isola 2020) of held-out pairs.

    ``align = mean_i ||I_i - T_i||^alpha``; ``uniform`` = the average over the two towers
    of ``log mean_{i != j} exp(-t ||z_i - z_j||^2)`` (lower is more uniform), the same
    quantity as the ``align_uniform`` loss's terms. Pass one caption per image: a repeated
    image would count as a pair at distance 0.

    Args:
        image_emb: image embeddings. Shape: (N, D).
        text_emb: text embeddings, row i paired with image i. Shape: (N, D).
        alpha: exponent of the alignment distance.
        t: temperature of the uniformity kernel.
        chunk_size: rows scored at once.
        progress: show progress over chunks.

    Returns:
        ``{"align": float, "uniform": float}``.
    """
    image, text = _pair("image_emb", image_emb, "text_emb", text_emb)
    if image.shape[0] != text.shape[0]:
        raise ValueError(f"align needs paired rows, got {image.shape[0]} images and {text.shape[0]} texts")
    if image.shape[0] < 2:
        raise ValueError("uniform needs at least 2 pairs")
    if alpha <= 0 or t <= 0:
        raise ValueError(f"alpha and t must be > 0, got {alpha} and {t}")
    align = (image - text).norm(dim=1).pow(alpha).mean()
    uniform = 0.5 * sum(_log_mean_exp_distinct(z, t, chunk_size, progress) for z in (image, text))
    return {"align": float(align), "uniform": float(uniform)}


# ---------------------------------------------------------------------------- labels


def _label_ids(query_labels, gallery_labels, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as comparable long tensors: integer tensors as given, other sequences mapped to ids."""
    if isinstance(query_labels, torch.Tensor) and isinstance(gallery_labels, torch.Tensor):
        return query_labels.to(device).long(), gallery_labels.to(device).long()
    ids: dict[object, int] = {}

    def encode(labels) -> torch.Tensor:
        return torch.tensor([ids.setdefault(label, len(ids)) for label in labels], dtype=torch.long, device=device)

    return encode(list(query_labels)), encode(list(gallery_labels))


def class_map(
    query_emb: torch.Tensor,
    gallery_emb: torch.Tensor,
    query_labels: torch.Tensor | Sequence,
    gallery_labels: torch.Tensor | Sequence,
    exclude_self: bool = False,
    chunk_size: int = CHUNK,
    progress: bool = False,
) -> float:
    """Class-level mean average precision: gallery items of the query's label are relevant.

    AP of a query = mean over its relevant items of the precision at that item's rank,
    gallery sorted by score, ties ordered irrelevant-first (conservative). Queries with
    no relevant item are left out of the mean.

    Args:
        query_emb: query embeddings. Shape: (Q, D).
        gallery_emb: gallery embeddings. Shape: (G, D).
        query_labels: a label per query (integer tensor, or any hashable values). Shape: (Q,).
        gallery_labels: a label per gallery item. Shape: (G,).
        exclude_self: query i and gallery item i are the same sample: leave it out (needs Q == G).
        chunk_size: queries scored at once.
        progress: show progress over chunks.

    Returns:
        mAP in [0, 1].
    """
    query, gallery = _pair("query_emb", query_emb, "gallery_emb", gallery_emb)
    q_lab, g_lab = _label_ids(query_labels, gallery_labels, query.device)
    if q_lab.shape != (query.shape[0],) or g_lab.shape != (gallery.shape[0],):
        raise ValueError(
            f"need one label per row: {tuple(q_lab.shape)} labels for {query.shape[0]} queries, "
            f"{tuple(g_lab.shape)} for {gallery.shape[0]} gallery items"
        )
    if exclude_self and query.shape[0] != gallery.shape[0]:
        raise ValueError("exclude_self needs as many queries as gallery items")
    ap_sum, counted = 0.0, 0
    for part in _chunks(query.shape[0], chunk_size, "mAP", progress):
        scores = query[part] @ gallery.t()  # (c, G)
        relevant = q_lab[part].unsqueeze(1) == g_lab.unsqueeze(0)  # (c, G)
        if exclude_self:
            rows = torch.arange(part.start, part.stop, device=query.device).unsqueeze(1)
            scores = scores.scatter(1, rows, -math.inf)  # self goes last ...
            relevant = relevant.scatter(1, rows, False)  # ... as irrelevant: no effect on AP
        by_relevance = torch.argsort(relevant.to(torch.uint8), dim=1, stable=True)  # irrelevant first
        order = torch.argsort(scores.gather(1, by_relevance), dim=1, descending=True, stable=True)
        hits = relevant.gather(1, by_relevance).gather(1, order).double()  # (c, G) in rank order
        n_rel = hits.sum(dim=1)  # (c,)
        ranks = torch.arange(1, gallery.shape[0] + 1, dtype=torch.float64, device=query.device)
        precision_sum = (hits.cumsum(dim=1) / ranks * hits).sum(dim=1)  # (c,)
        has = n_rel > 0
        ap_sum += float((precision_sum[has] / n_rel[has]).sum())
        counted += int(has.sum())
    if counted == 0:
        raise ValueError("no query has a relevant gallery item: mAP is undefined")
    return ap_sum / counted


# ---------------------------------------------------------------------------- zero-shot


def zero_shot_accuracy(
    image_emb: torch.Tensor,
    class_emb: torch.Tensor,
    labels: torch.Tensor | Sequence[int],
    k: int = 1,
    chunk_size: int = CHUNK,
    progress: bool = False,
) -> float:
    """Zero-shot top-k accuracy: an image is right when its class is among the k best-scoring.

    Args:
        image_emb: image embeddings. Shape: (N, D).
        class_emb: one text embedding per class (e.g. the normalised mean over prompt templates). Shape: (C, D).
        labels: class row of each image. Shape: (N,).
        k: top-k (1 for accuracy). A tie with another class counts as wrong.
        chunk_size: images scored at once.
        progress: show progress over chunks.

    Returns:
        Accuracy in [0, 1].
    """
    image, classes = _pair("image_emb", image_emb, "class_emb", class_emb)
    target = _index("labels", labels, image.shape[0], classes.shape[0], image.device)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    correct = 0
    for part in _chunks(image.shape[0], chunk_size, "zero-shot", progress):
        scores = image[part] @ classes.t()  # (c, C)
        own = scores.gather(1, target[part].unsqueeze(1))  # (c, 1)
        correct += int(((scores >= own).sum(dim=1) - 1 < k).sum())
    return correct / image.shape[0]
