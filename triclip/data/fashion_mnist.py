"""``fashion-mnist``: Zalando's 28x28 clothing images (Debian package ``dataset-fashion-mnist``).

The official 60k train / 10k test images become the train / val splits, each
image a grayscale PNG; captions come from several templates filled with the
class name (3 per image, chosen from ``seed``); the label is the class name.
With 10 classes, about 10% of a batch's negatives share the positive's class.
``--num`` caps the total, split 6:1 like the official sets.
"""

from __future__ import annotations

import gzip
import os
import random
import struct

import numpy as np
from PIL import Image
from triclip.core.progress import progress

from triclip.data.debian import ensure_debian_packages
from triclip.data.manifest import Built, manifest_row, save_image

PACKAGE = "dataset-fashion-mnist"  # Debian package
ROOT = "/usr/share/datasets/fashion-mnist"  # where it puts the idx files
FILES = {  # split -> (images, labels)
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
NOUNS = (  # how captions name each class, with its article
    "a t-shirt",
    "a pair of trousers",
    "a pullover",
    "a dress",
    "a coat",
    "a sandal",
    "a shirt",
    "a sneaker",
    "a bag",
    "an ankle boot",
)
TEMPLATES = (
    "a photo of {}.",
    "a black and white photo of {}.",
    "a low resolution photo of {}.",
    "a grayscale product picture of {}.",
    "{} on a black background.",
    "a small image of {}.",
    "a centered photo of {}, seen from the front.",
)
CAPTIONS_PER_IMAGE = 3


def read_idx(path: str) -> np.ndarray:
    """An idx file (gzip-compressed) as an array: ``(n, rows, cols)`` images or ``(n,)`` labels.

    Format: big-endian magic ``0x00000800 | ndim`` with type ubyte, then ``ndim`` sizes.
    """
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def captions_for(label: int, rng: random.Random) -> list[str]:
    """``CAPTIONS_PER_IMAGE`` distinct templates filled with the class noun."""
    return [t.format(NOUNS[label]) for t in rng.sample(TEMPLATES, CAPTIONS_PER_IMAGE)]


def _split_sizes(num: int | None, available: dict[str, int]) -> dict[str, int]:
    if num is None:
        return dict(available)
    train = min(available["train"], max(1, round(num * 6 / 7)))
    return {"train": train, "val": min(available["val"], max(0, num - train))}


def _write_split(out: str, split: str, images: np.ndarray, labels: np.ndarray, count: int, seed: int) -> list[dict]:
    """Save the first ``count`` images of a split as PNGs. ``images``: (n, 28, 28) uint8."""
    rows = []
    for index in progress(range(count), desc=f"fashion-mnist {split}", unit=" img"):
        label = int(labels[index])
        rng = random.Random(f"fashion-mnist:{seed}:{split}:{index}")
        image = f"images/{split}/{index:05d}.png"
        save_image(Image.fromarray(images[index]), os.path.join(out, image))
        rows.append(manifest_row(image, captions_for(label, rng), CLASSES[label]))
    return rows


def build(out: str, num: int | None, seed: int) -> Built:
    """Write the PNGs and return manifest rows: official train as train, official test as val."""
    ensure_debian_packages({PACKAGE: ROOT})
    data = {
        split: (read_idx(os.path.join(ROOT, images)), read_idx(os.path.join(ROOT, labels)))
        for split, (images, labels) in FILES.items()
    }
    sizes = _split_sizes(num, {split: len(labels) for split, (_, labels) in data.items()})
    rows = {split: _write_split(out, split, *data[split], sizes[split], seed) for split in FILES}
    return Built(train=rows["train"], val=rows["val"])
