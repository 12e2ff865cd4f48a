"""Dual encoders: an image tower and a text tower, each followed by a projection head.

Every model is ``tower -> head -> (B, D)`` on both sides, plus two scalars of the
objective that live on the model (as in open_clip): the learnable logit scale and
the importance parameter ``theta`` from which the tri-factor importance
``w = importance(theta)`` (D,) is made. ``theta`` exists for every model, so any
model can report an ordering of its dimensions; only ``tricl`` trains it.

Presets (``ModelConfig.preset``):
    tiny   a small open_clip ViT + text transformer from scratch (CPU-sized).
    lite   offline pretrained towers: EfficientNet-Lite0 (ImageNet, 224 px) and
           all-MiniLM-L6-v2, from their PyPI packages (``triclip.model.towers``).
    lite1  the same with EfficientNet-Lite1 (240 px); lite2: EfficientNet-Lite2 (260 px).
    NAME   any open_clip architecture, from scratch or with ``pretrained`` tag.

Splitting towers from heads is what makes locking (LiT) simple: a locked tower
is frozen and its outputs can be cached; the heads always train.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from triclip.core.errors import UserError

MAX_LOGIT_SCALE = 100.0


@dataclass
class ModelConfig:
    preset: str = "tiny"  # tiny, lite, lite1, lite2, or an open_clip architecture name
    pretrained: str | None = None  # open_clip pretrained tag (weights must be reachable)
    embed_dim: int | None = None  # D, the embedding size after the heads (None: per preset)
    head: str = "linear"  # projection head: linear, affine (linear with a bias), mlp or residual (affine + mlp)
    importance: str = "softplus_mean1"  # how w is made from theta: see IMPORTANCE_FORMS
    importance_spread: float = 1.0  # w starts as a geometric ramp from 1 down to 1/spread (1: all ones)
    init_temperature: float = 0.07  # initial 1 / logit scale (CLIP)
    image_size: int | None = None  # input resolution (None: per preset)
    text_max_length: int | None = None  # lite: captions truncated to this many tokens (None: 256)
    post_affine: bool = False  # head -> its run's served embedding -> an affine map (triclip solve --run)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------- importance

_SOFTPLUS_ONE = math.log(math.e - 1.0)  # softplus(_SOFTPLUS_ONE) == 1


def _softplus(theta: torch.Tensor) -> torch.Tensor:
    return F.softplus(theta)


def _softplus_mean1(theta: torch.Tensor) -> torch.Tensor:
    w = F.softplus(theta)
    return w / w.mean()  # cannot absorb a global scale: that is the logit scale's job


IMPORTANCE_FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softplus": _softplus,  # the paper: w = softplus(theta)
    "softplus_mean1": _softplus_mean1,  # softplus normalised to mean 1
}


def initial_theta(dim: int, spread: float = 1.0) -> torch.Tensor:
    """``theta`` (D,) with ``softplus(theta)`` a geometric ramp from 1 down to ``1/spread``.

    ``spread=1`` is the paper's start (w = 1 everywhere: every ordering of the dimensions
    is equally good, and only noise can break the tie). ``spread > 1`` breaks the symmetry
    from step 0, so the heads learn to put what matters most where w is largest.
    """
    if not spread >= 1.0:
        raise UserError(f"importance spread must be >= 1, got {spread}")
    if spread == 1.0:
        return torch.full((dim,), _SOFTPLUS_ONE)
    w = torch.logspace(0.0, -math.log10(spread), dim, dtype=torch.float64)  # 1 ... 1/spread
    return torch.log(torch.expm1(w)).float()  # softplus^-1


# ---------------------------------------------------------------------------- model


class DualEncoder(nn.Module):
    """Image and text towers with projection heads, a logit scale and the importance.

    Args:
        image_tower: images (B, 3, H, W) -> features (B, F_img).
        text_tower: tokens -> features (B, F_txt); has ``tokenize(list[str])``.
        image_dim: F_img. text_dim: F_txt.
        config: the ModelConfig it was built from (saved with checkpoints).
        image_transform: PIL image -> (3, H, W) tensor, deterministic.
    """

    def __init__(
        self,
        image_tower: nn.Module,
        text_tower: nn.Module,
        image_dim: int,
        text_dim: int,
        config: ModelConfig,
        image_transform: Callable,
    ):
        super().__init__()
        if config.importance not in IMPORTANCE_FORMS:
            raise UserError(f"unknown importance form {config.importance!r}; choose from {sorted(IMPORTANCE_FORMS)}")
        D = config.embed_dim
        self.config = config
        self.embed_dim = D
        self.image_tower = image_tower
        self.text_tower = text_tower
        self.image_head = _make_head(config.head, image_dim, D, config.post_affine)
        self.text_head = _make_head(config.head, text_dim, D, config.post_affine)
        self.logit_scale_param = nn.Parameter(torch.tensor(math.log(1.0 / config.init_temperature)))
        self.theta = nn.Parameter(initial_theta(D, config.importance_spread))
        self._transform = image_transform
        self._importance_fn = IMPORTANCE_FORMS[config.importance]

    # -- the two scalars of the objective

    def logit_scale(self) -> torch.Tensor:
        """``s = exp(param)`` (scalar tensor); the trainer keeps it <= 100 with :meth:`clamp_logit_scale_`."""
        return self.logit_scale_param.exp()

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """Clamp the parameter to [0, ln 100] in place, after each optimizer step (as open_clip does).

        Clamping the parameter, not ``exp(param)``, keeps its gradient alive: a value past ln 100
        is pulled back and can move down again, instead of sitting where the gradient is zero.
        """
        self.logit_scale_param.clamp_(0.0, math.log(MAX_LOGIT_SCALE))

    def importance(self) -> torch.Tensor:
        """``w`` (D,), non-negative."""
        return self._importance_fn(self.theta)

    # -- towers and heads

    def image_transform(self, train: bool = False) -> Callable:
        """PIL image -> (3, H, W). The same for training and eval (captions talk about
        left/right and size, so no flips or crops; and locked-tower caches need it)."""
        return self._transform

    def tokenize(self, texts: list[str]):
        return self.text_tower.tokenize(texts)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Tower output before the head. (B, 3, H, W) -> (B, F_img)."""
        return self.image_tower(images)

    def text_features(self, tokens) -> torch.Tensor:
        """Tower output before the head. tokens -> (B, F_txt)."""
        return self.text_tower(tokens)

    def project_image(self, feats: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        z = self.image_head(feats)  # (B, D)
        return F.normalize(z, dim=-1) if normalize else z

    def project_text(self, feats: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        z = self.text_head(feats)  # (B, D)
        return F.normalize(z, dim=-1) if normalize else z

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """(B, 3, H, W) -> (B, D)."""
        return self.project_image(self.image_features(images), normalize)

    def encode_text(self, texts, normalize: bool = True) -> torch.Tensor:
        """list[str] (or already tokenized) -> (B, D)."""
        tokens = self.tokenize(texts) if isinstance(texts, (list, tuple)) else texts
        tokens = _to_device(tokens, self.logit_scale_param.device)
        return self.project_text(self.text_features(tokens), normalize)

    def lock(self, image: bool = False, text: bool = False) -> None:
        """Freeze whole towers (LiT). Heads, logit scale and importance keep training."""
        for tower, locked in ((self.image_tower, image), (self.text_tower, text)):
            if locked:
                tower.requires_grad_(False)
                tower.eval()
        self._locked = (image, text)

    def train(self, mode: bool = True):
        super().train(mode)
        image_locked, text_locked = getattr(self, "_locked", (False, False))
        if image_locked:
            self.image_tower.eval()  # frozen BN statistics too
        if text_locked:
            self.text_tower.eval()
        for bottom, _ in getattr(self, "_split", {}).values():  # partly locked (triclip.model.unlock)
            bottom.eval()
        return self


def _make_head(kind: str, in_dim: int, out_dim: int, post_affine: bool = False) -> nn.Module:
    if post_affine:
        return PostAffineHead(_make_head(kind, in_dim, out_dim), out_dim)
    if kind == "linear":
        return nn.Linear(in_dim, out_dim, bias=False)
    if kind == "affine":  # linear with a bias: centred heads (the CCA solution of triclip.training.solve)
        return nn.Linear(in_dim, out_dim, bias=True)
    if kind == "mlp":
        return _mlp(in_dim, out_dim)
    if kind == "residual":
        return ResidualHead(in_dim, out_dim)
    raise UserError(f"unknown head {kind!r}; choose linear, affine, mlp or residual")


def _mlp(in_dim: int, out_dim: int) -> nn.Sequential:
    hidden = max(in_dim, out_dim)
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim, bias=False))


