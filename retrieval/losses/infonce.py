"""Symmetric InfoNCE (CLIP) and its debiased form (Chuang et al. 2020).

- CLIP, Radford et al. 2021: https://arxiv.org/abs/2103.00020
- Debiased contrastive learning, Chuang et al. 2020: https://arxiv.org/abs/2007.00224

Both work on a logits matrix ``L = s * I @ T.T`` (B, B) whose diagonal holds the
positives; :func:`symmetric_infonce` and :func:`debiased_infonce` are reused by the
tri-factor loss on its own logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retrieval.losses.base import PairLoss, log1mexp, tau_plus_value
from retrieval.losses.registry import register_loss


def symmetric_infonce(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the diagonal, averaged over rows and over both directions.

    Args:
        logits: ``L[i, j]`` = score of image i with text j. Shape: (B, B).

    Returns:
        Scalar loss.
    """
    labels = torch.arange(logits.shape[0], device=logits.device)  # (B,)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


def debiased_infonce(logits: torch.Tensor, scale: torch.Tensor, tau_plus: float) -> torch.Tensor:
    """Debiased InfoNCE (Chuang et al. 2020, eq. 6 with the clamp), both directions.

    Row i: ``pos = exp(L_ii)``, ``neg_j = exp(L_ij)`` (j != i), ``N = B - 1``,
    ``Ng = max((sum_j neg_j - tau_plus*N*pos) / (1 - tau_plus), N*exp(-s))``, term
    ``-log(pos / (pos + Ng))``; averaged over rows and over image->text and text->image.

    Computed from each row's cross-entropy ``ce = logsumexp(L_i) - L_ii`` (the fused
    kernel ``infonce`` uses), so no ``exp`` of a logit is formed and ``s = 100`` is safe in
    fp32: with ``sum_all = pos + sum_neg`` and ``B = N + 1``,
    ``pos + (sum_neg - tau*N*pos)/(1-tau) = (sum_all - tau*B*pos)/(1-tau)``, so the unclamped
    term is ``ce + log(1 - tau*B*exp(-ce)) - log(1 - tau)``, defined where
    ``tau*B*exp(-ce) < 1``; the clamped one (``Ng = N*exp(-s)``) is
    ``log(1 + exp(log N - s - L_ii))``, the same in both directions. The term grows with
    ``Ng``, so the ``max`` over ``Ng`` is the ``max`` of the two terms, taken by
    ``torch.where`` with both branches finite (no NaN gradient from the branch not taken).

    Args:
        logits: ``L = s * (image-text similarity)``. Shape: (B, B).
        scale: the logit scale ``s`` (the clamp floor is ``N*exp(-s)``). Shape: ().
        tau_plus: class prior of false negatives, in [0, 1); 0 gives symmetric InfoNCE.

    Returns:
        Scalar loss.
    """
    batch = logits.shape[0]
    labels = torch.arange(batch, device=logits.device)
    ce = torch.stack(
        [F.cross_entropy(logits, labels, reduction="none"), F.cross_entropy(logits.t(), labels, reduction="none")]
    )  # (2, B): image->text, text->image
    log_floor = math.log(batch - 1) - scale  # () log(N * exp(-s))
    clamped = torch.logaddexp(log_floor - logits.diagonal(), ce.new_zeros(()))  # (B,) log(pos + floor) - L_ii
    if tau_plus == 0.0:
        return torch.where(ce >= clamped, ce, clamped).mean()
    log_x = math.log(tau_plus * batch) - ce  # (2, B) log(tau*B*pos/sum_all)
    unclamped = ce + log1mexp(log_x) - math.log1p(-tau_plus)  # (2, B)
    return torch.where((log_x < 0) & (unclamped >= clamped), unclamped, clamped).mean()


@register_loss("infonce")
class InfoNCELoss(PairLoss):
    """Symmetric InfoNCE of CLIP (Radford et al. 2021, https://arxiv.org/abs/2103.00020).

    Cross-entropy of ``s * I @ T.T`` against the diagonal, averaged over both directions.
    No options. Returns ``{"contrastive_loss"}``. Shape: features (B, D).
    """

    def terms(self, image, text, scale, importance):
        return {"contrastive_loss": symmetric_infonce((image * scale) @ text.t())}  # logits (B, B)


@dataclass
class DebiasedConfig:
    """Options of ``debiased``."""

    tau_plus: float = 0.1  # class prior: chance that an in-batch negative shares the positive's class, [0, 1)

    def __post_init__(self) -> None:
        self.tau_plus = tau_plus_value(self.tau_plus)


@register_loss("debiased")
class DebiasedLoss(PairLoss):
    """Debiased InfoNCE (Chuang et al. 2020, https://arxiv.org/abs/2007.00224).

    See :func:`debiased_infonce`; ``tau_plus=0`` equals ``infonce`` (the clamp cannot
    bind for unit-norm features). Returns ``{"contrastive_loss"}``. Shape: features (B, D).
    """

    Config = DebiasedConfig

    def terms(self, image, text, scale, importance):
        logits = (image * scale) @ text.t()  # (B, B)
        return {"contrastive_loss": debiased_infonce(logits, scale, self.config.tau_plus)}
