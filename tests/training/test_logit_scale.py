"""The logit scale is clamped on its parameter after each optimizer step (open_clip), so its
gradient never dies: a scale past 100 is still pulled by the loss and can come back."""

import math

import torch

from triclip.model.model import MAX_LOGIT_SCALE, ModelConfig, build_model
from triclip.training.batches import Batch
from triclip.training.train import _train_step

LN_100 = math.log(MAX_LOGIT_SCALE)


def _model():
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny", embed_dim=8))


def test_a_parameter_above_ln_100_still_gets_a_gradient():
    model = _model()
    with torch.no_grad():
        model.logit_scale_param.fill_(LN_100 + 0.5)
    loss = model.logit_scale()  # any loss that depends on s
    loss.backward()
    grad = model.logit_scale_param.grad
    assert grad is not None and float(grad) > 0  # d exp(p)/dp = exp(p): alive past ln 100
    assert float(model.logit_scale().detach()) > MAX_LOGIT_SCALE  # not clamped inside the forward


class _ScaleLoss(torch.nn.Module):
    """A step module whose loss only wants a larger logit scale."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return {"scale_loss": -self.model.logit_scale()}


def test_the_trainer_clamps_after_the_optimizer_step():
    model = _model()
    with torch.no_grad():
        model.logit_scale_param.fill_(LN_100 - 0.01)
    optimizer = torch.optim.SGD([model.logit_scale_param], lr=1.0)
    seen = {}
    model.logit_scale_param.register_hook(lambda g: seen.setdefault("grad", float(g)) and None)
    batch = Batch(torch.zeros(2, 1), torch.zeros(2, 1), True, True, 2)
    _train_step(_ScaleLoss(model), batch, optimizer, model, grad_clip=0.0, device=torch.device("cpu"))
    assert seen["grad"] < 0  # the loss pushed the scale up, past ln 100 (the step was ~ +100)
    assert float(model.logit_scale_param.detach()) == torch.tensor(LN_100).item()  # then clamped on the parameter
    assert abs(float(model.logit_scale().detach()) - MAX_LOGIT_SCALE) < 1e-3

    with torch.no_grad():
        model.logit_scale_param.fill_(-3.0)
    model.clamp_logit_scale_()
    assert float(model.logit_scale_param.detach()) == 0.0  # and never below ln 1 (open_clip: clamp(0, ln 100))
