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

from triclip.losses.base import TINY, PairLoss, tau_plus_value
from triclip.losses.registry import register_loss


class _InfoNCEHead(torch.autograd.Function):
    """Symmetric InfoNCE on a logits matrix, optionally debiased, with a hand-written backward.

    Forward: row and column log-softmax, ``ce = -log p_ii`` per direction (2, B); with the
    floor (``debiased``), the per-row term of :func:`debiased_infonce`. Backward: with
    ``a = d term / d ce`` and ``f = d term / d L_ii`` (floor rows), ``dL = a_r * P_row +
    a_c * P_col - diag(a_r + a_c) + diag(f)``, ``ds = sum(f)``, with the two softmaxes
    recomputed from the saved logits (one (B, B) tensor kept): fewer passes over (B, B) than
    autograd through two cross-entropies. Not twice differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: torch.Tensor, scale: torch.Tensor | None, tau_plus: float, floor: bool
    ) -> torch.Tensor:
        batch = logits.shape[0]
        log_p_row = torch.log_softmax(logits, dim=1)  # (B, B) image->text
        log_p_col = torch.log_softmax(logits, dim=0)  # (B, B) text->image
        ce = -torch.stack([log_p_row.diagonal(), log_p_col.diagonal()])  # (2, B)
        term, d_ce, d_diag = ce, torch.ones_like(ce), None
        if floor:
            z = (math.log(batch - 1) - scale) - logits.diagonal()  # (B,) log(N exp(-s)) - L_ii
            clamped = torch.logaddexp(z, torch.zeros_like(z))  # (B,) log(pos + N exp(-s)) - L_ii
            if tau_plus > 0:
                log_x = math.log(tau_plus * batch) - ce  # (2, B) log(tau*B*pos/sum_all)
                one_minus_x = -torch.expm1(log_x.clamp(max=-TINY))  # (2, B), > 0
                unclamped = ce + torch.log(one_minus_x) - math.log1p(-tau_plus)
                use = (log_x < 0) & (unclamped >= clamped)
            else:
                unclamped, one_minus_x, use = ce, torch.ones_like(ce), ce >= clamped
            term = torch.where(use, unclamped, clamped)
            d_ce = torch.where(use, 1.0 / one_minus_x, 0.0)  # d(ce + log(1 - tau*B*e^-ce))/d ce = 1/(1-x)
            d_diag = torch.where(use, 0.0, -torch.sigmoid(z))  # d softplus(z) / d L_ii, also / d s
        ctx.save_for_backward(logits, d_ce, d_diag)
        return term.mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        logits, d_ce, d_diag = ctx.saved_tensors
        g = grad / d_ce.numel()  # the mean over (2, B)
        a = d_ce * g  # (2, B)
        grad_logits = torch.softmax(logits, dim=1).mul_(a[0].unsqueeze(1))  # d ce_i / d L_ij = p_ij - [i == j]
        grad_logits.addcmul_(torch.softmax(logits, dim=0), a[1].unsqueeze(0))
        on_diag = -(a[0] + a[1])  # (B,)
        grad_scale = None
        if d_diag is not None:
            floor_rows = (d_diag * g).sum(dim=0)  # (B,)
            on_diag = on_diag + floor_rows
            grad_scale = floor_rows.sum()
        grad_logits.diagonal().add_(on_diag)
        return grad_logits, grad_scale, None, None


def symmetric_infonce(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the diagonal, averaged over rows and over both directions (CLIP).

    Args:
        logits: ``L[i, j]`` = score of image i with text j. Shape: (B, B).

    Returns:
        Scalar loss.
    """
    return _InfoNCEHead.apply(logits, None, 0.0, False)


def debiased_infonce(logits: torch.Tensor, scale: torch.Tensor, tau_plus: float) -> torch.Tensor:
    """Debiased InfoNCE (Chuang et al. 2020, eq. 6 with the clamp), both directions.

    Row i: ``pos = exp(L_ii)``, ``neg_j = exp(L_ij)`` (j != i), ``N = B - 1``,
    ``Ng = max((sum_j neg_j - tau_plus*N*pos) / (1 - tau_plus), N*exp(-s))``, term
    ``-log(pos / (pos + Ng))``; averaged over rows and over image->text and text->image.

    Computed from each row's cross-entropy ``ce = logsumexp(L_i) - L_ii``, so no ``exp``
    of a logit is formed and ``s = 100`` is safe in fp32: with ``sum_all = pos + sum_neg``
    and ``B = N + 1``, ``pos + (sum_neg - tau*N*pos)/(1-tau) = (sum_all - tau*B*pos)/(1-tau)``,
    so the unclamped term is ``ce + log(1 - tau*B*exp(-ce)) - log(1 - tau)``, defined where
    ``tau*B*exp(-ce) < 1``; the clamped one (``Ng = N*exp(-s)``) is
    ``log(1 + exp(log N - s - L_ii))``, the same in both directions. The term grows with
    ``Ng``, so the ``max`` over ``Ng`` is the ``max`` of the two terms; the gradient of the
    branch not taken is never formed (no NaN from ``log`` of a non-positive estimate).

    Args:
        logits: ``L = s * (image-text similarity)``. Shape: (B, B).
        scale: the logit scale ``s`` (the clamp floor is ``N*exp(-s)``). Shape: ().
        tau_plus: class prior of false negatives, in [0, 1); 0 gives symmetric InfoNCE.

    Returns:
        Scalar loss.
    """
    return _InfoNCEHead.apply(logits, scale, tau_plus, True)


@register_loss("infonce")
class InfoNCELoss(PairLoss):
    """Symmetric InfoNCE of CLIP (Radford et al. 2021, https://arxiv.org/abs/2103.00020).

    Cross-entropy of ``s * I @ T.T`` against the diagonal, averaged over both directions.
    No options. Returns ``{"contrastive_loss"}``. Shape: features (B, D).
    """

    def terms(self, image, text, scale, importance):
        return {"contrastive_loss": symmetric_infonce((image * scale) @ text.t())}  # logits (B, B)


@register_loss("mrl")
class MRLLoss(InfoNCELoss):
    """Matryoshka Representation Learning (Kusupati et al. 2022, https://arxiv.org/abs/2205.13147) on CLIP.

    ``infonce`` with prefix nesting on by default (``nested=4``, ``nested_order=prefix``):
    ``contrastive_loss`` plus ``nested_loss``, the InfoNCE of the re-normalised first m
    dimensions at m = D/2 ... D/16 (:mod:`triclip.losses.nested`). The same as
    ``build_loss("infonce", nested=4, nested_order="prefix")``; ``nested`` and
    ``nested_weight`` can be changed like for any loss. Shape: features (B, D).
    """

    nesting_defaults = {"nested": 4, "nested_order": "prefix"}


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
