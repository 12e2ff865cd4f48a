"""Partly unlocked towers: a frozen bottom run once and cached, a trainable top run every epoch.

open_clip's ``--lock-image-unlocked-groups N`` / ``--lock-text-unlocked-layers N`` done the
CPU way. :func:`split_tower` cuts a tower into ``bottom`` and ``top`` with
``top(bottom(x)) == tower(x)``; both are views that share the tower's submodules, so the
model's ``state_dict`` (and every checkpoint) is unchanged. :func:`partly_lock` freezes the
bottom; :func:`bottom_outputs` runs it once over a PairSet and caches its outputs on disk
(fp16, keyed by the bottom's weights, the cut, the transform, the views and the data),
so each epoch runs only the top. The cache's size is printed and refused (one line) past
a budget.

Groups (the top ``n`` train):
    lite image   EfficientNet-Lite0's 7 ``blocks`` stages, then ``conv_head``/``bn2`` +
                 pooling as the top group (n = 1: the head conv only; at most 8).
    lite text    MiniLM's transformer layers; the top one includes the mean pooling.
    open_clip    ViT ``transformer.resblocks`` (top one: + ``ln_post``, pooling, ``proj``);
                 text ``transformer.resblocks`` (top one: + ``ln_final``, pooling, projection).

Cached views (augmentation that survives caching): with ``views = V > 1`` every training
image is cached V times: view 0 is the plain image, views 1..V-1 a random resized crop
(scale 0.5-1) flipped with probability 1/2, drawn from ``(seed, index, view)``. Epoch e
uses view :func:`epoch_views` of each record, a pure function of ``(seed, e, index)``, so
``--resume`` continues exactly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from triclip.core.progress import progress

from triclip.model.accel import module_hash
from triclip.model.cache import DECODER_VERSION, _key, cache_dir, locked_tower_outputs, nothing_decoded
from triclip.core.errors import UserError
from triclip.core.io import atomic_path

CROP_SCALE = (0.5, 1.0)  # random resized crop of a cached view: fraction of the image's area
CROP_RATIO = (3 / 4, 4 / 3)  # and its aspect ratio range
GB = 1e9


# ---------------------------------------------------------------------------- split


class _Part(nn.Module):
    """A bottom or top of a tower: a forward over modules it shares with the tower."""

    def __init__(self, forward: Callable, modules: dict[str, nn.Module]):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self._forward = forward

    def forward(self, x):
        return self._forward(x)


def tower_groups(tower: nn.Module) -> int:
    """How many groups ``tower`` can unlock (see module docstring); UserError for an unknown tower."""
    kind = _kind(tower)
    if kind == "lite_image":
        return len(tower.net.blocks) + 1
    if kind == "lite_text":
        return len(tower.bert.encoder.layer)
    if kind == "clip_image":
        return len(tower.transformer.resblocks)
    return len(tower.clip.transformer.resblocks)


def split_tower(tower: nn.Module, n: int) -> tuple[nn.Module, nn.Module]:
    """Cut ``tower`` below its top ``n`` groups.

    Args:
        tower: a lite ``ImageTower`` / ``TextTower``, an open_clip ``VisionTransformer``, or the
            open_clip text tower of ``triclip.model.model``.
        n: groups above the cut, 1 .. :func:`tower_groups`.

    Returns:
        ``(bottom, top)``: ``bottom(x)`` is a dict of tensors with a leading batch dimension
        and ``top(bottom(x)) == tower(x)``. They share the tower's modules.
    """
    total = tower_groups(tower)
    if not 1 <= n <= total:
        raise UserError(f"{type(tower).__name__} has {total} groups to unlock; got {n} (1..{total})")
    return {"lite_image": _split_lite_image, "lite_text": _split_lite_text, "clip_image": _split_clip_image}.get(
        _kind(tower), _split_clip_text
    )(tower, n)


def _kind(tower: nn.Module) -> str:
    from triclip.model.model import _OpenClipText
    from triclip.model.towers import ImageTower, TextTower

    if isinstance(tower, ImageTower):
        return "lite_image"
    if isinstance(tower, TextTower):
        return "lite_text"
    if hasattr(tower, "transformer") and hasattr(tower, "_embeds") and hasattr(tower, "_pool"):
        return "clip_image"
    if isinstance(tower, _OpenClipText) and hasattr(tower.clip, "token_embedding"):
        return "clip_text"
    raise UserError(f"cannot unlock part of a {type(tower).__name__} tower (lite and open_clip ViT/text towers only)")


def _split_lite_image(tower, n: int):
    net = tower.net
    cut = len(net.blocks) - (n - 1)  # blocks below the cut

    def bottom(x):  # (B, 3, H, W) -> {"x": (B, C, h, w)}
        x = net.bn1(net.conv_stem(x))
        for block in net.blocks[:cut]:
            x = block(x)
        return {"x": x}

    def top(h):  # {"x": (B, C, h, w)} -> (B, 1280)
        x = h["x"]
        for block in net.blocks[cut:]:
            x = block(x)
        return net.forward_head(net.bn2(net.conv_head(x)))

    low = {"conv_stem": net.conv_stem, "bn1": net.bn1, "blocks": nn.ModuleList(net.blocks[:cut])}
    high = {"blocks": nn.ModuleList(net.blocks[cut:]), "conv_head": net.conv_head, "bn2": net.bn2}
    return _Part(bottom, low), _Part(top, high)


def _bert_mask(mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """BERT's additive attention mask from a (B, L) padding mask: (B, 1, 1, L), 0 where a token is attended
    and the dtype's lowest value where it is padding.

    The project's own few lines rather than ``BertModel``'s private mask builder (renamed in transformers
    5.24): an additive float mask is what both the eager and the SDPA attention of ``BertLayer`` take.
    ``tests/model/test_unlock_towers.py`` checks the split tower against the tower's own forward.
    """
    keep = mask[:, None, None, :].to(hidden.dtype)  # (B, 1, 1, L)
    return (1.0 - keep) * torch.finfo(hidden.dtype).min


def _split_lite_text(tower, n: int):
    from triclip.model.towers import mean_pool

    bert = tower.bert
    layers = bert.encoder.layer
    cut = len(layers) - n

    def bottom(tokens):  # 3 x (B, L) -> {"hidden": (B, L, H), "mask": (B, L)}
        ids = tokens["input_ids"]
        mask = tokens.get("attention_mask", torch.ones_like(ids))
        x = bert.embeddings(input_ids=ids, token_type_ids=tokens.get("token_type_ids"))
        extended = _bert_mask(mask, x)
        for layer in layers[:cut]:
            x = layer(x, extended)
        return {"hidden": x, "mask": mask}

    def top(h):  # {"hidden": (B, L, H), "mask": (B, L)} -> (B, H)
        x, mask = h["hidden"], h["mask"]
        extended = _bert_mask(mask, x)
        for layer in layers[cut:]:
            x = layer(x, extended)
        return mean_pool(x, mask)

    low = {"embeddings": bert.embeddings, "layers": nn.ModuleList(layers[:cut])}
    return _Part(bottom, low), _Part(top, {"layers": nn.ModuleList(layers[cut:])})


def _run_blocks(transformer, blocks, x, attn_mask=None):
    """open_clip ``Transformer.forward`` over some of its blocks; x is (B, L, W) either way."""
    if not transformer.batch_first:
        x = x.transpose(0, 1)
    for block in blocks:
        x = block(x, attn_mask=attn_mask)
    return x if transformer.batch_first else x.transpose(0, 1)


def _split_clip_image(tower, n: int):
    blocks = tower.transformer.resblocks
    cut = len(blocks) - n

    def bottom(images):  # (B, 3, H, W) -> {"x": (B, L, W)}
        return {"x": _run_blocks(tower.transformer, blocks[:cut], tower._embeds(images))}

    def top(h):  # {"x": (B, L, W)} -> (B, D_tower)
        pooled, _ = tower._pool(_run_blocks(tower.transformer, blocks[cut:], h["x"]))
        return pooled @ tower.proj if tower.proj is not None else pooled

    low = {"conv1": tower.conv1, "ln_pre": tower.ln_pre, "blocks": nn.ModuleList(blocks[:cut])}
    extra = {"ln_post": tower.ln_post} if hasattr(tower, "ln_post") else {}
    high = _Part(top, {"blocks": nn.ModuleList(blocks[cut:]), **extra})
    bottom_part = _Part(bottom, low)
    bottom_part.register_parameter("class_embedding", tower.class_embedding)  # shared, frozen with the bottom
    bottom_part.register_parameter("positional_embedding", tower.positional_embedding)
    if tower.proj is not None:
        high.register_parameter("proj", tower.proj)
    return bottom_part, high


def _split_clip_text(tower, n: int):
    from open_clip.transformer import text_global_pool

    clip = tower.clip
    blocks = clip.transformer.resblocks
    cut = len(blocks) - n

    def bottom(tokens):  # (B, L) -> {"x": (B, L, W), "tokens": (B, L)}
        x = clip.token_embedding(tokens) + clip.positional_embedding
        return {"x": _run_blocks(clip.transformer, blocks[:cut], x, clip.attn_mask), "tokens": tokens}

    def top(h):  # {"x": (B, L, W), "tokens": (B, L)} -> (B, D_tower)
        x = clip.ln_final(_run_blocks(clip.transformer, blocks[cut:], h["x"], clip.attn_mask))
        x = text_global_pool(x, h["tokens"], clip.text_pool_type, eos_token_id=getattr(clip, "text_eos_id", None))
        projection = clip.text_projection
        if projection is None:
            return x
        return projection(x) if isinstance(projection, nn.Linear) else x @ projection

    low = _Part(bottom, {"token_embedding": clip.token_embedding, "blocks": nn.ModuleList(blocks[:cut])})
    low.register_parameter("positional_embedding", clip.positional_embedding)
    high = _Part(top, {"blocks": nn.ModuleList(blocks[cut:]), "ln_final": clip.ln_final})
    if isinstance(clip.text_projection, nn.Parameter):
        high.register_parameter("text_projection", clip.text_projection)
    elif isinstance(clip.text_projection, nn.Module):
        high.add_module("text_projection", clip.text_projection)
    return low, high


# ---------------------------------------------------------------------------- model


def partly_lock(model, image_groups: int = 0, text_layers: int = 0) -> None:
    """Freeze all but the top ``image_groups`` / ``text_layers`` of the towers.

    The splits are kept in ``model._split`` ({"image": (bottom, top), ...}, a plain
    attribute: not part of the state_dict); ``DualEncoder.train`` keeps bottoms in eval mode.
    """
    split = {}
    for side, n in (("image", image_groups), ("text", text_layers)):
        if n:
            tower = getattr(model, f"{side}_tower")
            bottom, top = split_tower(tower, n)
            tower.requires_grad_(True)
            bottom.requires_grad_(False)
            bottom.eval()
            split[side] = (bottom, top)
    model._split = split
    model.train(model.training)


def splits(model) -> dict:
    """``{"image": (bottom, top), "text": ...}`` for the partly locked towers of ``model``."""
    return getattr(model, "_split", None) or {}


# ---------------------------------------------------------------------------- the cache


def epoch_views(seed: int, epoch: int, n: int, views: int) -> torch.Tensor:
    """Which cached view each of ``n`` records uses in ``epoch``. Shape: (n,) long, in [0, views)."""
    if views <= 1:
        return torch.zeros(n, dtype=torch.long)
    g = torch.Generator().manual_seed(seed * 1_000_033 + epoch * 7919 + 17)
    return torch.randint(views, (n,), generator=g)


def augment(image, seed: int, index: int, view: int):
    """View ``view`` of a PIL image: 0 is the image, others a random resized crop, maybe flipped."""
    if view == 0:
        return image
    rng = np.random.default_rng([seed, index, view])
    w, h = image.size
    for _ in range(10):  # torchvision's RandomResizedCrop sampling
        area = w * h * rng.uniform(*CROP_SCALE)
        ratio = math.exp(rng.uniform(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])))
        cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            left, upper = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            image = image.crop((left, upper, left + cw, upper + ch))
            break
    if rng.random() < 0.5:
        from PIL import Image

        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image


class _ViewDataset(torch.utils.data.Dataset):
    """Each record's image decoded once, as ``views`` transformed views. Item: {"image": (V, 3, H, W), "index"}."""

    def __init__(self, dataset, views: int, seed: int):
        self.dataset, self.views, self.seed = dataset, views, seed  # a PairDataset (its bad-record bookkeeping)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        from triclip.data.reasons import REASONS, BadRecord

        ds = self.dataset
        if ds._bad[index]:
            return None
        try:
            image = ds.pairs.records[index].open_image(ds.pairs.max_pixels)
        except BadRecord as bad:
            ds._bad[index] = REASONS.index(bad.reason) + 1
            return None
        views = [ds.transform(augment(image, self.seed, index, v)) for v in range(self.views)]
        return {"image": torch.stack(views), "index": index}  # (V, 3, H, W)


