"""What every objective shares: input checks, the global batch, fp32 maths, option checks.

A loss subclasses :class:`PairLoss`, names its options in a ``@dataclass`` ``Config``
and implements :meth:`PairLoss.terms` on the checked, gathered, upcast features.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from triclip.core.distributed import gather_features

TINY = 1e-30  # keeps log(-expm1(u)) and its gradient finite at u -> 0- (value change < 1e-30)


@dataclass
class NoOptions:
    """Config of a loss without options."""


def number(name: str, value: object) -> float:
    """``value`` as a float; ValueError for a bool, a string or a non-finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def tau_plus_value(value: object) -> float:
    """Checked class prior ``tau_plus`` of the debiased correction, in [0, 1)."""
    tau = number("tau_plus", value)
    if not 0.0 <= tau < 1.0:
        raise ValueError(f"tau_plus must be in [0, 1), got {value!r}")
    return tau


def non_negative(name: str, value: object) -> float:
    """Checked number >= 0."""
    x = number(name, value)
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return x


def positive(name: str, value: object) -> float:
    """Checked number > 0."""
    x = number(name, value)
    if x <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return x


def log1mexp(u: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(u))`` for ``u < 0``, finite value and gradient (``u`` is clamped to ``<= -TINY``)."""
    return torch.log(-torch.expm1(u.clamp(max=-TINY)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Losses compute in float64 for float64 inputs, else in float32 (bf16/fp16 are upcast)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_features(image: torch.Tensor, text: torch.Tensor) -> None:
    for what, x in (("image_features", image), ("text_features", text)):
        if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point():
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{what} must be a floating (batch, dim) tensor, got {got}")
    if image.shape != text.shape:
        shapes = f"{tuple(image.shape)} and {tuple(text.shape)}"
        raise ValueError(f"image and text features must have the same shape, got {shapes}")


def _scale_tensor(logit_scale: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    if isinstance(logit_scale, torch.Tensor):
        s = logit_scale.to(like.device)
    else:  # a Python number: keep its full precision until the compute dtype is known
        s = torch.as_tensor(logit_scale, dtype=torch.float64, device=like.device)
    if s.numel() != 1:
        raise ValueError(f"logit_scale must be a scalar, got shape {tuple(s.shape)}")
    return s.reshape(())


def _importance_tensor(importance: torch.Tensor | None, dim: int, loss: str) -> torch.Tensor:
    if importance is None:
        raise ValueError(f"loss {loss!r} needs the importance vector w (D,), got None")
    if not isinstance(importance, torch.Tensor) or importance.shape != (dim,):
        got = tuple(importance.shape) if isinstance(importance, torch.Tensor) else type(importance).__name__
        raise ValueError(f"importance must have shape ({dim},), got {got}")
    return importance


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for the loss maths (entering the context costs ~50 us, so only when it is on)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


class PairLoss(nn.Module):
    """Base of every objective: ``loss(image, text, logit_scale, importance=None) -> {name_loss: scalar}``.

    The forward checks the inputs, gathers the global batch (:func:`gather_features`),
    turns autocast off and upcasts bf16/fp16 to float32 (float64 stays float64), then
    calls :meth:`terms`. Every row ``i`` of ``image`` and ``text`` is a positive pair.
    """

    Config: ClassVar[type] = NoOptions  # the options dataclass
    name: ClassVar[str] = ""  # set by @register_loss
    needs_importance: ClassVar[bool] = False  # True: importance must be given (D,)
    # The loss's own defaults, the one place they live: ``build_loss(name)`` and ``train --loss name`` both apply
    # them (config.json records them). nesting_defaults: nesting options unless given (mrl: nested=4, prefix);
    # importance_defaults: how the model makes w when the objective trains it (TrainConfig fields importance /
    # importance_spread), unless given (tricl_spectral: softplus started flat).
    nesting_defaults: ClassVar[dict] = {}
    importance_defaults: ClassVar[dict] = {}

    def __init__(self, **options) -> None:
        super().__init__()
        self.config = self.Config(**options)

    def extra_repr(self) -> str:
        return repr(self.config)

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        importance: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Named loss terms on the global batch.

        Args:
            image_features: this rank's image features ``I``, L2-normalised. Shape: (batch, dim).
            text_features: this rank's text features ``T``, row i paired with image i. Shape: (batch, dim).
            logit_scale: ``s``, the already exponentiated scale (may require grad). Shape: ().
            importance: ``w``, non-negative. Shape: (dim,). Required by losses with ``needs_importance``.

        Returns:
            ``{"<term>_loss": scalar}`` (float32, or float64 for float64 inputs); the objective is their sum.
        """
        _check_features(image_features, text_features)
        scale = _scale_tensor(logit_scale, image_features)
        w = _importance_tensor(importance, image_features.shape[1], self.name) if self.needs_importance else None
        image, text = gather_features(image_features, text_features)  # (B, D) each, global batch
        if image.shape[0] < 2:
            raise ValueError(f"loss {self.name!r} needs at least 2 pairs in the (global) batch, got {image.shape[0]}")
        dtype = compute_dtype(image.dtype)
        with _no_autocast(image.device.type):
            return self.terms(
                image.to(dtype),
                text.to(dtype),
                scale.to(dtype),
                None if w is None else w.to(device=image.device, dtype=dtype),
            )

    def terms(
        self, image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, importance: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The loss terms on the checked global batch; see :meth:`forward`. Shape: (B, D) features."""
        raise NotImplementedError
