"""Objectives (SPEC, "Objectives"): ``build_loss(name, **options)`` and the registered losses.

A loss is called as ``loss(image_features, text_features, logit_scale, importance=None)``
and returns ``{"<term>_loss": scalar}``; the training objective is the sum of the terms.
Every loss uses the global batch under ``torch.distributed`` (:mod:`retrieval.distributed`).

For the trainer:
- a loss may own parameters (``sigmoid``'s bias): put ``loss.parameters()`` in the
  optimizer (no weight decay); their gradients are identical on every rank already;
- ``loss.uses_logit_scale`` is False for ``align_uniform``, ``contrastive``, ``triplet``
  (unless nested) and ``loss.needs_importance`` is True for ``tricl`` and for any loss with
  ``nested_order=importance``: parameters a loss does not
  use get no gradient (freeze them, or give DDP ``find_unused_parameters=True``);
- the global batch must hold at least 2 pairs (drop a last batch of 1).
"""

from retrieval.losses.base import PairLoss
from retrieval.losses.nested import NESTED_ORDERS, Nested
from retrieval.losses.build import build_loss, loss_options, with_defaults
from retrieval.losses.registry import LOSSES, LossConfigError, available_losses, register_loss

# one module per family; importing them registers their losses
from retrieval.losses import align_uniform, hard_negative, infonce, margin, sigmoid, spectral, tricl  # noqa: E402,F401

__all__ = [
    "LOSSES",
    "LossConfigError",
    "NESTED_ORDERS",
    "Nested",
    "PairLoss",
    "available_losses",
    "build_loss",
    "loss_options",
    "register_loss",
    "with_defaults",
]
