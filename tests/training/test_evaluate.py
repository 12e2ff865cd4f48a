"""Evaluation scores retrieval with the model's own similarity (the tri-factor one for tricl)."""

import torch

from triclip.data import load_pairs
from triclip.model.model import ModelConfig, build_model
from triclip.model.embed import embed_pairs
from triclip.training.evaluate import evaluate


def _t2i_recall_at_10(scores: torch.Tensor, text_to_image: torch.Tensor, texts: list[str]) -> float:
    """Slow reference over distinct texts (docs/CONTRACT.md "Metrics"): each caption text once, every image
    carrying it relevant; a hit when one of them is among the 10 best-scored images."""
    relevant: dict[str, set] = {}
    first_row: dict[str, int] = {}
    for row, text in enumerate(texts):
        relevant.setdefault(text, set()).add(int(text_to_image[row]))
        first_row.setdefault(text, row)
    hits = 0
    for text, row in first_row.items():
        top = sorted(range(scores.shape[1]), key=lambda i: -float(scores[row, i]))[:10]
        hits += bool(relevant[text] & set(top))
    return hits / len(first_row)


def test_recall_uses_the_weighted_cosine_and_matches_the_full_index(shapes_data):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny", embed_dim=16, importance_spread=100.0)).eval()
    pairs = load_pairs(str(shapes_data / "val.jsonl"))
    result = evaluate(model, pairs, "cpu", dims=[4, 16])
    image, text, text_to_image, keep, _ = embed_pairs(model, pairs, "cpu")
    texts = [c for i in keep.tolist() for c in pairs.records[i].captions]
    w = model.importance().detach()
    scores = (text * w) @ image.t()  # tri-factor similarity (M, N)
    scores = scores / (text.square() @ w).sqrt()[:, None] / (image.square() @ w).sqrt()[None, :]
    assert abs(result["t2i_r10"] - _t2i_recall_at_10(scores, text_to_image, texts)) < 1e-9
    assert abs(result["t2i_r10"] - result["compact"]["importance"][16]) < 1e-9  # the index at m = D
    plain = _t2i_recall_at_10(text @ image.t(), text_to_image, texts)
    assert abs(result["compact"]["first"][16] - plain) < 1e-9  # baselines stay on the plain cosine
