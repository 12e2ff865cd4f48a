"""The lite1 / lite2 presets: larger EfficientNet-Lite image towers at their own resolution, same text tower."""

import pytest
import torch
from PIL import Image

from triclip.model.model import LITE_PRESETS, ModelConfig, build_model
from triclip.model.unlock import split_tower, tower_groups


@pytest.mark.parametrize("preset, size", [("lite1", 240), ("lite2", 260)])
def test_preset_builds_with_its_resolution_and_lite_options(preset, size):
    model = build_model(ModelConfig(preset=preset, embed_dim=8, text_max_length=12)).eval()
    assert preset in LITE_PRESETS and model.image_tower.variant == int(preset[-1])
    x = model.image_transform(train=False)(Image.new("RGB", (500, 300), (10, 200, 30)))
    assert x.shape == (3, size, size)
    assert model.tokenize(["word " * 50])["input_ids"].shape == (1, 12)  # --text-max-length applies
    with torch.no_grad():
        z = model.encode_image(x.unsqueeze(0))
    assert z.shape == (1, 8) and torch.isclose(z.norm(), torch.tensor(1.0))


def test_trainer_gives_larger_lite_presets_the_lite_defaults():
    from triclip.training.config import recipe_for

    for preset in LITE_PRESETS:
        assert recipe_for(preset) == recipe_for("lite") and recipe_for(preset).head == "mlp"


@torch.no_grad()
def test_lite2_image_tower_splits_at_every_group():
    model = build_model(ModelConfig(preset="lite2", embed_dim=8)).eval()
    tower = model.image_tower
    assert tower_groups(tower) == 8
    images = torch.randn(2, 3, 260, 260, generator=torch.Generator().manual_seed(0))
    reference = tower(images)
    for n in (1, 4, 8):
        bottom, top = split_tower(tower, n)
        torch.testing.assert_close(top(bottom(images)), reference, rtol=1e-5, atol=1e-5)
