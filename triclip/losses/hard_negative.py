"""Hard-negative contrastive loss, HCL (Robinson et al. 2021), for image-text pairs.

Paper: "Contrastive Learning with Hard Negative Samples", ICLR 2021,
https://arxiv.org/abs/2010.04592 (code: joshr17/HCL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from triclip.losses.base import PairLoss, log1mexp, non_negative, tau_plus_value
from triclip.losses.registry import register_loss


def _hcl_rows(logits: torch.Tensor, beta: float, tau_plus: float, scale: torch.Tensor) -> torch.Tensor:
    """Per-row HCL term of one direction, in log space.

    Row i, over the ``N = B - 1`` negatives ``neg_j = exp(L_ij)``: ``imp_j = neg_j**beta``,
    ``R = sum_j imp_j * neg_j / mean_j imp_j``, ``Ng = max((R - tau*N*pos) / (1 - tau), N*exp(-s))``,
    term ``-log(pos / (pos + Ng))``. ``log R = lse((1+beta) L) - lse(beta L) + log N``;
    ``log(R - tau*N*pos) = log R + log(1 - exp(log(tau*N) + L_ii - log R))`` where that
    exponent is < 0, else the floor binds. Both ``torch.where`` branches stay finite.

    Shape: logits (B, B), scale (), result (B,).
    """
    batch = logits.shape[0]
    n = batch - 1
    eye = torch.eye(batch, dtype=torch.bool, device=logits.device)
    diag = logits.diagonal()  # (B,)
    log_r = (
        torch.logsumexp(((1.0 + beta) * logits).masked_fill(eye, -math.inf), dim=1)
        - torch.logsumexp((beta * logits).masked_fill(eye, -math.inf), dim=1)
        + math.log(n)
    )  # (B,)
    log_floor = math.log(n) - scale  # ()
    clamped = torch.logaddexp(log_floor - diag, torch.zeros_like(diag))  # log(pos + floor) - L_ii
    if tau_plus == 0.0:
        log_ng, usable = log_r, torch.ones_like(diag, dtype=torch.bool)
    else:
        expo = math.log(tau_plus * n) + diag - log_r  # (B,) log(tau*N*pos / R)
        log_ng = log_r + log1mexp(expo) - math.log1p(-tau_plus)
        usable = expo < 0
    unclamped = torch.logaddexp(diag, log_ng) - diag  # (B,)
    return torch.where(usable & (unclamped >= clamped), unclamped, clamped)


@dataclass
class HardNegativeConfig:
    """Options of ``hard_negative``."""

    beta: float = 1.0  # concentration on hard negatives (>= 0; 0 gives ``debiased``); HCL's default
    tau_plus: float = 0.1  # class prior of false negatives, [0, 1); HCL's default

    def __post_init__(self) -> None:
        self.beta = non_negative("beta", self.beta)
        self.tau_plus = tau_plus_value(self.tau_plus)


@register_loss("hard_negative")
class HardNegativeLoss(PairLoss):
    """HCL (Robinson et al. 2021, https://arxiv.org/abs/2010.04592), symmetric.

    Negatives reweighted by ``neg**beta`` normalised by its mean over the row's negatives,
    then the ``debiased`` correction and clamp; averaged over rows and both directions
    (see :func:`_hcl_rows`). ``beta=0`` equals ``debiased``. Returns ``{"contrastive_loss"}``.
    Shape: features (B, D).
    """

    Config = HardNegativeConfig

    def terms(self, image, text, scale, importance):
        logits = scale * image @ text.t()  # (B, B)
        beta, tau = self.config.beta, self.config.tau_plus
        loss = 0.5 * (_hcl_rows(logits, beta, tau, scale).mean() + _hcl_rows(logits.t(), beta, tau, scale).mean())
        return {"contrastive_loss": loss}
