"""Evaluation of a dual encoder on paired data: the metrics of docs/CONTRACT.md "Metrics".

``evaluate`` embeds every image and every caption of a PairSet once, then
computes recall@{1,5,10} both ways (any caption of an image counts) and class mAP
(where records carry labels) with the model's own score (the cosine of
``sqrt(w) * z``: what a full-dimension index serves), align / uniform on the
(image, first caption) pairs of the plain embeddings, the importance spectrum,
and the compact curve for ``dims``.
``evaluate_run`` is ``triclip eval``: the same on a saved run (its best epoch unless
told ``weights="last"``), with every skipped record counted by reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from triclip.model.cache import locked_tower_outputs
from triclip.compact.features import compact_curve, topm_embed
from triclip.data import DataConfig, load_pairs
from triclip.model.embed import embed_pairs, pick_device
from triclip.core.errors import UserError
from triclip.compact.metrics import align_uniform, class_map, first_captions, retrieval_recall
from triclip.model.run import load_run
from triclip.training.config import EvalConfig, check_eval

ORDERINGS = ("importance", "first", "random", "pca")


def evaluate(
    model, pairs, device, dims=(), batch_size: int = 256, cache: dict | None = None, workers: int = 0, seed: int = 0
) -> dict:
    """All metrics of docs/CONTRACT.md "Metrics" for ``model`` on ``pairs`` (a dict of floats / nested dicts).

    ``skipped`` (reason -> count) holds the records whose image did not decode, when there are any.
    ``dims`` larger than D are refused (UserError); empty means D/16, D/8, D/4.
    """
    D = model.embed_dim
    too_big = [m for m in dims if m > D]
    if too_big:
        raise UserError(f"--dims {','.join(map(str, too_big))}: larger than the run's embedding dimension D={D}")
    return metrics(model, pairs, embed_for_eval(model, pairs, device, batch_size, cache, workers), dims, seed)


@dataclass
class Embedded:
    """A PairSet embedded once for evaluation (what :func:`metrics` and the benchmarks' extras read)."""

    image: torch.Tensor  # plain image embeddings (N, D)
    text: torch.Tensor  # plain caption embeddings (M, D)
    owner: torch.Tensor  # image row of each caption (M,)
    keep: torch.Tensor  # record index of each image row (N,)
    texts: list[str]  # the caption of each text row
    w: torch.Tensor  # the importance (D,)
    image_scored: torch.Tensor  # embeddings whose inner products are the model's score (N, D)
    text_scored: torch.Tensor  # (M, D)
    skipped: dict  # records whose image did not decode, by reason

    def labels(self, pairs) -> torch.Tensor | None:
        """The class id of each image row, where every record has a label and there are two or more classes."""
        labels = [pairs.records[i].label for i in self.keep.tolist()]
        if all(label is not None for label in labels) and len(set(map(str, labels))) > 1:
            return _label_ids(labels)
        return None


def embed_for_eval(model, pairs, device, batch_size: int = 256, cache: dict | None = None, workers: int = 0) -> Embedded:
    """Embed every image and caption of ``pairs`` once (plain and as the model scores them)."""
    image_emb, text_emb, text_to_image, keep, decode_skipped = embed_pairs(model, pairs, device, batch_size, cache, workers)
    w = model.importance().detach().float().cpu()
    image_scored, text_scored = model_score_embeddings(image_emb, text_emb, w)
    texts = [c for i in keep.tolist() for c in pairs.records[i].captions]  # rows of text_emb
    return Embedded(image_emb, text_emb, text_to_image, keep, texts, w, image_scored, text_scored, decode_skipped)


def metrics(model, pairs, e: Embedded, dims=(), seed: int = 0) -> dict:
    """The metrics of :func:`evaluate` from embeddings made once (:func:`embed_for_eval`)."""
    first_caption = first_captions(e.owner)
    result = dict(retrieval_recall(e.image_scored, e.text_scored, e.owner, texts=e.texts))  # over distinct texts
    result["t2i_queries"] = len(set(e.texts))  # what t2i recall averages over (its noise: triclip.training.selection)
    result.update(align_uniform(e.image, e.text[first_caption]))  # Wang & Isola: on the encoder's output
    ids = e.labels(pairs)
    if ids is not None:
        result["class_map"] = float(class_map(e.text_scored[first_caption], e.image_scored, ids, ids))  # text -> image
    result["importance"] = _spectrum(e.w)
    result["logit_scale"] = float(model.logit_scale().detach())
    D = e.image.shape[1]
    dims = list(dims) or [m for m in (D // 16, D // 8, D // 4) if m >= 1]
    result["compact"] = compact_curve(e.image, e.text, e.owner, e.w, dims, orderings=ORDERINGS, seed=seed, texts=e.texts)
    if e.skipped:
        result["skipped"] = dict(sorted(e.skipped.items()))
    return result


def format_table(result: dict) -> str:
    """The full-dimension recall and the compact curve (recall@10 t2i per ordering and m) as text.

    What the demo and the end of ``triclip train`` print.
    """
    lines = [
        f"full dimension: t2i R@1 {result['t2i_r1']:.3f}  R@10 {result['t2i_r10']:.3f}   "
        f"i2t R@1 {result['i2t_r1']:.3f}  R@10 {result['i2t_r10']:.3f}   "
        f"align {result['align']:.3f}  uniform {result['uniform']:.3f}"
    ]
    curve = result.get("compact") or {}
    dims = sorted({int(m) for per in curve.values() for m in per})
    if dims:
        lines.append("ordering     " + "".join(f"m={m:<7d}" for m in dims))
    for ordering, per in curve.items():
        values = {int(m): v for m, v in per.items()}
        lines.append(f"{ordering:<12} " + "".join(f"{values[m]:<9.3f}" for m in dims))
    return "\n".join(lines)


def model_score_embeddings(image_emb: torch.Tensor, text_emb: torch.Tensor, w: torch.Tensor):
    """Embeddings whose inner product is the model's retrieval score.

    That is the cosine of ``sqrt(w) * z``: the tri-factor similarity, re-normalised, exactly
    what an index of all D dimensions serves (the top-m embedding at m = D). With ``w = 1``
    (every objective but ``tricl``) it is the plain cosine. Shapes: (N, D), (M, D), (D,).
    """
    if bool((w == w[0]).all()):
        return image_emb, text_emb  # uniform w: the cosine itself
    every = torch.arange(image_emb.shape[1])  # all D dimensions: their order does not change a score
    return topm_embed(image_emb, w, every, len(every)), topm_embed(text_emb, w, every, len(every))


def _label_ids(labels) -> torch.Tensor:
    names = {name: i for i, name in enumerate(sorted(set(map(str, labels))))}
    return torch.tensor([names[str(label)] for label in labels])


def _spectrum(w: torch.Tensor) -> dict:
    """How unequal the importance is: sorted values and two summaries."""
    p = w / w.sum()
    effective = float(torch.exp(-(p * p.clamp_min(1e-12).log()).sum()))  # exp(entropy): D when uniform
    return {
        "sorted": [round(float(v), 5) for v in w.sort(descending=True).values],
        "effective_dims": effective,
        "max_over_mean": float(w.max() / w.mean()),
    }


def evaluate_run(cfg: EvalConfig | str, data: str | None = None, dims=(), data_config=None, device=None) -> dict:
    """``triclip eval``: load the run, read the data, return the metrics (plus ``compact`` and
    ``skipped``: every record left out, by reason, whether when reading or when decoding).

    Takes an :class:`EvalConfig` (the old positional form ``evaluate_run(run, data, dims, ...)``
    still works)."""
    if not isinstance(cfg, EvalConfig):
        cfg = EvalConfig(run=cfg, data=data, dims=list(dims), device=device, data_config=data_config or DataConfig())
    check_eval(cfg)
    dev = pick_device(cfg.device)
    model, _ = load_run(cfg.run, dev, which=cfg.weights)  # towers locked as trained
    pairs = load_pairs(cfg.data, cfg.data_config)
    cache = locked_tower_outputs(model, pairs, dev, cfg.workers)
    result = evaluate(model, pairs, dev, dims=cfg.dims, batch_size=cfg.batch_size, cache=cache, workers=cfg.workers, seed=cfg.seed)
    skipped = Counter(pairs.skipped) + Counter(result.pop("skipped", {}))
    result["skipped"] = dict(sorted(skipped.items()))
    return result