def _collate(batch):
    items = [item for item in batch if item is not None]
    if not items:
        return None
    return {"image": torch.stack([i["image"] for i in items]), "index": torch.tensor([i["index"] for i in items])}


def image_bottom_path(model, pairs, views: int, seed: int) -> Path:
    """Where the image bottom's outputs for ``pairs`` are (or would be) cached."""
    bottom, _ = splits(model)["image"]
    seeded = f"views={views} seed={seed}" if views > 1 else "views=1"
    transform = repr(model.image_transform(train=False))
    key = _key("image-bottom", module_hash(bottom), transform, f"decoder={DECODER_VERSION}", seeded, pairs.fingerprint)
    return cache_dir() / f"image-bottom-{key}.safetensors"


def text_bottom_path(model, pairs) -> Path:
    """Where the text bottom's outputs for ``pairs`` are (or would be) cached."""
    bottom, _ = splits(model)["text"]
    max_length = getattr(model.text_tower, "max_length", None)
    key = _key("text-bottom", module_hash(bottom), f"max_length={max_length}", pairs.fingerprint)
    return cache_dir() / f"text-bottom-{key}.safetensors"


def _reuse(side: str, path) -> dict[str, torch.Tensor]:
    """The ``side`` bottom's cache file, read (and said so)."""
    result = load_file(str(path))
    _report(side, path, result, new=False)
    return result


