"""split_tower: bottom then top computes the tower, on real lite weights and a tiny open_clip model."""

import pytest
import torch
from PIL import Image

from triclip.core.errors import UserError
from triclip.model.model import ModelConfig, build_model
from triclip.model.unlock import augment, epoch_views, partly_lock, split_tower, tower_groups


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny", embed_dim=16)).eval()


@pytest.fixture(scope="module")
def lite():
    return build_model(ModelConfig(preset="lite", embed_dim=16)).eval()


CAPTIONS = ["a red apple on a wooden table", "cat", "two gears and a wrench, clip art"]


@torch.no_grad()
def _check_every_cut(model, size: int):
    images = torch.randn(2, 3, size, size)
    tokens = model.tokenize(CAPTIONS)
    for tower, x in ((model.image_tower, images), (model.text_tower, tokens)):
        reference = tower(x)
        for n in range(1, tower_groups(tower) + 1):
            bottom, top = split_tower(tower, n)
            torch.testing.assert_close(top(bottom(x)), reference, rtol=1e-5, atol=1e-5)


def test_tiny_open_clip_split_equals_tower(tiny):
    assert tower_groups(tiny.image_tower) == 3 and tower_groups(tiny.text_tower) == 2
    _check_every_cut(tiny, 64)


def test_lite_split_equals_tower(lite):
    assert tower_groups(lite.image_tower) == 8  # 7 block stages + the head conv
    assert tower_groups(lite.text_tower) == 6  # MiniLM layers
    _check_every_cut(lite, 224)


@torch.no_grad()
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_lite_text_top_ignores_extra_padding(lite, attention):
    """The cache pads captions to the longest of the data: the top must give the same features,
    with either of BERT's attention kernels (our additive mask is what both take)."""
    lite.text_tower.bert.set_attn_implementation(attention)
    tokens = lite.tokenize(CAPTIONS)
    padded = {k: torch.nn.functional.pad(v, (0, 7)) for k, v in tokens.items()}
    bottom, top = split_tower(lite.text_tower, 2)
    try:
        torch.testing.assert_close(top(bottom(padded)), lite.text_tower(tokens), rtol=1e-4, atol=1e-4)
    finally:
        lite.text_tower.bert.set_attn_implementation("sdpa")


def test_lite_image_top_group_is_the_head_conv(lite):
    bottom, top = split_tower(lite.image_tower, 1)
    net = lite.image_tower.net
    top_params = {id(p) for p in top.parameters()}
    assert top_params == {id(p) for m in (net.conv_head, net.bn2) for p in m.parameters()}
    assert not top_params & {id(p) for p in bottom.parameters()}
    with torch.no_grad():
        h = bottom(torch.zeros(1, 3, 224, 224))
    assert tuple(h["x"].shape) == (1, 320, 7, 7)  # the last block stage's output


def test_partly_lock_freezes_the_bottom_only_and_keeps_the_state_dict(tiny):
    model = build_model(ModelConfig(preset="tiny", embed_dim=16))
    names = list(model.state_dict())
    partly_lock(model, image_groups=1, text_layers=1)
    assert list(model.state_dict()) == names  # checkpoints load into a plain model
    (image_bottom, image_top), (text_bottom, text_top) = model._split["image"], model._split["text"]
    assert all(not p.requires_grad for p in image_bottom.parameters())
    assert all(p.requires_grad for p in image_top.parameters())
    assert all(not p.requires_grad for p in text_bottom.parameters())
    assert all(p.requires_grad for p in text_top.parameters())
    assert model.image_head.weight.requires_grad
    model.train()
    assert not any(m.training for m in image_bottom.modules()) and image_top.training
    assert not any(m.training for m in text_bottom.modules()) and text_top.training


def test_bad_cut_is_one_line(tiny):
    with pytest.raises(UserError, match="3 groups"):
        split_tower(tiny.image_tower, 4)
    with pytest.raises(UserError, match="cannot unlock part"):
        split_tower(torch.nn.Linear(2, 2), 1)


