"""Nesting (Matryoshka, Kusupati et al. 2022, https://arxiv.org/abs/2205.13147) around any objective.

``build_loss(name, nested=L, nested_weight=a, nested_order=o, nested_by=b)`` wraps the
objective ``name`` in :class:`Nested`: its own terms, plus ``nested_loss`` = ``a`` times the
sum over ``m = D/2, D/4, ..., D/2**L`` (stopping at one dimension) of a term at m
(docs/CONTRACT.md, "Objectives"). Which term (``nested_by``):

- ``infonce`` (the default, what every measured run used; the default was kept, not chosen by
  measuring the two): the symmetric InfoNCE of the compact embedding at m, logit scale
  shared, whatever the objective;
- ``inner``: the objective itself at m, as sentence-transformers' ``MatryoshkaLoss`` does
  (https://www.sbert.net/docs/package_reference/sentence_transformer/losses.html#matryoshkaloss):
  the sum of its terms on the kept dimensions re-normalised; an objective that reads ``w``
  gets the kept entries of ``w`` (and unweighted features, since it applies ``w`` itself).

The compact embedding is the one an index serves (docs/CONTRACT.md, "Compact features"):

- ``nested_order="prefix"``: the first m dimensions of ``z``, re-normalised (plain MRL;
  ``infonce`` + prefix nesting is called MRL in reports);
- ``nested_order="importance"``: the first m dimensions of ``argsort(w, descending)``,
  weighted by ``sqrt(w)`` and re-normalised. ``w`` gets gradients through the weights of
  the kept dimensions, not through the order. Needs the importance vector.

``nested_order`` left out: ``importance`` for an objective that uses ``w`` (``tricl``),
``prefix`` for every other. ``nested=0`` is the plain objective (no wrapper).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triclip.compact.features import weighted_top
from triclip.losses.base import PairLoss, non_negative
from triclip.losses.infonce import symmetric_infonce

NESTED_ORDERS = ("prefix", "importance")
NESTED_BY = ("infonce", "inner")
NESTING_OPTIONS = ("nested", "nested_weight", "nested_order", "nested_by")  # options build_loss takes for every objective


@dataclass
class NestingConfig:
    """Options of the nesting wrapper (accepted by every objective)."""

    nested: int = 0  # L >= 0: InfoNCE of the compact embedding at m = D/2 ... D/2**L (0: off)
    nested_weight: float = 1.0  # weight of each of those terms (>= 0)
    nested_order: str | None = None  # prefix (MRL) or importance; None: importance if the objective uses w
    nested_by: str = "infonce"  # the term at each m: infonce (InfoNCE of the compact embedding) or inner (the objective)

    def __post_init__(self) -> None:
        if isinstance(self.nested, bool) or not isinstance(self.nested, int) or self.nested < 0:
            raise ValueError(f"nested must be an int >= 0, got {self.nested!r}")
        self.nested_weight = non_negative("nested_weight", self.nested_weight)
        if self.nested_order is not None and self.nested_order not in NESTED_ORDERS:
            raise ValueError(f"nested_order must be one of {', '.join(NESTED_ORDERS)}, got {self.nested_order!r}")
        if self.nested_by not in NESTED_BY:
            raise ValueError(f"nested_by must be one of {', '.join(NESTED_BY)}, got {self.nested_by!r}")


def nested_prefixes(dim: int, levels: int) -> list[int]:
    """``[D/2, D/4, ..., D/2**levels]`` (integer halvings), stopping at one dimension."""
    return [dim >> k for k in range(1, levels + 1) if dim >> k >= 1]


def nested_infonce(
    image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, importance: torch.Tensor | None, levels: int
) -> torch.Tensor:
    """Sum over ``m = D/2 ... D/2**levels`` of the symmetric InfoNCE of the compact embedding.

    Args:
        image: image features. Shape: (B, D).
        text: text features. Shape: (B, D).
        scale: logit scale ``s``. Shape: ().
        importance: ``w`` (D,) for the importance order with ``sqrt(w)`` weights; ``None``
            for the prefix order (first m dimensions, unweighted).
        levels: L.

    Returns:
        Scalar.
    """
    dim = image.shape[1]
    if importance is None:
        order = torch.arange(dim, device=image.device)
    else:
        order = torch.argsort(importance.detach(), descending=True, stable=True)  # as compact.importance_order
    total = image.new_zeros(())
    for m in nested_prefixes(dim, levels):
        a = weighted_top(image, importance, order[:m])  # (B, m)
        b = weighted_top(text, importance, order[:m])  # (B, m)
        total = total + symmetric_infonce(scale * a @ b.t())
    return total


def nested_inner(
    inner: PairLoss, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, importance: torch.Tensor | None,
    order: str, levels: int,
) -> torch.Tensor:
    """Sum over ``m = D/2 ... D/2**levels`` of the objective's own terms on the first m dimensions of ``order``.

    The kept dimensions are re-normalised; an objective that reads ``w`` gets ``w`` of the kept
    dimensions and unweighted features, any other gets the ``sqrt(w)``-weighted compact
    embedding on the importance order. Shapes: image, text (B, D); importance (D,) or None.
    """
    dim = image.shape[1]
    if order == "prefix":
        ranked = torch.arange(dim, device=image.device)
    else:
        ranked = torch.argsort(importance.detach(), descending=True, stable=True)  # as compact.importance_order
    weights = None if inner.needs_importance or order == "prefix" else importance
    total = image.new_zeros(())
    for m in nested_prefixes(dim, levels):
        keep = ranked[:m]
        a, b = weighted_top(image, weights, keep), weighted_top(text, weights, keep)  # (B, m) each
        kept_w = importance[keep] if inner.needs_importance else None  # (m,)
        total = total + sum(inner.terms(a, b, scale, kept_w).values())
    return total


class Nested(PairLoss):
    """An objective plus its nested term: ``{**inner terms, "nested_loss": ...}``.

    ``needs_importance`` is the inner objective's, or True with ``nested_order=importance``.
    The inner objective's parameters (``sigmoid``'s bias) are this module's under ``inner.``.
    Shape: features (B, D).
    """

    Config = NestingConfig

    def __init__(self, inner: PairLoss, **options) -> None:
        super().__init__(**options)
        if self.config.nested < 1:
            raise ValueError(f"the nesting wrapper needs nested >= 1, got {self.config.nested}")
        self.inner = inner
        self.name = inner.name
        self.order = self.config.nested_order or ("importance" if inner.needs_importance else "prefix")
        self.needs_importance = inner.needs_importance or self.order == "importance"

    def extra_repr(self) -> str:
        c = self.config
        return f"nested={c.nested}, nested_weight={c.nested_weight}, nested_order={self.order}, nested_by={c.nested_by}"

    def terms(self, image, text, scale, importance):
        out = dict(self.inner.terms(image, text, scale, importance if self.inner.needs_importance else None))
        w = importance if self.order == "importance" else None
        if self.config.nested_by == "inner":
            nested = nested_inner(self.inner, image, text, scale, importance, self.order, self.config.nested)
        else:
            nested = nested_infonce(image, text, scale, w, self.config.nested)
        out["nested_loss"] = self.config.nested_weight * nested
        return out
