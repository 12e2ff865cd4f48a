"""Objectives (docs/CONTRACT.md, "Objectives"): ``build_loss(name, **options)`` and the registered losses.

A loss is called as ``loss(image_features, text_features, logit_scale, importance=None)``
and returns ``{"<term>_loss": scalar}``; the training objective is the sum of the terms.
Every loss uses the global batch under ``torch.distributed`` (:mod:`triclip.core.distributed`).

For the trainer:
- a loss may own parameters (``sigmoid``'s bias): put ``loss.parameters()`` in the
  optimizer (no weight decay); their gradients are identical on every rank already;
- ``loss.needs_importance`` is True for ``tricl``, ``tricl_spectral`` and any loss with
  ``nested_order=importance``; ``align_uniform``, ``contrastive``, ``triplet``, ``spectral``
  and ``tricl_spectral`` ignore the logit scale (unless nested by InfoNCE): parameters a loss
  does not use get no gradient (freeze them, or give DDP ``find_unused_parameters=True``);
- the global batch must hold at least 2 pairs (drop a last batch of 1).
"""

from triclip.losses.base import PairLoss
from triclip.losses.nested import NESTED_BY, NESTED_ORDERS, Nested
from triclip.losses.build import build_loss, loss_options, with_defaults
from triclip.losses.registry import LOSSES, LossConfigError, available_losses, register_loss

# one module per family; importing them registers their losses
from triclip.losses import align_uniform, hard_negative, infonce, margin, sigmoid, spectral, tricl  # noqa: E402,F401

__all__ = [
    "LOSSES",
    "LossConfigError",
    "NESTED_BY",
    "NESTED_ORDERS",
    "Nested",
    "PairLoss",
    "available_losses",
    "build_loss",
    "loss_options",
    "register_loss",
    "with_defaults",
]
