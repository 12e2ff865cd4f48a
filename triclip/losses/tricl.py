"""Tri-factor contrastive learning (Zhang, Wang & Wang 2023), ported to image-text pairs.

Paper: "Identifiable Contrastive Learning with Automatic Feature Importance Discovery",
NeurIPS 2023, https://arxiv.org/abs/2310.18904 (code: PKU-ML/Tri-factor-Contrastive-Learning).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triclip.losses.base import PairLoss, non_negative, tau_plus_value
from triclip.losses.infonce import debiased_infonce, symmetric_infonce
from triclip.losses.registry import register_loss


class _Decorrelation(torch.autograd.Function):
    """``mean(((D/B) Z^T Z - Id)**2)`` with a hand-written backward: one matmul instead of two.

    Forward forms the smaller Gram matrix: ``G = Z^T Z`` (D, D) when ``B >= D``, else
    ``K = Z Z^T`` (B, B), using ``||Z^T Z||_F = ||Z Z^T||_F`` and ``trace(Z^T Z) = ||Z||_F^2``.
    Backward (``c = D/B``): ``d/dZ = 4c/D^2 * Z (cG - Id)``, or ``4c/D^2 * (cK Z - Z)``.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        batch, dim = z.shape
        c = dim / batch
        if batch >= dim:
            resid = c * (z.t() @ z)  # (D, D)
            resid.diagonal().sub_(1.0)  # cG - Id
            value = resid.square().mean()
        else:
            resid = z @ z.t()  # (B, B) K
            value = (c * c * resid.square().sum() - 2.0 * c * z.square().sum() + dim) / (dim * dim)
        ctx.save_for_backward(z, resid)
        return value

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        z, resid = ctx.saved_tensors
        batch, dim = z.shape
        c = dim / batch
        if batch >= dim:
            dz = z @ resid  # (B, D)
        else:
            dz = torch.addmm(z, resid, z, beta=-1.0, alpha=c)  # c K Z - Z, (B, D)
        return dz * (grad * (4.0 * c / (dim * dim)))


def decorrelation(z: torch.Tensor) -> torch.Tensor:
    """``mean(((D/B) * Z.T @ Z - Id)**2)``: zero when ``D * E[z z^T] = Id`` (uniform on the sphere).

    Exact for any shape at the cost of one ``min(B, D)``-sized Gram matrix forward and
    one matmul backward (see :class:`_Decorrelation`; not twice differentiable).

    Args:
        z: features of one tower. Shape: (B, D).

    Returns:
        Scalar.
    """
    return _Decorrelation.apply(z)


@dataclass
class TriCLConfig:
    """Options of ``tricl``."""

    dec_weight: float = 10.0  # weight of decorrelation_loss (>= 0); ~1/B if uniform, ~1 if collapsed; 10: docs/results.md, "Earlier evidence"
    tau_plus: float = 0.0  # > 0: debiased correction (Chuang et al.) on the tri-factor logits, [0, 1)
    renormalize: bool = False  # True: cosine of sqrt(w) * I and sqrt(w) * T (as the top-m embedding scores)

    def __post_init__(self) -> None:
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"renormalize must be a bool, got {self.renormalize!r}")
        self.dec_weight = non_negative("dec_weight", self.dec_weight)
        self.tau_plus = tau_plus_value(self.tau_plus)


@register_loss("tricl")
class TriCLLoss(PairLoss):
    """Tri-factor contrastive loss: InfoNCE on ``s * (I * w) @ T.T`` plus decorrelation.

    Terms:
        ``contrastive_loss``: symmetric cross-entropy of the tri-factor logits
        ``L = s * I diag(w) T^T`` against the diagonal; with ``tau_plus > 0`` the debiased
        correction of ``debiased`` on the same logits, clamp floor ``N*exp(-s)`` as docs/CONTRACT.md
        writes it. (With the importance in the logits the smallest possible ``neg_j`` is
        ``exp(-s*max(w))``, not ``exp(-s)``; any positive floor keeps ``Ng > 0``, which is the
        clamp's job, so that floor is kept: it binds a little earlier when ``max(w) > 1``.)
        ``decorrelation_loss``: ``dec_weight * 0.5 * sum_{Z in {I, T}} mean(((D/B) Z^T Z - Id)**2)``
        on the global batch (see :func:`decorrelation`).
        ``nested_loss`` (with ``nested=L > 0``, like every objective): the nesting wrapper of
        :mod:`triclip.losses.nested`, by default on the importance order (``sqrt(w)``-weighted
        top-m embedding, what a compact index serves); ``nested_order=prefix`` for MRL's prefix.

    ``importance`` (``w``, shape (D,)) is required; gradients reach it through the logits.
    Nested by default (``nested=4`` on the importance order): the trained top-m scores are
    what a compact index serves (docs/results.md).
    The trainer must put the model's importance parameter ``theta`` in the optimizer
    without weight decay. Shape: features (B, D).
    """

    Config = TriCLConfig
    nesting_defaults = {"nested": 4}  # on the importance order: the nesting default of an objective that reads w
    needs_importance = True

    def terms(self, image, text, scale, importance):
        logits = (image * (importance * scale)) @ text.t()  # (B, B)
        if self.config.renormalize:  # divide by ||sqrt(w) I_i|| ||sqrt(w) T_j||
            image_norm = (image.square() @ importance).sqrt()  # (B,)
            text_norm = (text.square() @ importance).sqrt()  # (B,)
            logits = logits / image_norm[:, None] / text_norm[None, :]
        if self.config.tau_plus > 0:
            contrastive = debiased_infonce(logits, scale, self.config.tau_plus)
        else:
            contrastive = symmetric_infonce(logits)
        out = {"contrastive_loss": contrastive}
        if self.config.dec_weight > 0:
            dec = 0.5 * (decorrelation(image) + decorrelation(text))
            out["decorrelation_loss"] = self.config.dec_weight * dec
        else:
            out["decorrelation_loss"] = contrastive.new_zeros(())
        return out
