"""triclip.training.optim.AdamW: equals torch's AdamW without block groups; block groups keep relative step sizes."""

import pytest
import torch

from triclip.training.optim import AdamW


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw(weight_decay):
    torch.manual_seed(0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True)]
    b = [p.detach().clone().requires_grad_(True) for p in a]
    ours = AdamW([{"params": a}], lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=weight_decay)
    ref = torch.optim.AdamW([{"params": b}], lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=weight_decay)
    for step in range(20):
        grads = [torch.randn_like(p) for p in a]
        for params, opt in ((a, ours), (b, ref)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_block_group_steps_are_proportional_to_the_gradient():
    theta = torch.zeros(4, requires_grad=True)
    plain = torch.zeros(4, requires_grad=True)
    opt = AdamW([{"params": [theta], "block": True}, {"params": [plain]}], lr=0.1)
    grad = torch.tensor([-4.0, -2.0, -1.0, -0.5])
    theta.grad, plain.grad = grad.clone(), grad.clone()
    opt.step()
    torch.testing.assert_close(theta / theta[0], grad / grad[0])  # relative sizes survive
    torch.testing.assert_close(plain, torch.full((4,), 0.1), rtol=1e-4, atol=1e-6)  # per-coordinate: all equal
    rms = float((theta.detach().square().mean()).sqrt())
    assert abs(rms - 0.1) < 1e-4  # the block still moves at lr on average
