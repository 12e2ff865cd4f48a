"""Pairwise sigmoid loss of SigLIP (Zhai et al. 2023).

Paper: "Sigmoid Loss for Language Image Pre-Training", https://arxiv.org/abs/2303.15343.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from triclip.losses.base import PairLoss, number
from triclip.losses.registry import register_loss

SIGLIP_INIT_LOGIT_SCALE = 10.0  # SigLIP's initial scale (t' = log 10), the partner of bias -10


@dataclass
class SigmoidConfig:
    """Options of ``sigmoid``."""

    bias_init: float = -10.0  # initial learnable bias b (SigLIP: -10, with logit scale 10)

    def __post_init__(self) -> None:
        self.bias_init = number("bias_init", self.bias_init)


@register_loss("sigmoid")
class SigmoidLoss(PairLoss):
    """SigLIP (Zhai et al. 2023, https://arxiv.org/abs/2303.15343): a binary logistic loss per pair.

    ``logit_ij = s * <I_i, T_j> + b``, label ``z_ij = 1`` for ``i == j`` else ``-1``;
    ``sigmoid_loss = -(1/B) * sum_{i,j} log sigmoid(z_ij * logit_ij)`` over the global batch.

    The bias ``b`` is a parameter of this module (``self.bias``): the trainer must put the
    loss's parameters in the optimizer (no weight decay). Under DDP every rank computes
    the same global loss, so ``b``'s gradient is already identical across ranks. SigLIP
    pairs ``b = -10`` with an initial logit scale of 10 (:data:`SIGLIP_INIT_LOGIT_SCALE`).
    Shape: features (B, D).
    """

    Config = SigmoidConfig

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.bias = nn.Parameter(torch.tensor(self.config.bias_init))

    def terms(self, image, text, scale, importance):
        batch = image.shape[0]
        bias = self.bias.to(device=image.device, dtype=image.dtype)
        logits = scale * image @ text.t() + bias  # (B, B)
        signs = 2.0 * torch.eye(batch, dtype=image.dtype, device=image.device) - 1.0  # (B, B)
        return {"sigmoid_loss": -F.logsigmoid(signs * logits).sum() / batch}
