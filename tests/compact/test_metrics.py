"""Chunked metrics against plain dense references, hand-checked cases and tie rules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from triclip.compact.metrics import (
    align_uniform,
    class_map,
    distinct_texts,
    retrieval_ranks,
    retrieval_recall,
    zero_shot_accuracy,
)


def _unit(n: int, d: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def _captioned(n_images: int = 40, per_image: int = 3, d: int = 8, seed: int = 0):
    """Images and several noisy captions each (rows shuffled), plus a caption-less distractor."""
    image = _unit(n_images, d, seed)
    shuffle = torch.randperm((n_images - 1) * per_image, generator=torch.Generator().manual_seed(seed))
    owner = torch.arange(n_images - 1).repeat_interleave(per_image)[shuffle]
    text = F.normalize(image[owner] + 1.5 * _unit(len(owner), d, seed + 1), dim=1)
    return image, text, owner


# ---------------------------------------------------------------------------- dense references


def dense_recall(image, text, owner, ks):
    """Full similarity matrix, one query at a time, ties against the query."""
    sim = (image @ text.t()).tolist()
    owner = owner.tolist()
    i2t, t2i = [], []
    for n, row in enumerate(sim):
        mine = [c for c, o in enumerate(owner) if o == n]
        if not mine:
            continue
        best = max(row[c] for c in mine)
        i2t.append(sum(1 for c, o in enumerate(owner) if o != n and row[c] >= best))
    for c, o in enumerate(owner):
        col = [sim[n][c] for n in range(len(sim))]
        t2i.append(sum(1 for n in range(len(sim)) if n != o and col[n] >= col[o]))
    out = {f"i2t_r{k}": sum(r < k for r in i2t) / len(i2t) for k in ks}
    out.update({f"t2i_r{k}": sum(r < k for r in t2i) / len(t2i) for k in ks})
    return out


def dense_average_precision(scores: list[float], relevant: list[bool]) -> float:
    """AP of one ranked list; equal scores put irrelevant items first."""
    order = sorted(range(len(scores)), key=lambda g: (-scores[g], relevant[g]))
    hits, total = 0, 0.0
    for rank, g in enumerate(order, start=1):
        if relevant[g]:
            hits += 1
            total += hits / rank
    return total / hits


def dense_map(query, gallery, q_lab, g_lab, exclude_self=False):
    sim = (query @ gallery.t()).tolist()
    aps = []
    for q, row in enumerate(sim):
        keep = [g for g in range(len(row)) if not (exclude_self and g == q)]
        rel = [g_lab[g] == q_lab[q] for g in keep]
        if any(rel):
            aps.append(dense_average_precision([row[g] for g in keep], rel))
    return sum(aps) / len(aps)


def dense_align_uniform(image, text, alpha, t):
    align = sum(float(torch.linalg.norm(a - b)) ** alpha for a, b in zip(image, text)) / len(image)
    unif = 0.0
    for z in (image.double(), text.double()):
        pairs = [(i, j) for i in range(len(z)) for j in range(len(z)) if i != j]
        values = [math.exp(-t * float(torch.linalg.norm(z[i] - z[j])) ** 2) for i, j in pairs]
        unif += 0.5 * math.log(sum(values) / len(values))
    return {"align": align, "uniform": unif}


# ---------------------------------------------------------------------------- recall


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_chunked_recall_equals_dense_reference(chunk):
    image, text, owner = _captioned()
    got = retrieval_recall(image, text, owner, ks=(1, 5, 10), chunk_size=chunk)
    want = dense_recall(image, text, owner, (1, 5, 10))
    assert got.keys() == want.keys() == {"i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10"}
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key
    assert 0 < got["t2i_r1"] < got["t2i_r10"] < 1  # not a trivial case


def test_recall_hand_example_any_caption_counts():
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    # captions: 0 -> image 0 (far), 1 -> image 0 (close), 2 -> image 1, 3 -> image 2
    text = F.normalize(torch.tensor([[-1.0, 0.1], [1.0, 0.05], [0.2, 1.0], [0.0, 1.0]]), dim=1)
    owner = torch.tensor([0, 0, 1, 2])
    i2t, t2i = retrieval_ranks(image, text, owner)
    assert i2t.tolist() == [0, 1, 1]  # image 0: its 2nd caption is first; image 1: caption 3 beats its own
    assert t2i.tolist() == [2, 0, 0, 1]
    r = retrieval_recall(image, text, owner, ks=(1, 2))
    assert r == {"i2t_r1": 1 / 3, "i2t_r2": 1.0, "t2i_r1": 2 / 4, "t2i_r2": 3 / 4}


def test_recall_ties_count_against_the_query():
    image = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # images 0 and 1 are duplicates
    text = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    i2t, t2i = retrieval_ranks(image, text, torch.tensor([0, 1, 2]))
    assert i2t.tolist() == [1, 1, 0] and t2i.tolist() == [1, 1, 0]


def test_image_without_caption_is_only_a_distractor():
    image, text, owner = _captioned(n_images=6, per_image=2)
    i2t, _ = retrieval_ranks(image, text, owner)
    assert i2t[-1] == -1 and (i2t[:-1] >= 0).all()


# ---------------------------------------------------------------------------- recall over distinct texts


def naive_distinct_recall(image, text, owner, texts, ks):
    """docs/CONTRACT.md "Metrics" read literally, one query at a time with Python lists.

    t2i: each distinct text once (embedded as its first caption row), relevant = every image
    with a caption of exactly that text; i2t: the gallery holds each distinct text once, a hit
    is any text among the image's own captions. Ties count against the query.
    """
    distinct = list(dict.fromkeys(texts))
    emb = {t: text[texts.index(t)] for t in distinct}
    carriers = {t: {int(owner[c]) for c in range(len(texts)) if texts[c] == t} for t in distinct}
    t2i = []
    for t in distinct:
        scores = [float(emb[t] @ image[n]) for n in range(len(image))]
        best = max(scores[n] for n in carriers[t])
        t2i.append(sum(1 for n in range(len(image)) if n not in carriers[t] and scores[n] >= best))
    i2t = []
    for n in range(len(image)):
        own = {t for t in distinct if n in carriers[t]}
        if not own:
            continue
        scores = {t: float(image[n] @ emb[t]) for t in distinct}
        best = max(scores[t] for t in own)
        i2t.append(sum(1 for t in distinct if t not in own and scores[t] >= best))
    out = {f"i2t_r{k}": sum(r < k for r in i2t) / len(i2t) for k in ks}
    out.update({f"t2i_r{k}": sum(r < k for r in t2i) / len(t2i) for k in ks})
    return out


def _with_duplicates(seed: int = 0):
    """Captions drawn from a small vocabulary (many repeats, some within one image), identical
    texts with identical embeddings, a caption-less distractor image."""
    g = torch.Generator().manual_seed(seed)
    image = _unit(30, 6, seed)
    vocab = [f"title {v}" for v in range(12)]
    vocab_emb = _unit(12, 6, seed + 1)
    owner = torch.arange(29).repeat_interleave(2)[torch.randperm(58, generator=g)]
    words = torch.randint(0, 12, (58,), generator=g)
    texts = [vocab[int(v)] for v in words]
    text = F.normalize(vocab_emb[words] + 0.3 * image[owner], dim=1)  # not the same: rows of one text differ
    return image, text, owner, texts


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_distinct_text_recall_equals_naive_loop_with_duplicates(chunk):
    image, text, owner, texts = _with_duplicates()
    assert len(set(texts)) < len(texts)  # duplicates, across and within images
    got = retrieval_recall(image, text, owner, ks=(1, 5, 10), chunk_size=chunk, texts=texts)
    want = naive_distinct_recall(image, text, owner, texts, (1, 5, 10))
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key
    per_caption = retrieval_recall(image, text, owner, ks=(1, 5, 10))
    assert got != per_caption  # the duplicates change the metric here
    _, t2i = retrieval_ranks(image, text, owner, texts=texts)
    assert t2i.shape == (len(set(texts)),)


def test_distinct_text_recall_equals_per_caption_recall_when_captions_are_unique():
    image, text, owner = _captioned()
    texts = [f"caption {c}" for c in range(len(owner))]
    got = retrieval_recall(image, text, owner, ks=(1, 5, 10), texts=texts)
    assert got == retrieval_recall(image, text, owner, ks=(1, 5, 10))
    assert got == pytest.approx(naive_distinct_recall(image, text, owner, texts, (1, 5, 10)), abs=1e-12)


def test_distinct_text_hand_example():
    """Texts 'a' (images 0 and 1) and 'b' (image 2): one t2i query for 'a', hit by image 0 or 1."""
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6]])
    text = torch.tensor([[0.6, 0.8], [0.6, 0.8], [1.0, 0.0]])  # a, a, b
    owner = torch.tensor([0, 1, 2])
    i2t, t2i = retrieval_ranks(image, text, owner, texts=["a", "a", "b"])
    # t2i 'a': scores 0.6, 0.8, 0.96 -> best relevant is image 1 (0.8), image 2 ahead: rank 1;
    # 'b': scores 1.0, 0.0, 0.8 -> image 0 ahead of image 2: rank 1
    assert t2i.tolist() == [1, 1]
    # i2t over the distinct texts [a, b]: image 0 scores a 0.6, b 1.0 -> rank 1; image 1: a 0.8 > b 0 -> 0;
    # image 2: b 0.8 < a 0.96 -> 1
    assert i2t.tolist() == [1, 0, 1]
    per_caption = retrieval_ranks(image, text, owner)[1]
    assert per_caption.tolist() == [2, 1, 1]  # caption 'a' of image 0: images 1 and 2 ahead (a duplicate punished)


def test_distinct_texts_groups_exact_strings():
    text_id, first = distinct_texts(["x", "y", "x", "X", "y"])
    assert text_id.tolist() == [0, 1, 0, 2, 1] and first.tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="one string per caption row"):
        retrieval_recall(_unit(3, 4, 0), _unit(3, 4, 1), torch.arange(3), texts=["a", "b"])


@pytest.mark.parametrize(
    "owner,match",
    [
        ([0, 1], "integer vector of length 3"),
        ([0.0, 1.0, 2.0], "integer vector"),
        ([0, 1, 5], r"values must be in \[0, 3\)"),
    ],
)
def test_recall_rejects_bad_text_to_image(owner, match):
    with pytest.raises(ValueError, match=match):
        retrieval_recall(_unit(3, 4, 0), _unit(3, 4, 1), torch.tensor(owner))


def test_recall_rejects_bad_embeddings():
    with pytest.raises(ValueError, match="differ in width"):
        retrieval_recall(_unit(3, 4, 0), _unit(3, 5, 1), torch.arange(3))
    bad = _unit(3, 4, 1)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        retrieval_recall(_unit(3, 4, 0), bad, torch.arange(3))
    with pytest.raises(ValueError, match="chunk_size"):
        retrieval_recall(_unit(3, 4, 0), _unit(3, 4, 1), torch.arange(3), chunk_size=0)


# ---------------------------------------------------------------------------- align / uniform


@pytest.mark.parametrize("chunk,alpha,t", [(1, 2.0, 2.0), (5, 1.0, 3.0), (100, 2.0, 2.0)])
def test_chunked_align_uniform_equals_dense_reference(chunk, alpha, t):
    image, text = _unit(17, 6, 3), _unit(17, 6, 4)
    got = align_uniform(image, text, alpha=alpha, t=t, chunk_size=chunk)
    want = dense_align_uniform(image, text, alpha, t)
    assert got["align"] == pytest.approx(want["align"], rel=1e-5)
    assert got["uniform"] == pytest.approx(want["uniform"], rel=1e-5)


def test_align_uniform_matches_the_loss_terms():
    from triclip.losses import build_loss

    image, text = _unit(9, 5, 1).double(), _unit(9, 5, 2).double()
    terms = build_loss("align_uniform")(image, text, 1.0)
    got = align_uniform(image, text, chunk_size=4)
    assert got["align"] == pytest.approx(float(terms["align_loss"]), rel=1e-12)
    assert got["uniform"] == pytest.approx(float(terms["uniform_loss"]), rel=1e-12)


def test_uniform_does_not_underflow_for_a_collapsed_set():
    """All points equal but one far away: exp(-t d^2) terms would underflow without log-space sums."""
    z = torch.zeros(5, 3, dtype=torch.float64)
    z[:, 0] = 1.0
    z[0] = torch.tensor([-30.0, 0.0, 0.0])  # |z_0 - z_i|^2 = 961, exp(-1922) == 0 in float64
    got = align_uniform(z, z, chunk_size=2)
    assert got["align"] == 0.0
    assert got["uniform"] == pytest.approx(math.log(12 / 20), rel=1e-12)  # 12 of 20 ordered pairs at distance 0


# ---------------------------------------------------------------------------- mAP and zero-shot


@pytest.mark.parametrize("chunk,exclude_self", [(1, False), (6, True), (500, False)])
def test_chunked_map_equals_dense_reference(chunk, exclude_self):
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, 4, (30,), generator=g)
    centers = _unit(4, 6, 8)
    emb = F.normalize(centers[labels] + 0.9 * _unit(30, 6, 9), dim=1)
    got = class_map(emb, emb, labels, labels, exclude_self=exclude_self, chunk_size=chunk)
    want = dense_map(emb, emb, labels.tolist(), labels.tolist(), exclude_self)
    assert got == pytest.approx(want, abs=1e-12)
    assert 0.3 < got < 1.0


def test_map_hand_example_and_string_labels():
    query = torch.tensor([[1.0, 0.0]])
    gallery = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.5, 0.5], [0.0, 1.0]])
    # ranked: cat, dog, cat, dog -> AP = (1/1 + 2/3) / 2
    assert class_map(query, gallery, ["cat"], ["cat", "dog", "cat", "dog"]) == pytest.approx((1 + 2 / 3) / 2)
    tied = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # a tie puts the irrelevant item first
    assert class_map(query, tied, ["cat"], ["cat", "dog"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no query has a relevant"):
        class_map(query, gallery, ["bird"], ["cat", "dog", "cat", "dog"])


@pytest.mark.parametrize("chunk,k", [(1, 1), (4, 2), (64, 1)])
def test_chunked_zero_shot_equals_dense_reference(chunk, k):
    classes = _unit(5, 6, 10)
    labels = torch.randint(0, 5, (40,), generator=torch.Generator().manual_seed(11))
    image = F.normalize(classes[labels] + 1.5 * _unit(40, 6, 12), dim=1)
    sim = (image @ classes.t()).tolist()
    want = sum(sum(1 for s in row if s >= row[y]) - 1 < k for row, y in zip(sim, labels.tolist())) / 40
    assert zero_shot_accuracy(image, classes, labels, k=k, chunk_size=chunk) == pytest.approx(want)
    assert 0 < want < 1


def test_zero_shot_tie_is_wrong():
    classes = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert zero_shot_accuracy(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), classes, torch.tensor([0, 2])) == 0.5


def test_first_captions_points_at_each_images_first_caption_row():
    from triclip.compact.metrics import first_captions

    owner = torch.tensor([0, 0, 1, 2, 2, 2, 3])  # (T,) caption rows grouped by image
    assert first_captions(owner).tolist() == [0, 2, 3, 6]
    assert first_captions(owner, num_images=5).tolist() == [0, 2, 3, 6, 7]  # image 4 has no caption
    texts = torch.arange(len(owner))
    assert owner[texts[first_captions(owner)]].tolist() == [0, 1, 2, 3]  # each row is its image's
