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


def _debiased_rows(logits: torch.Tensor, diag: torch.Tensor, tau_plus: float, log_floor: torch.Tensor) -> torch.Tensor:
    """Per-row debiased term of one direction, from the row's cross-entropy.

    With ``pos = exp(L_ii)``, ``sum_all = sum_j exp(L_ij)``, ``B = N + 1``:
    ``pos + (sum_neg - tau*N*pos)/(1-tau) = (sum_all - tau*B*pos)/(1-tau)``, so the unclamped
    term ``log(pos + Ng) - L_ii`` is ``ce + log(1 - tau*B*exp(-ce)) - log(1 - tau)`` with
    ``ce = logsumexp(L_i) - L_ii``, defined where ``tau*B*exp(-ce) < 1``. The clamped term
    (``Ng = N*exp(-s)``) is ``log(1 + exp(log N - s - L_ii))``. The term grows with ``Ng``,
    so ``max`` over ``Ng`` is ``max`` over the two terms; ``torch.where`` picks it, with both
    branches finite (no NaN gradient from the branch not taken).

    Shape: logits (B, B), diag (B,), result (B,).
    """
    ce = F.cross_entropy(logits, torch.arange(logits.shape[0], device=logits.device), reduction="none")  # (B,)
    clamped = torch.logaddexp(log_floor - diag, torch.zeros_like(diag))  # (B,)
    if tau_plus == 0.0:
        return torch.where(ce >= clamped, ce, clamped)
    log_x = math.log(tau_plus * logits.shape[0]) - ce  # (B,) log(tau*B*pos/sum_all)
    unclamped = ce + log1mexp(log_x) - math.log1p(-tau_plus)  # (B,)
    return torch.where((log_x < 0) & (unclamped >= clamped), unclamped, clamped)


def debiased_infonce(logits: torch.Tensor, scale: torch.Tensor, tau_plus: float) -> torch.Tensor:
    """Debiased InfoNCE (Chuang et al. 2020, eq. 6 with the clamp), both directions.

    Row i: ``pos = exp(L_ii)``, ``neg_j = exp(L_ij)`` (j != i), ``N = B - 1``,
    ``Ng = max((sum_j neg_j - tau_plus*N*pos) / (1 - tau_plus), N*exp(-s))``, term
    ``-log(pos / (pos + Ng))``; averaged over rows and over image->text and text->image.
    Computed in log space: no ``exp`` of a logit is ever formed, so ``s = 100`` is safe in fp32.

    Args:
        logits: ``L = s * (image-text similarity)``. Shape: (B, B).
        scale: the logit scale ``s`` (the clamp floor is ``N*exp(-s)``). Shape: ().
        tau_plus: class prior of false negatives, in [0, 1); 0 gives symmetric InfoNCE.

    Returns:
        Scalar loss.
    """
    batch = logits.shape[0]
    diag = logits.diagonal()  # (B,)
    log_floor = math.log(batch - 1) - scale  # () log(N * exp(-s))
    i2t = _debiased_rows(logits, diag, tau_plus, log_floor)
    t2i = _debiased_rows(logits.t(), diag, tau_plus, log_floor)
    return 0.5 * (i2t.mean() + t2i.mean())


@register_loss("infonce")
class InfoNCELoss(PairLoss):
    """Symmetric InfoNCE of CLIP (Radford et al. 2021, https://arxiv.org/abs/2103.00020).

    Cross-entropy of ``s * I @ T.T`` against the diagonal, averaged over both directions.
    No options. Returns ``{"contrastive_loss"}``. Shape: features (B, D).
    """

    def terms(self, image, text, scale, importance):
        return {"contrastive_loss": symmetric_infonce(scale * image @ text.t())}  # logits (B, B)


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
        logits = scale * image @ text.t()  # (B, B)
        return {"contrastive_loss": debiased_infonce(logits, scale, self.config.tau_plus)}