def test_views_are_deterministic_and_view_zero_is_the_image():
    image = Image.new("RGB", (64, 48))
    image.putpixel((0, 0), (255, 0, 0))
    assert augment(image, seed=0, index=3, view=0) is image
    first, again = augment(image, 0, 3, 1), augment(image, 0, 3, 1)
    assert first.tobytes() == again.tobytes()
    sizes = {augment(image, 0, i, 1).size for i in range(20)}
    assert len(sizes) > 1  # random crops
    draws = epoch_views(seed=1, epoch=2, n=1000, views=3)
    assert torch.equal(draws, epoch_views(1, 2, 1000, 3)) and not torch.equal(draws, epoch_views(1, 3, 1000, 3))
    assert set(draws.tolist()) == {0, 1, 2}
    assert not epoch_views(1, 2, 10, 1).any()


def test_lite_image_bottom_cache_is_computed_fast_and_matches_eager(lite, tmp_path, monkeypatch):
    """The one pass below the cut goes through triclip.model.accel (ONNX Runtime / jit), not the eager bottom."""
    import json

    import torch.nn.functional as F

    from triclip.model import accel
    from triclip.data import load_pairs
    from triclip.model.unlock import image_bottom_outputs, splits

    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))
    lines = []
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        image = Image.new("RGB", (90 + 20 * i, 120), (250, 250, 250))
        image.paste(colour, (10, 10, 60, 80))
        image.save(tmp_path / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "captions": [f"picture {i}"]}))
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    pairs = load_pairs(str(tmp_path / "m.jsonl"))
    model = build_model(ModelConfig(preset="lite", embed_dim=16)).eval()
    partly_lock(model, image_groups=2)
    bottom, _ = splits(model)["image"]
    cached = image_bottom_outputs(model, pairs, "cpu", views=2, seed=3)
    assert accel.active_backend(bottom) in ("onnxruntime", "jit")
    transform = model.image_transform(train=False)
    views = [transform(augment(r.open_image(), 3, i, v)) for i, r in enumerate(pairs.records) for v in range(2)]
    with torch.no_grad():
        reference = bottom(torch.stack(views))["x"]  # (6, C, h, w), eager
    assert cached["x"].shape == reference.shape and cached["x"].dtype == torch.float16
    assert F.cosine_similarity(cached["x"].float().flatten(1), reference.flatten(1)).min() >= 0.999
    assert bool(cached["valid"].all())


def test_the_bottom_pass_on_two_threads_equals_one_thread_bit_for_bit_with_bad_images(tmp_path, monkeypatch):
    """unlock.image_bottom_outputs: two threads each decoding a batch's views for a single-threaded session of the
    bottom give the one-thread pass's activations bit for bit, and the same skipped records (a batch with no image
    left too)."""
    import os

    from triclip.model import accel, unlock
    from triclip.data import load_pairs
    from triclip.data.builtin import prepare

    prepare("shapes", str(tmp_path / "data"), num=40, seed=0)
    pairs = load_pairs(str(tmp_path / "data" / "train.jsonl"))
    for record in pairs.records[4:8] + pairs.records[10:11]:  # the second batch of 4 has no image left
        os.remove(record.image.path)
    model = build_model(ModelConfig(preset="lite", embed_dim=8)).eval()
    partly_lock(model, image_groups=2)
    run_bottom, single = unlock._run_bottom, []
    monkeypatch.setattr(unlock, "_run_bottom", lambda *a: single.append(a[3] if len(a) > 3 else False) or run_bottom(*a))
    outputs = {}
    for threads in (1, 2):
        monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / f"cache{threads}"))
        monkeypatch.setattr(accel, "module_pass_threads", lambda module, device, n=threads: n)
        outputs[threads] = unlock.image_bottom_outputs(model, pairs, "cpu", views=2, seed=1, batch_size=8)
    batches = -(-len(pairs.records) // 4) - 1  # every batch of 4 records but the empty one
    assert single == [False] * batches + [True] * batches  # two threads: single-threaded sessions
    one, two = outputs[1], outputs[2]
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert int((two["bad"] > 0).sum()) == 5 and not bool(two["valid"][4:8].any()) and bool(two["valid"][:4].all())
    assert accel.active_backend(unlock.splits(model)["image"][0]) in ("onnxruntime", "jit")