def _keep(side: str, path, result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Write the ``side`` bottom's cache atomically (and say so); returns it."""
    with atomic_path(path) as tmp:
        save_file(result, str(tmp))
    _report(side, path, result, new=True)
    return result


def _bottom(model, side: str) -> nn.Module:
    """The ``side`` tower's frozen bottom (below the cut), in eval mode."""
    bottom, _ = splits(model)[side]
    return bottom.eval()


def _report(side: str, path, result: dict, new: bool) -> None:
    size = sum(t.numel() * t.element_size() for t in result.values())
    what = "cached" if new else "reusing"
    print(f"{what} the {side} tower's activations below the cut: {size / GB:.3f} GB in {path}")


def _check_budget(side: str, rows: int, per_row: int, budget_gb: float) -> None:
    need = rows * per_row / GB
    if need > budget_gb:
        fix = "fewer --cached-views" if side == "image" else "a smaller --text-max-length"
        raise UserError(
            f"the {side} activations below the cut would take {need:.2f} GB ({rows} rows x {per_row / 1e6:.3f} MB),"
            f" over --cache-budget {budget_gb:g} GB: unlock fewer groups, use {fix} or raise the budget"
        )


def _store(out: dict | None, rows: int, h: dict[str, torch.Tensor]) -> dict:
    """Preallocate the cache tensors from the first batch's outputs (floats as fp16)."""
    if out is not None:
        return out
    return {k: torch.zeros((rows, *v.shape[1:]), dtype=torch.float16 if v.is_floating_point() else v.dtype) for k, v in h.items()}


@torch.no_grad()
def image_bottom_outputs(model, pairs, device, views: int = 1, seed: int = 0, workers: int = 0,
                         budget_gb: float = 4.0, batch_size: int = 32) -> dict[str, torch.Tensor]:
    """The image bottom's outputs for every record and view, computed once and cached.

    Returns:
        ``{"x": (N * V, ...) fp16, "valid": (N,) bool, "bad": (N,) int8}`` (row ``i * V + v``
        is view v of record i; keys other than ``x`` where the bottom returns more).
    """
    from triclip.data import PairDataset

    path = image_bottom_path(model, pairs, views, seed)
    if path.exists():
        return _reuse("image", path)
    bottom = _bottom(model, "image")
    fast = _kind(model.image_tower) == "lite_image"  # returns {"x"}: ONNX Runtime / jit on the CPU (triclip.model.accel)
    dataset = PairDataset(pairs, model.image_transform(train=False), train=False)
    n = len(pairs.records)
    out, valid = None, torch.zeros(n, dtype=torch.bool)
    batches = _bottom_pass(bottom, _ViewDataset(dataset, views, seed), max(1, batch_size // views), device, fast, workers)
    total = -(-n // max(1, batch_size // views))
    for result in progress(batches, desc=f"caching image activations below the cut ({views} views)", unit="batch",
                           total=total):
        if result is None:  # no image of the batch decoded
            continue
        batch, h = result
        if out is None:
            _check_budget("image", n * views, sum(v[0].numel() * 2 for v in h.values()), budget_gb)
        out = _store(out, n * views, h)
        rows = (batch["index"][:, None] * views + torch.arange(views)).flatten()  # (b * V,)
        for k, v in h.items():
            out[k][rows] = v.to(out[k].dtype)
        valid[batch["index"]] = True
    if out is None:
        raise nothing_decoded(pairs, dataset)
    return _keep("image", path, {**out, "valid": valid, "bad": dataset._bad.clone()})


def _bottom_pass(bottom: nn.Module, data: "_ViewDataset", per: int, device, fast: bool, workers: int = 0):
    """``(batch, the bottom's outputs on the CPU)`` for each batch of ``per`` records of ``data``, in order (None for
    a batch with no decodable image). As ``cache.image_tower_pass``: where the bottom runs in ONNX Runtime on the CPU, as many
    threads as :func:`~triclip.model.accel.module_pass_threads` each decode a batch and run a single-threaded
    session on it (the same outputs bit for bit); otherwise the next batch is decoded while the bottom runs."""
    from triclip.model.accel import module_pass_threads
    from triclip.model.prefetch import ordered_map, prefetched

    threads = module_pass_threads(bottom, device) if fast and workers == 0 else 1

    def run(batch, single_thread: bool = False) -> tuple[dict, dict] | None:
        if batch is None:  # no image of the batch decoded
            return None
        images = batch["image"].flatten(0, 1).to(device)  # (b * V, 3, H, W)
        return batch, {k: v.cpu() for k, v in _run_bottom(bottom, images, fast, single_thread).items()}

    def work(start: int):  # one batch on this thread: decode its views, then the bottom single-threaded
        with torch.no_grad():  # grad mode is per thread
            return run(_collate([data[i] for i in range(start, min(start + per, len(data)))]), single_thread=True)

    if threads > 1:
        results = ordered_map(work, range(0, len(data), per), threads)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=per, num_workers=workers, collate_fn=_collate)
        results = map(run, prefetched(loader) if workers == 0 else loader)  # decoding overlaps the bottom
    return results


def _run_bottom(bottom: nn.Module, images: torch.Tensor, fast: bool, single_thread: bool = False) -> dict[str, torch.Tensor]:
    """The image bottom's outputs; a lite bottom goes through the fast CPU path (same outputs, cosine 0.999)."""
    if not fast:
        return bottom(images)
    from triclip.model.accel import image_module_features

    return {"x": image_module_features(bottom, images, key="x", single_thread=single_thread)}  # (B, C, h, w)


@torch.no_grad()
def text_bottom_outputs(model, pairs, device, budget_gb: float = 4.0, batch_size: int = 128) -> dict[str, torch.Tensor]:
    """The text bottom's outputs for every caption, computed once and cached.

    Returns:
        The bottom's keys, each (M, L, ...) with L the longest tokenized caption (padding
        masked), plus ``"offsets"`` (N+1,): record i owns rows ``offsets[i]:offsets[i+1]``.
    """
    path = text_bottom_path(model, pairs)
    if path.exists():
        return _reuse("text", path)
    bottom = _bottom(model, "text")
    captions = [c for r in pairs.records for c in r.captions]
    counts = torch.tensor([len(r.captions) for r in pairs.records])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    out = None
    longest = _longest_tokens(model, captions)
    for start in progress(range(0, len(captions), batch_size), desc="caching text activations below the cut", unit="batch"):
        tokens = _pad_to(model.tokenize(captions[start : start + batch_size]), longest)
        tokens = {k: v.to(device) for k, v in tokens.items()} if isinstance(tokens, dict) else tokens.to(device)
        h = {k: v.cpu() for k, v in bottom(tokens).items()}
        if out is None:
            _check_budget("text", len(captions), sum(v[0].numel() * 2 for v in h.values()), budget_gb)
        out = _store(out, len(captions), h)
        for k, v in h.items():
            out[k][start : start + len(v)] = v.to(out[k].dtype)
    return _keep("text", path, {**out, "offsets": offsets})


def _longest_tokens(model, captions: list[str]) -> int | None:
    """The padded length that fits every caption (lite: dict tokens padded per batch); None: fixed length."""
    if not isinstance(model.tokenize(captions[:1]), dict):
        return None
    return max(int(model.tokenize(captions[s : s + 512])["attention_mask"].shape[1]) for s in range(0, len(captions), 512))


def _pad_to(tokens, length: int | None):
    """Right-pad dict tokens (input_ids 0, attention_mask 0) to ``length``."""
    if length is None or not isinstance(tokens, dict):
        return tokens
    pad = length - tokens["input_ids"].shape[1]
    return {k: torch.nn.functional.pad(v, (0, pad)) for k, v in tokens.items()}


def select_rows(cache: dict[str, torch.Tensor], rows: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """Rows of a bottom cache as a top's input: floats back to fp32, text trimmed to its longest mask."""
    keys = [k for k in cache if k not in ("valid", "bad", "offsets")]
    h = {k: cache[k][rows] for k in keys}
    if "mask" in h:
        length = max(1, int(h["mask"].sum(1).max()))
        h = {k: v[:, :length] for k, v in h.items()}
    return {k: (v.float() if v.is_floating_point() else v).to(device) for k, v in h.items()}


# ---------------------------------------------------------------------------- evaluation


@torch.no_grad()
def eval_caches(model, pairs, device, workers: int = 0, budget_gb: float = 4.0, batch_size: int = 256) -> dict:
    """``{"image": ..., "text": ...}`` as :func:`triclip.model.cache.locked_tower_outputs` gives them, for
    ``triclip.model.embed.embed_pairs``: a partly locked tower's features are its top over the cached bottom."""
    caches = locked_tower_outputs(model, pairs, device, workers)
    parts = splits(model)
    was_training = model.training
    model.eval()
    if "image" in parts:
        low = image_bottom_outputs(model, pairs, device, workers=workers, budget_gb=budget_gb)
        feats = _top_over(parts["image"][1], low, torch.arange(len(pairs.records)), device, batch_size)
        caches["image"] = {"features": feats, "valid": low["valid"], "bad": low["bad"]}
    if "text" in parts:
        low = text_bottom_outputs(model, pairs, device, budget_gb=budget_gb)
        feats = _top_over(parts["text"][1], low, torch.arange(int(low["offsets"][-1])), device, batch_size)
        caches["text"] = {"features": feats, "offsets": low["offsets"]}
    model.train(was_training)
    return caches


def _top_over(top, low: dict, rows: torch.Tensor, device, batch_size: int) -> torch.Tensor:
    """The top over cached bottom rows, in batches. Shape: (len(rows), F)."""
    out = [top(select_rows(low, rows[s : s + batch_size], device)).float().cpu() for s in range(0, len(rows), batch_size)]
    return torch.cat(out)
