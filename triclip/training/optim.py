"""AdamW with an optional *block* second moment, for the importance parameter.

Adam divides each coordinate's step by that coordinate's own gradient RMS, so every
coordinate whose gradient keeps its sign moves at about ``lr`` per step, however
small its gradient. For the tri-factor importance that is exactly wrong: theta's
coordinates all get gradients of the same sign early on (every dimension helps a
little), so Adam grows them uniformly and the importance never separates the
dimensions (the naive port's symptom). A group with ``block=True`` keeps one second
moment for the whole tensor (the mean of g^2 over its coordinates), so the step of
coordinate d is proportional to its own gradient: dimensions that carry more of the
alignment grow faster.

Without ``block`` groups this is ``torch.optim.AdamW`` (same math; tested).
"""

from __future__ import annotations

import torch


class AdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101) with per-group ``block``.

    Args:
        params: tensors or groups; a group may set ``block=True`` (see module docstring).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        if lr <= 0 or eps <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"bad AdamW settings: lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, block=False))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros((), dtype=p.dtype, device=p.device) if group["block"] else torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                g = p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(g, 1 - beta1)
                square = g.square().mean() if group["block"] else g.square()
                state["exp_avg_sq"].mul_(beta2).add_(square, alpha=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**t))
        return loss