class ResidualHead(nn.Module):
    """An affine map plus an MLP branch: ``skip(x) + branch(x)``. Shape: (B, F) -> (B, D).

    With the branch's last layer at zero it is exactly an affine head, so a run can start
    from a solved (affine) run and still train a non-linear head (``train --init``).
    """

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.skip = nn.Linear(in_dim, out_dim, bias=True)
        self.branch = _mlp(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.branch(x)

    def load_affine(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Become the affine map ``x W^T + b``: the branch's output layer is zeroed."""
        with torch.no_grad():
            self.skip.weight.copy_(weight)
            self.skip.bias.copy_(bias)
            self.branch[-1].weight.zero_()


class PostAffineHead(nn.Module):
    """A trained run's head, its served embedding, then an affine map (``triclip solve --run``).

    ``post(normalize(sqrt(w0) * inner(x)))``: ``inner`` is the run's head, ``scale`` its
    ``sqrt(w0)`` (the run's own importance weights, a buffer), so the affine map ``post``
    sees exactly what the run's index served; ``solve --run`` writes the canonical
    directions of Eq. 6 on those embeddings into ``post``. Shape: (B, F) -> (B, D).
    """

    def __init__(self, inner: nn.Module, dim: int):
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.ones(dim))  # (D,) sqrt(w) of the run the heads come from
        self.post = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(F.normalize(self.inner(x) * self.scale, dim=-1))


def _to_device(tokens, device):
    if isinstance(tokens, dict):
        return {k: v.to(device) for k, v in tokens.items()}
    return tokens.to(device)


# ---------------------------------------------------------------------------- presets


class _OpenClipText(nn.Module):
    """The text half of an open_clip CLIP model, with its tokenizer."""

    def __init__(self, clip: nn.Module, tokenizer: Callable):
        super().__init__()
        clip.visual = nn.Identity()  # the image half lives in DualEncoder.image_tower
        for name in ("logit_scale", "logit_bias"):
            if isinstance(getattr(clip, name, None), nn.Parameter):
                delattr(clip, name)  # the DualEncoder owns the objective's scalars
        self.clip = clip
        self._tokenizer = tokenizer

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        return self._tokenizer(list(texts))  # (B, context_length) long

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.clip.encode_text(tokens, normalize=False)


TINY_IMAGE_SIZE = 64


def _build_tiny(cfg: ModelConfig) -> DualEncoder:
    import open_clip
    from torchvision import transforms

    size = cfg.image_size or TINY_IMAGE_SIZE
    tower_dim = 128
    # A ViT, not a ResNet: no BatchNorm, so K data-parallel ranks compute exactly the
    # one-process loss on the global batch (BatchNorm statistics would be per rank).
    vision = dict(layers=3, width=128, head_width=32, patch_size=8, image_size=size)
    text = dict(context_length=32, vocab_size=49408, width=128, heads=4, layers=2)
    clip = open_clip.CLIP(embed_dim=tower_dim, vision_cfg=vision, text_cfg=text)
    transform = transforms.Compose(
        [
            transforms.Resize((size, size), interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]
    )
    image_tower = clip.visual
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=text["context_length"])
    text_tower = _OpenClipText(clip, tokenizer)
    cfg.embed_dim = cfg.embed_dim or 64
    return DualEncoder(image_tower, text_tower, tower_dim, tower_dim, cfg, _rgb(transform))


def _build_lite(cfg: ModelConfig, variant: int = 0) -> DualEncoder:
    from triclip.model.towers import ImageTower, TextTower

    image_tower = ImageTower(variant)
    text_tower = TextTower(max_length=cfg.text_max_length)
    cfg.embed_dim = cfg.embed_dim or 256
    return DualEncoder(
        image_tower,
        text_tower,
        image_tower.output_dim,
        text_tower.output_dim,
        cfg,
        image_tower.image_transform(train=False),
    )


def _build_open_clip(cfg: ModelConfig) -> DualEncoder:
    import open_clip

    if cfg.preset not in open_clip.list_models():
        raise UserError(f"unknown model {cfg.preset!r}: use tiny, lite, lite1, lite2 or an open_clip architecture name")
    quiet = logging.root.manager.disable
    logging.disable(logging.ERROR)  # open_clip logs its own "ERROR:root:" line before raising; ours says it once
    try:
        clip, _, preprocess = open_clip.create_model_and_transforms(cfg.preset, pretrained=cfg.pretrained)
        tokenizer = open_clip.get_tokenizer(cfg.preset)
    except Exception as err:  # offline hub, unknown tag, missing cache
        tag = f" with pretrained={cfg.pretrained!r}" if cfg.pretrained else ""
        raise UserError(f"cannot create open_clip model {cfg.preset!r}{tag}: {str(err).splitlines()[0][:200]}") from None
    finally:
        logging.disable(quiet)
    tower_dim = clip.text_projection.shape[-1] if not isinstance(clip.text_projection, nn.Linear) else clip.text_projection.out_features
    image_tower = clip.visual
    text_tower = _OpenClipText(clip, tokenizer)
    cfg.embed_dim = cfg.embed_dim or tower_dim
    return DualEncoder(image_tower, text_tower, tower_dim, tower_dim, cfg, _rgb(preprocess))


class _rgb:
    """Wraps a transform so that it always sees an RGB image (picklable for workers)."""

    def __init__(self, transform: Callable):
        self.transform = transform

    def __repr__(self) -> str:  # stable across processes: part of the locked-tower cache key
        return f"rgb({self.transform!r})"

    def __call__(self, image):
        return self.transform(image.convert("RGB") if image.mode != "RGB" else image)


PRESETS: dict[str, Callable[[ModelConfig], DualEncoder]] = {
    "tiny": _build_tiny,
    "lite": _build_lite,
    "lite1": lambda cfg: _build_lite(cfg, 1),
    "lite2": lambda cfg: _build_lite(cfg, 2),
}
LITE_PRESETS = ("lite", "lite1", "lite2")  # offline pretrained towers (triclip.model.towers)
MAX_EMBED_DIM = 65536  # D beyond this is a typo, not a model (a head of 512 x 99999999 floats is 200 GB)


def build_model(cfg: ModelConfig) -> DualEncoder:
    """Build a DualEncoder from its config (fills ``cfg.embed_dim`` when None)."""
    if cfg.pretrained and cfg.preset in PRESETS:
        raise UserError(f"--pretrained applies to open_clip architectures, not to the {cfg.preset!r} preset")
    if cfg.text_max_length is not None and cfg.preset not in LITE_PRESETS:
        raise UserError("--text-max-length applies to the lite presets (other text towers have a fixed context length)")
    if cfg.embed_dim is not None and not 1 <= cfg.embed_dim <= MAX_EMBED_DIM:
        raise UserError(f"--embed-dim must be between 1 and {MAX_EMBED_DIM}, got {cfg.embed_dim}")
    builder = PRESETS.get(cfg.preset, _build_open_clip)
    return builder(cfg)
