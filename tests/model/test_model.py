"""DualEncoder: presets, shapes, importance forms, locking, clear errors."""

import math

import pytest
import torch
from PIL import Image

from triclip.core.errors import UserError
from triclip.model.model import IMPORTANCE_FORMS, MAX_LOGIT_SCALE, ModelConfig, build_model, initial_theta


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny", embed_dim=32))


def test_tiny_shapes_and_normalisation(tiny):
    image = tiny.image_transform()(Image.new("RGB", (80, 50), "red"))
    assert image.shape == (3, 64, 64)
    zi = tiny.encode_image(image[None].repeat(3, 1, 1, 1))
    zt = tiny.encode_text(["a red circle", "two blue squares", ""])
    assert zi.shape == (3, 32) and zt.shape == (3, 32)
    assert torch.allclose(zi.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.allclose(zt.norm(dim=1), torch.ones(3), atol=1e-5)
    raw = tiny.encode_text(["a red circle"], normalize=False)
    assert not torch.allclose(raw.norm(dim=1), torch.ones(1))


def test_tiny_is_cpu_sized(tiny):
    n = sum(p.numel() for p in tiny.parameters())
    assert 1e6 < n < 2e7


def test_importance_starts_at_one_and_is_trainable(tiny):
    w = tiny.importance()
    assert torch.allclose(w, torch.ones_like(w), atol=1e-6)
    (w * torch.arange(w.numel())).sum().backward()  # (sum(w) itself is constant under the mean-1 form)
    assert tiny.theta.grad is not None and tiny.theta.grad.abs().sum() > 0
    tiny.zero_grad()


def test_logit_scale_init_and_clamp(tiny):
    assert math.isclose(float(tiny.logit_scale().detach()), 1 / 0.07, rel_tol=1e-5)
    with torch.no_grad():
        tiny.logit_scale_param.fill_(10.0)
    assert float(tiny.logit_scale().detach()) > MAX_LOGIT_SCALE  # exp(param): no clamp inside (its gradient lives)
    with torch.no_grad():
        tiny.clamp_logit_scale_()  # what the trainer does after each optimizer step
    assert math.isclose(float(tiny.logit_scale().detach()), MAX_LOGIT_SCALE, rel_tol=1e-6)
    with torch.no_grad():
        tiny.logit_scale_param.fill_(math.log(1 / 0.07))


def test_mean1_importance_cannot_absorb_a_global_scale():
    model = build_model(ModelConfig(preset="tiny", embed_dim=16, importance="softplus_mean1"))
    with torch.no_grad():
        model.theta.copy_(torch.linspace(-2, 3, 16))
    assert torch.isclose(model.importance().mean(), torch.tensor(1.0))
    assert set(IMPORTANCE_FORMS) >= {"softplus", "softplus_mean1"}


def test_lock_freezes_towers_only():
    model = build_model(ModelConfig(preset="tiny", embed_dim=16))
    model.lock(image=True, text=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"logit_scale_param", "theta", "image_head.weight", "text_head.weight"}
    model.train()
    assert not model.image_tower.training and not model.text_tower.training


def test_unknown_preset_and_offline_pretrained_are_user_errors():
    with pytest.raises(UserError, match="unknown model"):
        build_model(ModelConfig(preset="no-such-model"))
    with pytest.raises(UserError, match="pretrained"):
        build_model(ModelConfig(preset="tiny", pretrained="openai"))


def test_open_clip_architecture_from_scratch():
    model = build_model(ModelConfig(preset="RN50", embed_dim=8))
    assert model.embed_dim == 8
    z = model.encode_text(["hello"])
    assert z.shape == (1, 8)


def test_text_max_length_truncates_lite_captions_and_is_refused_elsewhere():
    model = build_model(ModelConfig(preset="lite", embed_dim=8, text_max_length=12))
    tokens = model.tokenize(["word " * 100, "short"])
    assert tokens["input_ids"].shape == (2, 12)
    assert model.text_tower.max_length == 12
    with pytest.raises(UserError, match="lite preset"):
        build_model(ModelConfig(preset="tiny", text_max_length=12))


def test_importance_spread_starts_w_as_a_geometric_ramp():
    w = torch.nn.functional.softplus(initial_theta(5, spread=100.0))
    torch.testing.assert_close(w, torch.tensor([1.0, 10**-0.5, 0.1, 10**-1.5, 0.01]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.nn.functional.softplus(initial_theta(4)), torch.ones(4))
    model = build_model(ModelConfig(preset="tiny", embed_dim=8, importance="softplus_mean1", importance_spread=10.0))
    w = model.importance()
    assert torch.isclose(w.mean(), torch.tensor(1.0)) and bool((w[:-1] > w[1:]).all())
    with pytest.raises(UserError, match="spread must be >= 1"):
        initial_theta(4, spread=0.5)


def test_residual_head_is_its_affine_map_once_loaded_and_then_trains_its_branch():
    from triclip.model.model import ResidualHead

    torch.manual_seed(0)
    head, affine = ResidualHead(12, 5), torch.nn.Linear(12, 5)
    x = torch.randn(7, 12)
    assert not torch.allclose(head(x), affine(x))
    head.load_affine(affine.weight.detach(), affine.bias.detach())
    torch.testing.assert_close(head(x), affine(x), rtol=0, atol=1e-6)  # (B, D): exactly the affine map
    head(x).pow(2).sum().backward()
    assert float(head.branch[-1].weight.grad.abs().max()) > 0  # the branch learns from the first step
    assert float(head.skip.weight.grad.abs().max()) > 0
    bigger = build_model(ModelConfig(preset="tiny", embed_dim=8, head="residual"))
    assert {name.split(".")[0] for name, _ in bigger.image_head.named_parameters()} == {"skip", "branch"}
