"""triclip.model.run.frozen_tower_keys: what a run leaves out of its weights file, from public torch calls only."""

from triclip.model.model import ModelConfig, build_model
from triclip.model.run import frozen_tower_keys


def test_frozen_keys_are_the_frozen_towers_saved_tensors_and_never_a_non_persistent_buffer():
    model = build_model(ModelConfig(preset="tiny", embed_dim=16))
    for p in model.text_tower.parameters():
        p.requires_grad_(False)
    saved = set(model.state_dict())
    non_persistent = {n for n, _ in model.named_buffers() if n not in saved}
    assert non_persistent  # open_clip's text attn_mask: the case the rule must drop

    keys = frozen_tower_keys(model)
    frozen_params = {f"text_tower.{n}" for n, p in model.text_tower.named_parameters()}
    assert frozen_params <= set(keys) <= saved
    assert not set(keys) & non_persistent
    assert not any(k.startswith("image_tower.") for k in keys)  # the image tower still trains
