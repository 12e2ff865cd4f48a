"""Compact features: rank embedding dimensions, keep the top-m, compare with baseline orderings.

Tri-factor contrastive learning (Zhang et al. 2023, https://arxiv.org/abs/2302.13253)
learns a non-negative importance ``w`` (D,) per embedding dimension; the tri-factor
similarity is ``sum_d w_d I_d T_d``. Ordering the dimensions by ``w`` and keeping the
first m gives a compact embedding whose inner product ranks like the tri-factor
similarity restricted to those dimensions (see docs/CONTRACT.md "Compact features").

Orderings (a registry, :data:`ORDERINGS`):

- ``importance``: ``argsort(w, descending)``, coordinates weighted by ``sqrt(w)``
  (identity order and unit weights for a model without importance).
- ``first``: the first m coordinates of the plain normalised embedding.
- ``random``: m coordinates drawn by a seeded permutation (nested in m).
- ``pca``: the top-m principal directions of a PCA fitted on embeddings of the same
  model (by default the joint image + text embeddings being compared).

The baselines work on the plain embedding ``z`` (no ``sqrt(w)`` weighting): they stand
for what one would do without the learned importance, and at m = D they reproduce
the plain cosine score. The importance curve at m = D reproduces the tri-factor
score instead. ``weighted=True`` applies the same ``sqrt(w)`` weights to a
selection baseline, to separate "which dims" from "how they are weighted".

Every compact embedding is re-normalised. The sign fix (:func:`sign_flips`) flips
output coordinates so that an anchor sample is positive (the paper's rule, used by indexes),
or, robust across data samples, so that each coordinate's distribution is skewed to the
positive side (``rule="skew"``); scores do not change. :func:`suggest_m` reads the smallest useful m off the spectrum.

This module is pure torch: it never imports ``training``, ``index`` or ``app``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------- pure helpers


def importance_order(importance: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """Dimensions sorted by decreasing importance (ties keep their index order).

    Args:
        importance: ``w``, non-negative, or ``None`` for a model without importance.
        dim: D, needed only when ``importance`` is ``None`` (identity order).

    Returns:
        Long tensor ``(D,)``: ``order[0]`` is the most important dimension.
    """
    if importance is None:
        if dim is None or dim <= 0:
            raise ValueError("importance_order needs a positive dim when importance is None")
        return torch.arange(dim)
    w = _check_importance(importance)
    return torch.argsort(w, descending=True, stable=True)


def topm_embed(z: torch.Tensor, importance: torch.Tensor | None, order: torch.Tensor, m: int) -> torch.Tensor:
    """Top-m embedding: the first m ordered coordinates of ``sqrt(w) * z``, L2-normalised.

    Args:
        z: embeddings. Shape: (N, D).
        importance: ``w`` (D,), or ``None`` for unit weights.
        order: dimension order (D,), e.g. from :func:`importance_order`.
        m: number of dimensions kept, 1 <= m <= D.

    Returns:
        Shape: (N, m), unit rows (an all-zero row stays zero).
    """
    dim = _check_feats(z)
    _check_m(m, dim)
    w = None if importance is None else _check_importance(importance, dim)
    return weighted_top(z, w, order[:m])


def weighted_top(z: torch.Tensor, w: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor:
    """``sqrt(w) * z`` restricted to the ``keep`` dimensions, rows L2-normalised; no checks.

    The maths of :func:`topm_embed`, differentiable in ``z`` and ``w`` (the training loss
    uses it on a hot path). Shapes: z (N, D), w (D,) or None, keep (m,) -> (N, m).
    """
    picked = z[:, keep]  # (N, m)
    if w is not None:
        picked = picked * w[keep].sqrt().to(z)  # (N, m)
    return F.normalize(picked, dim=-1)


SIGN_RULES = ("anchor", "majority", "skew")  # see sign_flips


def sign_flips(anchor_feats: torch.Tensor, rule: str = "anchor") -> torch.Tensor:
    """Per-dimension sign fix: +-1 per dimension; multiplying both towers' features by it
    leaves every inner product unchanged.

    Rules (a dimension that is zero on every row keeps +1):

    - ``anchor`` (the paper's; the default): the first row whose coordinate is non-zero
      becomes positive. Fragile: when that row's coordinate is near zero, another sample of
      data flips it. Index folders use it: signs never change a score, and an index grown by
      ``--add`` then holds the vectors of one build (the other rules read the whole anchor set).
    - ``majority``: most rows positive (the sign of ``sum_i sign(z_id)``; a tie falls back
      to ``anchor``).
    - ``skew`` (for comparing features across runs, seeds and data: ``triclip.training.solve``,
      ``benchmarks.identifiability``): a positive third central moment (the sign of
      ``sum_i (z_id - mean_d)^3``; zero falls back to ``anchor``): a property of the
      distribution, not of one sample. On ``openclipart``'s CCA solution the flips of the
      two halves of the training images agree on 67% of the 256 dimensions (anchor: 51%,
      a coin toss; majority: 63%); docs/results.md, "Identifiability of the demo's S".

    Args:
        anchor_feats: features in dataset order (first row first). Shape: (N, D).
        rule: one of :data:`SIGN_RULES`.

    Returns:
        Float tensor ``(D,)`` of +1 / -1.
    """
    _check_feats(anchor_feats)
    if rule not in SIGN_RULES:
        raise ValueError(f"unknown sign rule {rule!r}; choose from {SIGN_RULES}")
    nonzero = anchor_feats != 0  # (N, D)
    first = nonzero.to(torch.int8).argmax(dim=0)  # (D,) first non-zero row (0 if none)
    anchor = anchor_feats.gather(0, first[None]).squeeze(0)  # (D,)
    stat = anchor  # (D,) the statistic whose sign is made positive
    if rule == "majority":
        stat = torch.sign(anchor_feats).sum(dim=0)  # (D,)
    elif rule == "skew":
        x = anchor_feats.double()
        stat = ((x - x.mean(dim=0)) ** 3).sum(dim=0)  # (D,)
    stat = torch.where(stat == 0, anchor.to(stat.dtype), stat)
    return torch.where(stat < 0, -1.0, 1.0).to(anchor_feats.dtype)


SUGGEST_POWER = 2.0  # suggest_m reads the share of w ** this (w^2: Eq. 6's own objective, docs/results.md)


def suggest_m(
    importance: torch.Tensor | None, share: float = 0.9, dim: int | None = None, power: float = SUGGEST_POWER
) -> int:
    """The smallest m whose top-m dimensions are predicted to keep ``share`` of full-D recall.

    The prediction is the cumulative share of ``w ** power`` over the dimensions sorted by
    ``w``. With ``power=2`` that is the share of the Eq. 6 objective the top-m dimensions
    carry (at the optimum ``L_tri = -sum_k s_k^2``, so dimension k contributes ``s_k^2``).
    Measured on ``openclipart``'s test split with the CCA solution (docs/results.md, "``suggest_m`` on
    the demo's S"), the share of ``rho^2`` tracks recall(m) / recall(D) within 0.07 on
    average and its suggestions at 0.8 / 0.9 / 0.95 kept that much of the test recall;
    the share of ``rho`` itself (``power=1``) is off by 0.23 and suggests twice the m.
    A model without importance (``None``) or a flat one gives ``ceil(share * D)``:
    the spectrum predicts nothing there.

    Args:
        importance: ``w`` (D,), non-negative, or ``None`` (then ``dim`` is needed).
        share: the fraction of full-D recall to keep, in (0, 1].
        dim: D when ``importance`` is None.
        power: the exponent of ``w`` whose cumulative share predicts the recall curve.

    Returns:
        m, 1 <= m <= D.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}")
    if importance is None:
        if dim is None or dim <= 0:
            raise ValueError("suggest_m needs a positive dim when importance is None")
        return max(1, min(dim, math.ceil(share * dim - 1e-9)))
    w = _check_importance(importance).double() ** power
    total = float(w.sum())
    if total <= 0.0:
        return max(1, min(w.numel(), math.ceil(share * w.numel() - 1e-9)))
    cum = torch.sort(w, descending=True).values.cumsum(0) / total  # (D,)
    m = int((cum < share - 1e-12).sum()) + 1
    return max(1, min(w.numel(), m))


