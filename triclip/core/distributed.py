"""The global batch under ``torch.distributed``: all-gather with gradients kept for the local slice.

Every objective is defined on the global batch (docs/CONTRACT.md, "Notation"). Each rank gathers
the image and text features of all ranks and evaluates the *same* global loss. The
gather's backward sums the incoming gradients over ranks and returns the local slice,
as ``torch.distributed.nn.functional.all_gather`` and open_clip's
``gather_with_grad=True`` do. With DDP's gradient averaging over ``W`` ranks the
parameter gradients then equal the one-process gradients on the concatenated batch:
rank ``r`` gets ``W * dL/dx_r`` for its slice, and the average over ranks of
``W * dL/dtheta (through x_r)`` is the full ``dL/dtheta``. Tensors that are not
gathered (logit scale, importance, a loss's own parameters) receive the full global
gradient on every rank, identical across ranks, so averaging leaves them right too.

Ranks may hold different batch sizes (a last, smaller batch): sizes are exchanged
first and the features padded for the collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """Number of processes in the default group; 1 when torch.distributed is not in use."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class _GatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0; backward = all-reduce(sum) of the gradient, local slice kept."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sizes: list[int]) -> torch.Tensor:  # type: ignore[override]
        rank = dist.get_rank()
        longest = max(sizes)
        padded = local.new_zeros((longest,) + tuple(local.shape[1:]))  # (max_b, D)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous())
        ctx.sizes, ctx.rank = sizes, rank
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])  # (B_global, D)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()  # (B_global, D)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None


def _batch_sizes(local: torch.Tensor) -> list[int]:
    """The batch size of every rank (one tiny all-gather)."""
    mine = torch.tensor([local.shape[0]], device=local.device, dtype=torch.long)
    sizes = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, mine)
    return [int(s.item()) for s in sizes]


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    """Concatenate ``local`` from every rank (rank order), differentiable for the local slice.

    The identity when torch.distributed is not initialised or has one process.

    Args:
        local: this rank's rows. Shape: (b, D).

    Returns:
        All ranks' rows in rank order. Shape: (B, D), ``B`` = sum of the ranks' ``b``.
    """
    if world_size() == 1:
        return local
    return _GatherWithGrad.apply(local, _batch_sizes(local))


def gather_features(image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global image and text features (the identity on one process).

    Args:
        image: this rank's image features. Shape: (b, D).
        text: this rank's text features, row i paired with ``image[i]``. Shape: (b, D).

    Returns:
        ``(all_image, all_text)``, pairs kept aligned. Shape: (B, D) each.
    """
    if world_size() == 1:
        return image, text
    if image.shape[0] != text.shape[0]:
        raise ValueError(f"image and text batches differ: {image.shape[0]} vs {text.shape[0]}")
    sizes = _batch_sizes(image)
    return _GatherWithGrad.apply(image, sizes), _GatherWithGrad.apply(text, sizes)
