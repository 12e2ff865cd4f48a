"""Margin-based metric-learning baselines: DrLIM contrastive loss and FaceNet triplet loss.

- Hadsell, Chopra & LeCun 2006, "Dimensionality Reduction by Learning an Invariant
  Mapping": http://yann.lecun.com/exdb/publis/pdf/hadsell-chopra-lecun-06.pdf
- Schroff, Kalenichenko & Philbin 2015, "FaceNet": https://arxiv.org/abs/1503.03832

Both ignore ``logit_scale`` and ``importance`` and work on Euclidean distances between
image and text features: for unit vectors a random pair is about ``sqrt(2)`` apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triclip.losses.align_uniform import squared_distances
from triclip.losses.base import PairLoss, non_negative, positive
from triclip.losses.registry import register_loss


def safe_sqrt(sq: torch.Tensor) -> torch.Tensor:
    """``sqrt`` with value and gradient 0 at 0 (instead of an infinite gradient)."""
    nonzero = sq > 0
    return torch.where(nonzero, torch.where(nonzero, sq, torch.ones_like(sq)).sqrt(), torch.zeros_like(sq))


@dataclass
class ContrastiveConfig:
    """Options of ``contrastive``."""

    margin: float = 1.0  # push negatives to distance >= margin (> 0); below sqrt(2) a random pair pays nothing

    def __post_init__(self) -> None:
        self.margin = positive("margin", self.margin)


@register_loss("contrastive")
class ContrastiveLoss(PairLoss):
    """DrLIM contrastive loss (Hadsell et al. 2006) on all image-text pairs of the batch.

    ``d_ij = ||I_i - T_j||``. ``pull_loss = mean_i 0.5 * d_ii**2``;
    ``push_loss = mean_{i != j} 0.5 * max(0, margin - d_ij)**2``. Symmetric in the towers
    (the pair set is). Shape: features (B, D).
    """

    Config = ContrastiveConfig

    def terms(self, image, text, scale, importance):
        batch = image.shape[0]
        pull = 0.5 * (image - text).square().sum(1).mean()
        dist = safe_sqrt(squared_distances(image, text))  # (B, B)
        off = ~torch.eye(batch, dtype=torch.bool, device=image.device)
        push = 0.5 * (self.config.margin - dist).clamp_min(0.0).square()[off].mean()
        return {"pull_loss": pull, "push_loss": push}


def _mine_hardest(dist: torch.Tensor, d_ap: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """The closest negative of each anchor. Shape: (B, B), (B, 1), (B, B) -> (B,)."""
    return dist.masked_fill(eye, float("inf")).amin(dim=1)


def _mine_semihard(dist: torch.Tensor, d_ap: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """FaceNet's semi-hard negative (TensorFlow Addons' rule): the closest negative farther than
    the positive, else the farthest negative. Shape: (B, B), (B, 1), (B, B) -> (B,)."""
    outside = (dist > d_ap) & ~eye  # (B, B) negatives farther than the positive
    closest_outside = dist.masked_fill(~outside, float("inf")).amin(dim=1)
    farthest = dist.masked_fill(eye, -float("inf")).amax(dim=1)
    return torch.where(outside.any(dim=1), closest_outside, farthest)


MINING = {"semihard": _mine_semihard, "hardest": _mine_hardest, "all": None}  # None: every negative


def _triplet_rows(dist: torch.Tensor, margin: float, mining: str) -> torch.Tensor:
    """Mean triplet hinge with anchors on the rows, positives on the diagonal.

    ``all`` averages over every (anchor, negative) pair; the other rules pick one negative
    per anchor (ties go to the lowest index) and average over anchors.

    Shape: dist (B, B) squared distances, result ().
    """
    eye = torch.eye(dist.shape[0], dtype=torch.bool, device=dist.device)
    d_ap = dist.diagonal().unsqueeze(1)  # (B, 1)
    mine = MINING[mining]
    if mine is None:
        return (d_ap - dist + margin).clamp_min(0.0)[~eye].mean()
    return (d_ap.squeeze(1) - mine(dist, d_ap, eye) + margin).clamp_min(0.0).mean()


@dataclass
class TripletConfig:
    """Options of ``triplet``."""

    margin: float = 0.2  # FaceNet's alpha, on squared distances of unit vectors (>= 0)
    mining: str = "semihard"  # negative per anchor: semihard (FaceNet), hardest, or all

    def __post_init__(self) -> None:
        self.margin = non_negative("margin", self.margin)
        if self.mining not in MINING:
            raise ValueError(f"mining must be one of {', '.join(MINING)}, got {self.mining!r}")


@register_loss("triplet")
class TripletLoss(PairLoss):
    """FaceNet triplet loss (Schroff et al. 2015, https://arxiv.org/abs/1503.03832), symmetric.

    ``max(d(a, p) - d(a, n) + margin, 0)`` with FaceNet's squared Euclidean distance
    ``d(x, y) = ||x - y||**2``; anchor ``I_i``, positive ``T_i``, in-batch negatives ``T_j``,
    and the same with the towers swapped; the two directions are averaged. Mining: see
    :func:`_triplet_rows`. Returns ``{"triplet_loss"}``. Shape: features (B, D).
    """

    Config = TripletConfig

    def terms(self, image, text, scale, importance):
        dist = squared_distances(image, text)  # (B, B): rows image anchors, columns texts
        m, mining = self.config.margin, self.config.mining
        loss = 0.5 * (_triplet_rows(dist, m, mining) + _triplet_rows(dist.t(), m, mining))
        return {"triplet_loss": loss}
