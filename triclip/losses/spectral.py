"""Spectral contrastive losses on image-text pairs: HaoChen et al. 2021 and triCL's Eq. 6 + Eq. 8.

- ``spectral``: HaoChen, Wei, Gaidon & Ma 2021, https://arxiv.org/abs/2106.04156;
- ``tricl_spectral``: Zhang, Wang & Wang 2023, "Identifiable Contrastive Learning with Automatic
  Feature Importance Discovery", https://arxiv.org/abs/2310.18904, Eq. 6 (tri-factor spectral
  loss with ``S = diag(w)``) + Eq. 8 (decorrelation), the objective of their Thm 4.5.

Ported to pairs: positives are ``(I_i, T_i)``, negatives ``(I_i, T_j)`` with ``j != i`` over
the global batch. The features arrive L2-normalised; the losses score ``u = sqrt(D) * z``
(see :func:`spectral_terms` for why). Neither uses the logit scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triclip.losses.base import PairLoss, non_negative
from triclip.losses.registry import register_loss
from triclip.losses.tricl import decorrelation


def spectral_terms(image: torch.Tensor, text: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 6 on pairs: ``-2 mean_i(u_i^T S v_i) + mean_{i != j}((u_i^T S v_j)^2)``.

    ``u = sqrt(D) * I``, ``v = sqrt(D) * T``: the paper's ``f`` is unnormalised and Eq. 8 asks
    for ``E[f f^T] = Id`` (trace D), while a unit vector has ``E[z z^T]`` of trace 1. Scaled by
    ``sqrt(D)``, a distribution uniform on the sphere has ``E[u u^T] = Id`` exactly, so it pays
    no decorrelation and its scores have the scale Eq. 6 is written for (the convention of
    ``tricl``'s ``(D/B) Z^T Z``). ``S = diag(importance)``; ``None`` is ``S = Id`` (HaoChen).

    Args:
        image: L2-normalised image features. Shape: (B, D).
        text: L2-normalised text features, row i paired with image i. Shape: (B, D).
        importance: ``w`` (the diagonal of S), non-negative, or None. Shape: (D,).

    Returns:
        Scalar ``L_tri``.
    """
    batch, dim = image.shape
    a = image if importance is None else image * importance  # (B, D): rows I_i^T S
    scores = dim * (a @ text.t())  # (B, B): u_i^T S v_j
    pos = scores.diagonal()  # (B,)
    neg_sq = scores.square().sum() - pos.square().sum()  # sum over i != j
    return -2.0 * pos.mean() + neg_sq / (batch * (batch - 1))


def decorrelation_eq8(z: torch.Tensor) -> torch.Tensor:
    """Eq. 8 at the ``sqrt(D)`` scale: ``||(1/B) U^T U - Id||_F^2`` with ``U = sqrt(D) Z``.

    Zero when the batch is whitened (``(1/B) U^T U = Id``). The same quantity as
    :func:`triclip.losses.tricl.decorrelation` (its mean over the D^2 entries), so it shares its
    one-Gram forward and one-matmul backward: ``D^2 * decorrelation(z)``.

    Args:
        z: L2-normalised features of one tower. Shape: (B, D).

    Returns:
        Scalar.
    """
    dim = z.shape[1]
    return (dim * dim) * decorrelation(z)


@register_loss("spectral")
class SpectralLoss(PairLoss):
    """Spectral contrastive loss (HaoChen et al. 2021) on image-text pairs.

    Terms: ``spectral_loss`` = :func:`spectral_terms` with ``S = Id``. No options; the logit
    scale and the importance are not used. Shape: features (B, D).
    """


    def terms(self, image, text, scale, importance):
        return {"spectral_loss": spectral_terms(image, text)}


@dataclass
class TriCLSpectralConfig:
    """Options of ``tricl_spectral``."""

    dec_weight: float = 1.0  # weight of Eq. 8 (>= 0); 1 is Eq. 9's plain sum

    def __post_init__(self) -> None:
        self.dec_weight = non_negative("dec_weight", self.dec_weight)


@register_loss("tricl_spectral")
class TriCLSpectralLoss(PairLoss):
    """triCL as the paper wrote it: Eq. 6 + Eq. 8 (Eq. 9) on image-text pairs.

    Terms:
        ``spectral_loss``: ``L_tri`` of :func:`spectral_terms` with ``S = diag(w)``.
        ``decorrelation_loss``: ``dec_weight * 0.5 * (L_dec(I) + L_dec(T))``, Eq. 8 on each tower
        (:func:`decorrelation_eq8`). The paper has one encoder and one ``L_dec``; here are two,
        and their mean keeps ``dec_weight = 1`` at Eq. 9's weight (and equals Eq. 8 exactly when
        both towers give the same features).

    ``importance`` (``w``, shape (D,)) is required; gradients reach it through ``L_tri``. Eq. 6
    has the free scale of ``S``: with the squared negative term, ``c S`` is optimal at one ``c``,
    so the trainer makes ``w`` with the paper's plain ``softplus`` form, started flat (``S = Id``),
    not the mean-1 form (docs/CONTRACT.md, "Objectives"). The order is ``argsort(w)`` at the end, which
    is the compact order of :mod:`triclip.compact.features`. The logit scale is not used (nesting, if
    on, uses it). Shape: features (B, D).
    """

    Config = TriCLSpectralConfig
    needs_importance = True
    importance_defaults = {"importance": "softplus", "importance_spread": 1.0}  # Eq. 6's free scale: S = Id at the start

    def terms(self, image, text, scale, importance):
        out = {"spectral_loss": spectral_terms(image, text, importance)}
        if self.config.dec_weight > 0:
            dec = 0.5 * (decorrelation_eq8(image) + decorrelation_eq8(text))
            out["decorrelation_loss"] = self.config.dec_weight * dec
        else:
            out["decorrelation_loss"] = out["spectral_loss"].new_zeros(())
        return out