@dataclass
class PCABasis:
    """Principal directions of a set of embeddings.

    Shape: ``mean`` (D,), ``components`` (D, D) with one direction per row, sorted by
    ``variances`` (D,) descending.
    """

    mean: torch.Tensor  # (D,) subtracted before projecting; zeros for an uncentred fit
    components: torch.Tensor  # (D, D) orthonormal rows, most variance first
    variances: torch.Tensor  # (D,) variance (or second moment, uncentred) along each row

    def project(self, z: torch.Tensor, m: int) -> torch.Tensor:
        """Coordinates on the top-m directions. Shape: (N, D) -> (N, m), not normalised."""
        _check_m(m, self.components.shape[0])
        return (z - self.mean.to(z)) @ self.components[:m].T.to(z)  # (N, m)


def fit_pca(feats: torch.Tensor, center: bool = True) -> PCABasis:
    """PCA of the rows of ``feats`` by an eigendecomposition in float64.

    Args:
        feats: embeddings to fit on. Shape: (N, D).
        center: subtract the mean (standard PCA, like ``sklearn.decomposition.PCA``).
            ``False`` fits the uncentred second moment: then the projection at m = D
            is a rotation and keeps every inner product.

    Returns:
        The :class:`PCABasis`, each direction's sign fixed so its largest-magnitude
        entry is positive (deterministic across LAPACK builds).
    """
    dim = _check_feats(feats)
    if feats.shape[0] < 2:
        raise ValueError("fit_pca needs at least 2 rows")
    x = feats.detach().double()
    mean = x.mean(dim=0) if center else torch.zeros(dim, dtype=x.dtype)  # (D,)
    x = x - mean  # (N, D)
    cov = x.T @ x / (x.shape[0] - (1 if center else 0))  # (D, D)
    evals, evecs = torch.linalg.eigh(cov)  # ascending; columns are directions
    evals, evecs = evals.flip(0), evecs.flip(1)  # (D,), (D, D) descending
    comps = evecs.T  # (D, D) rows
    pivot = comps.abs().argmax(dim=1, keepdim=True)  # (D, 1)
    comps = comps * torch.sign(comps.gather(1, pivot))  # (D, D)
    dtype = feats.dtype if feats.is_floating_point() else torch.float32
    return PCABasis(mean.to(dtype), comps.to(dtype), evals.clamp_min(0).to(dtype))


