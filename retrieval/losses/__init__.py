"""Objectives (SPEC, "Objectives"): ``build_loss(name, **options)`` and the registered losses.

A loss is called as ``loss(image_features, text_features, logit_scale, importance=None)``
and returns ``{"<term>_loss": scalar}``; the training objective is the sum of the terms.
Every loss uses the global batch under ``torch.distributed`` (:mod:`retrieval.distributed`).
"""

from retrieval.losses.base import PairLoss
from retrieval.losses.registry import LOSSES, LossConfigError, available_losses, build_loss, loss_options, register_loss

# one module per family; importing them registers their losses
from retrieval.losses import infonce, tricl, hard_negative, align_uniform, margin, sigmoid  # noqa: E402,F401  isort: skip

__all__ = [
    "LOSSES",
    "LossConfigError",
    "PairLoss",
    "available_losses",
    "build_loss",
    "loss_options",
    "register_loss",
]
