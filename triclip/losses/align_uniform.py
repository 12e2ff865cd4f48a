"""Alignment and uniformity on the hypersphere (Wang & Isola 2020).

Paper: "Understanding Contrastive Representation Learning through Alignment and
Uniformity on the Hypersphere", ICML 2020, https://arxiv.org/abs/2005.10242.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from triclip.losses.base import PairLoss, non_negative, positive
from triclip.losses.registry import register_loss


def pair_distance_power(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``||a_i - b_i||**alpha`` per row, with a finite gradient where ``a_i == b_i``.

    Shape: a (B, D), b (B, D), result (B,).
    """
    sq = (a - b).square().sum(dim=1)  # (B,)
    if alpha == 2.0:
        return sq
    nonzero = sq > 0
    safe = torch.where(nonzero, sq, torch.ones_like(sq))
    return torch.where(nonzero, safe.pow(alpha / 2.0), torch.zeros_like(sq))


def squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``||a_i - b_j||**2`` for all pairs (expanded form, clamped at 0). Shape: (n, D), (m, D) -> (n, m)."""
    sq = a.square().sum(1, keepdim=True) + b.square().sum(1) - 2.0 * (a @ b.t())  # (n, m)
    return sq.clamp_min(0.0)


def log_uniformity(z: torch.Tensor, t: float) -> torch.Tensor:
    """``log mean_{i != j} exp(-t ||z_i - z_j||**2)`` (log-sum-exp, no underflow). Shape: (B, D) -> ()."""
    batch = z.shape[0]
    eye = torch.eye(batch, dtype=torch.bool, device=z.device)
    scores = (-t * squared_distances(z, z)).masked_fill(eye, -math.inf)  # (B, B)
    return torch.logsumexp(scores.reshape(-1), dim=0) - math.log(batch * (batch - 1))


@dataclass
class AlignUniformConfig:
    """Options of ``align_uniform`` (the paper's defaults)."""

    alpha: float = 2.0  # exponent of the alignment distance (> 0)
    t: float = 2.0  # temperature of the uniformity Gaussian kernel (> 0)
    align_weight: float = 1.0  # weight of align_loss (>= 0)
    unif_weight: float = 1.0  # weight of uniform_loss (>= 0)

    def __post_init__(self) -> None:
        self.alpha = positive("alpha", self.alpha)
        self.t = positive("t", self.t)
        self.align_weight = non_negative("align_weight", self.align_weight)
        self.unif_weight = non_negative("unif_weight", self.unif_weight)


@register_loss("align_uniform")
class AlignUniformLoss(PairLoss):
    """Wang & Isola 2020 (https://arxiv.org/abs/2005.10242) on image-text pairs.

    ``align_loss = align_weight * mean_i ||I_i - T_i||**alpha``;
    ``uniform_loss = unif_weight * 0.5 * (log mean_{i!=j} exp(-t||I_i - I_j||**2) + same for T)``.
    Ignores ``logit_scale`` and ``importance``. Shape: features (B, D).
    """

    Config = AlignUniformConfig

    def terms(self, image, text, scale, importance):
        cfg = self.config
        align = pair_distance_power(image, text, cfg.alpha).mean()
        uniform = 0.5 * (log_uniformity(image, cfg.t) + log_uniformity(text, cfg.t))
        return {"align_loss": cfg.align_weight * align, "uniform_loss": cfg.unif_weight * uniform}