# ---------------------------------------------------------------------------- transforms


@dataclass
class CompactTransform:
    """The map from a model's embedding (N, D) to a compact one (N, m), saved with an index.

    Selection orderings pick ``keep`` coordinates and scale them by ``weights``; PCA
    projects on ``basis``. The result is L2-normalised, then multiplied by ``signs``.
    """

    ordering: str  # name in ORDERINGS
    dim: int  # D, the model's embedding dimension
    m: int  # output dimension, 1 <= m <= D
    keep: torch.Tensor | None = None  # (m,) long, selected input dims (selection orderings)
    weights: torch.Tensor | None = None  # (m,) multipliers of the kept dims, e.g. sqrt(w); None = 1
    basis: PCABasis | None = None  # PCA orderings only
    signs: torch.Tensor | None = None  # (m,) +-1 applied last (sign fix); None = all +1

    def __post_init__(self) -> None:
        _check_m(self.m, self.dim)
        if (self.keep is None) == (self.basis is None):
            raise ValueError("CompactTransform needs exactly one of keep (selection) or basis (PCA)")
        if self.keep is not None and tuple(self.keep.shape) != (self.m,):
            raise ValueError(f"keep must have shape ({self.m},), got {tuple(self.keep.shape)}")
        for name in ("weights", "signs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (self.m,):
                raise ValueError(f"{name} must have shape ({self.m},), got {tuple(value.shape)}")

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """Compact embedding. Shape: (N, D) -> (N, m), unit rows."""
        dim = _check_feats(z)
        if dim != self.dim:
            raise ValueError(f"expected embeddings of dimension {self.dim}, got {dim}")
        if self.basis is not None:
            out = self.basis.project(z, self.m)  # (N, m)
        else:
            out = z[:, self.keep]  # (N, m)
            if self.weights is not None:
                out = out * self.weights.to(z)
        out = F.normalize(out, dim=-1)
        return out * self.signs.to(out) if self.signs is not None else out

    def with_signs_from(self, anchor_z: torch.Tensor) -> "CompactTransform":
        """A copy with the sign fix anchored on ``anchor_z`` (N, D), e.g. training images in order."""
        unsigned = CompactTransform(self.ordering, self.dim, self.m, self.keep, self.weights, self.basis)
        return CompactTransform(
            self.ordering, self.dim, self.m, self.keep, self.weights, self.basis, sign_flips(unsigned(anchor_z))
        )

    def to_dict(self) -> dict:
        """JSON-able form (lists of numbers), inverse of :meth:`from_dict`."""
        out: dict = {"ordering": self.ordering, "dim": self.dim, "m": self.m}
        for name in ("keep", "weights", "signs"):
            value = getattr(self, name)
            out[name] = None if value is None else value.tolist()
        if self.basis is not None:
            out["basis"] = {
                "mean": self.basis.mean.tolist(),
                "components": self.basis.components[: self.m].tolist(),
                "variances": self.basis.variances[: self.m].tolist(),
            }
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "CompactTransform":
        """Rebuild a transform saved by :meth:`to_dict`."""

        def tensor(value, dtype=torch.float32):
            return None if value is None else torch.tensor(value, dtype=dtype)

        basis = data.get("basis")
        return cls(
            ordering=str(data["ordering"]),
            dim=int(data["dim"]),
            m=int(data["m"]),
            keep=tensor(data.get("keep"), torch.long),
            weights=tensor(data.get("weights")),
            basis=None if basis is None else PCABasis(*(tensor(basis[k]) for k in ("mean", "components", "variances"))),
            signs=tensor(data.get("signs")),
        )


@dataclass
class OrderingInputs:
    """What an ordering may use to build its transform."""

    dim: int  # D
    m: int  # kept dimensions
    importance: torch.Tensor | None  # (D,) w, or None for a model without importance
    seed: int  # random ordering's seed
    pca_feats: torch.Tensor | None  # (N, D) embeddings a PCA is fitted on
    pca_basis: PCABasis | None  # a ready PCA fit (wins over pca_feats)
    weighted: bool | None  # sqrt(w) weighting of a selection; None = the ordering's default


def _selection(inputs: OrderingInputs, order: torch.Tensor, weighted_default: bool) -> tuple:
    keep = order[: inputs.m].clone()  # (m,)
    weighted = weighted_default if inputs.weighted is None else inputs.weighted
    weights = None
    if weighted and inputs.importance is not None:
        weights = _check_importance(inputs.importance, inputs.dim)[keep].sqrt().float()  # (m,)
    return keep, weights


def _importance(inputs: OrderingInputs) -> CompactTransform:
    keep, weights = _selection(inputs, importance_order(inputs.importance, inputs.dim), True)
    return CompactTransform("importance", inputs.dim, inputs.m, keep=keep, weights=weights)


def _first(inputs: OrderingInputs) -> CompactTransform:
    keep, weights = _selection(inputs, torch.arange(inputs.dim), False)
    return CompactTransform("first", inputs.dim, inputs.m, keep=keep, weights=weights)


def _random(inputs: OrderingInputs) -> CompactTransform:
    gen = torch.Generator().manual_seed(inputs.seed)
    keep, weights = _selection(inputs, torch.randperm(inputs.dim, generator=gen), False)
    return CompactTransform("random", inputs.dim, inputs.m, keep=keep, weights=weights)


def _pca(inputs: OrderingInputs) -> CompactTransform:
    basis = inputs.pca_basis
    if basis is None:
        if inputs.pca_feats is None:
            raise ValueError("the pca ordering needs embeddings to fit on (pca_feats) or a fitted basis")
        basis = fit_pca(inputs.pca_feats)
    if basis.components.shape[-1] != inputs.dim:
        raise ValueError(f"PCA basis is for dimension {basis.components.shape[-1]}, not {inputs.dim}")
    return CompactTransform("pca", inputs.dim, inputs.m, basis=basis)


ORDERINGS: dict[str, Callable[[OrderingInputs], CompactTransform]] = {
    "importance": _importance,
    "first": _first,
    "random": _random,
    "pca": _pca,
}


def make_transform(
    ordering: str,
    dim: int,
    m: int,
    importance: torch.Tensor | None = None,
    seed: int = 0,
    pca_feats: torch.Tensor | None = None,
    pca_basis: PCABasis | None = None,
    weighted: bool | None = None,
) -> CompactTransform:
    """Build the compact transform of one ordering (see the module docstring).

    Args:
        ordering: a name in :data:`ORDERINGS`.
        dim: D.
        m: kept dimensions, 1 <= m <= D.
        importance: ``w`` (D,) or ``None``.
        seed: seed of the ``random`` ordering.
        pca_feats: embeddings (N, D) the ``pca`` ordering is fitted on.
        pca_basis: a ready fit for ``pca`` (e.g. to reuse one fit for several m).
        weighted: ``sqrt(w)`` weighting of a selection ordering; ``None`` = True for
            ``importance``, False for the baselines.
    """
    if ordering not in ORDERINGS:
        raise ValueError(f"unknown ordering {ordering!r}; choose from {sorted(ORDERINGS)}")
    _check_m(m, dim)
    if importance is not None:
        _check_importance(importance, dim)
    return ORDERINGS[ordering](OrderingInputs(int(dim), int(m), importance, seed, pca_feats, pca_basis, weighted))


def compact_embeddings(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    ordering: str,
    m: int,
    importance: torch.Tensor | None = None,
    seed: int = 0,
    pca_fit: torch.Tensor | PCABasis | None = None,
    weighted: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both towers' compact embeddings under one ordering (same transform for both).

    Args:
        image_emb: image embeddings. Shape: (N, D).
        text_emb: text embeddings. Shape: (M, D).
        ordering: ``importance``, ``first``, ``random`` or ``pca``.
        m: kept dimensions.
        importance: ``w`` (D,) or ``None``.
        seed: seed of ``random``.
        pca_fit: what ``pca`` is fitted on: embeddings (K, D), a :class:`PCABasis`, or
            ``None`` for the joint ``cat([image_emb, text_emb])`` given here.
        weighted: see :func:`make_transform`.

    Returns:
        ``(image (N, m), text (M, m))``, unit rows.
    """
    dim = _check_feats(image_emb)
    if _check_feats(text_emb) != dim:
        raise ValueError(f"image and text embeddings differ in dimension: {dim} vs {text_emb.shape[1]}")
    basis = pca_fit if isinstance(pca_fit, PCABasis) else None
    feats = None
    if ordering == "pca" and basis is None:
        feats = pca_fit if pca_fit is not None else torch.cat([image_emb, text_emb])  # (N+M, D)
    transform = make_transform(ordering, dim, m, importance, seed, feats, basis, weighted)
    return transform(image_emb), transform(text_emb)


def compact_curve(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    text_to_image: torch.Tensor,
    importance: torch.Tensor | None,
    dims: Sequence[int],
    orderings: Sequence[str] = ("importance", "first", "random", "pca"),
    seed: int = 0,
    pca_fit: torch.Tensor | PCABasis | None = None,
    texts: Sequence[str] | None = None,
) -> dict[str, dict[int, float]]:
    """Text->image recall@10 of the compact embeddings, per ordering and m.

    Args:
        image_emb: image embeddings. Shape: (N, D).
        text_emb: text embeddings. Shape: (M, D).
        text_to_image: row of the matching image for each text. Shape: (M,).
        importance: ``w`` (D,) or ``None``.
        dims: the m values (each 1 <= m <= D).
        orderings: names in :data:`ORDERINGS`.
        seed: seed of ``random``.
        pca_fit: see :func:`compact_embeddings`; by default the PCA is fitted once on the
            joint image + text embeddings given.
        texts: caption strings, one per row of ``text_emb``: recall over distinct texts
            (:func:`triclip.compact.metrics.retrieval_recall`); None: per caption.

    Returns:
        ``{ordering: {m: t2i_r10}}``.
    """
    from triclip.compact.metrics import retrieval_recall  # lazy: metrics is a sibling module

    dim = _check_feats(image_emb)
    for m in dims:
        _check_m(m, dim)
    for name in orderings:
        if name not in ORDERINGS:
            raise ValueError(f"unknown ordering {name!r}; choose from {sorted(ORDERINGS)}")
    if "pca" in orderings and not isinstance(pca_fit, PCABasis):
        pca_fit = fit_pca(pca_fit if pca_fit is not None else torch.cat([image_emb, text_emb]))
    curve: dict[str, dict[int, float]] = {}
    for name in orderings:
        curve[name] = {}
        for m in dims:
            img, txt = compact_embeddings(image_emb, text_emb, name, m, importance, seed, pca_fit)
            curve[name][int(m)] = float(retrieval_recall(img, txt, text_to_image, texts=texts)["t2i_r10"])
    return curve


# ---------------------------------------------------------------------------- checks


def _check_feats(z: torch.Tensor) -> int:
    if not isinstance(z, torch.Tensor) or z.dim() != 2:
        raise ValueError(f"expected a 2-D tensor (N, D), got {getattr(z, 'shape', type(z))}")
    return int(z.shape[1])


def _check_m(m: int, dim: int) -> None:
    if not isinstance(m, numbers.Integral) or isinstance(m, bool) or not 1 <= m <= dim:
        raise ValueError(f"m must be an integer in [1, {dim}], got {m!r}")


def _check_importance(w: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    w = w.detach().flatten()
    w = w if w.is_floating_point() else w.float()
    if dim is not None and w.numel() != dim:
        raise ValueError(f"importance has {w.numel()} entries, expected {dim}")
    if not torch.isfinite(w).all() or (w < 0).any():
        raise ValueError("importance must be finite and non-negative")
    return w
