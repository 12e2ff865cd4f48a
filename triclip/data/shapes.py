"""``shapes``: procedural 64x64 images of coloured shapes with compositional captions.

Each image shows 1-3 shapes of one colour, kind and size, grouped in one of five
places; its 2-3 captions state count, colour, shape, size and position in
different phrasings, and its label is the attribute class ``"<colour> <shape>"``
(24 classes, for mAP). Everything follows from ``(seed, index)``, so the same
seed gives byte-identical images and manifests, and a larger ``--num`` only adds
images. The last 10% of indices form the validation split.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw
from triclip.core.progress import progress

from triclip.data.manifest import Built, manifest_row, save_image
from triclip.core.errors import UserError

SIZE = 64  # output side in pixels
SUPERSAMPLE = 4  # drawn at SIZE * SUPERSAMPLE, then downsampled (anti-aliasing)
DEFAULT_NUM = 2000  # images when --num is not given
VAL_FRACTION = 0.1  # last indices go to val
COLOURS = {
    "red": (215, 38, 38),
    "green": (34, 160, 60),
    "blue": (38, 84, 222),
    "yellow": (240, 200, 20),
    "purple": (136, 56, 176),
    "orange": (245, 128, 24),
}
SHAPES = ("circle", "square", "triangle", "star")
SIZES = {"small": 4.0, "large": 6.5}  # circumradius in output pixels
POSITIONS = {  # name -> centre of the group's 32x32 region
    "top left": (16, 16),
    "top right": (48, 16),
    "bottom left": (16, 48),
    "bottom right": (48, 48),
    "center": (32, 32),
}
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
BACKGROUNDS = ((250, 250, 250), (236, 236, 236), (245, 240, 228), (228, 236, 244), (240, 232, 240))


@dataclass(frozen=True)
class Scene:
    """What one image shows."""

    count: int  # number of shapes, 1-3
    colour: str  # key of COLOURS
    shape: str  # one of SHAPES
    size: str  # key of SIZES
    position: str  # key of POSITIONS

    @property
    def label(self) -> str:
        return f"{self.colour} {self.shape}"


def sample_scene(rng: random.Random) -> Scene:
    """A uniformly random scene."""
    return Scene(
        count=rng.randint(1, 3),
        colour=rng.choice(sorted(COLOURS)),
        shape=rng.choice(SHAPES),
        size=rng.choice(sorted(SIZES)),
        position=rng.choice(sorted(POSITIONS)),
    )


def _phrases(scene: Scene) -> list[str]:
    """Every phrasing of a scene (same facts, different words and order)."""
    noun = scene.shape if scene.count == 1 else f"{scene.shape}s"
    where = "in the center" if scene.position == "center" else f"in the {scene.position}"
    many = "a" if scene.count == 1 else COUNT_WORDS[scene.count]
    return [
        f"{many} {scene.size} {scene.colour} {noun} {where}",
        f"{scene.position}: {scene.count} {scene.colour} {noun}, {scene.size}",
        f"a picture of {COUNT_WORDS[scene.count]} {scene.colour} {noun} ({scene.size}) {where}",
        f"{scene.size} {scene.colour} {noun}, {scene.count} of them, {where}",
        f"{where}, {many} {scene.colour} {noun} of {scene.size} size",
    ]


def captions_for(scene: Scene, rng: random.Random) -> list[str]:
    """2 or 3 distinct phrasings of the scene, in a random order."""
    return rng.sample(_phrases(scene), rng.randint(2, 3))


def _centres(scene: Scene, rng: random.Random) -> list[tuple[float, float]]:
    """Centres for the shapes inside the group's region, kept apart when possible."""
    radius, (cx, cy) = SIZES[scene.size], POSITIONS[scene.position]
    spread = 16 - radius
    centres: list[tuple[float, float]] = []
    for attempt in range(200):
        x, y = cx + rng.uniform(-spread, spread), cy + rng.uniform(-spread, spread)
        gap = 2.1 * radius if attempt < 150 else 1.4 * radius  # allow slight overlap if crowded
        if all(math.dist((x, y), c) >= gap for c in centres):
            centres.append((x, y))
            if len(centres) == scene.count:
                break
    while len(centres) < scene.count:  # never reached in practice; keeps the count exact
        centres.append((cx, cy))
    return centres


def _polygon(shape: str, x: float, y: float, r: float, angle: float) -> list[tuple[float, float]]:
    corners = {"square": 4, "triangle": 3, "star": 10}[shape]
    points = []
    for k in range(corners):
        rk = r * (0.45 if shape == "star" and k % 2 else 1.0)
        theta = angle + 2 * math.pi * k / corners
        points.append((x + rk * math.cos(theta), y + rk * math.sin(theta)))
    return points


def render(scene: Scene, rng: random.Random) -> Image.Image:
    """Draw a scene as a SIZE x SIZE RGB image."""
    scale = SUPERSAMPLE
    image = Image.new("RGB", (SIZE * scale, SIZE * scale), rng.choice(BACKGROUNDS))
    draw = ImageDraw.Draw(image)
    colour = tuple(min(255, max(0, c + rng.randint(-12, 12))) for c in COLOURS[scene.colour])
    radius = SIZES[scene.size] * scale
    for x, y in _centres(scene, rng):
        x, y = x * scale, y * scale
        if scene.shape == "circle":
            draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=colour)
        else:
            draw.polygon(_polygon(scene.shape, x, y, radius, rng.uniform(0, 2 * math.pi)), fill=colour)
    return image.resize((SIZE, SIZE), Image.Resampling.LANCZOS)


def build(out: str, num: int | None, seed: int) -> Built:
    """Render ``num`` images into ``out/images`` and return their manifest rows (90/10 split)."""
    num = DEFAULT_NUM if num is None else num
    if num < 2:
        raise UserError(f"shapes needs --num of at least 2 (one train and one val image), got {num}")
    num_val = max(1, round(num * VAL_FRACTION))
    width = max(6, len(str(num - 1)))
    rows = []
    for index in progress(range(num), desc="shapes", unit=" img"):
        rng = random.Random(f"shapes:{seed}:{index}")
        scene = sample_scene(rng)
        captions = captions_for(scene, rng)
        image = f"images/{index:0{width}d}.png"
        save_image(render(scene, rng), os.path.join(out, image))
        rows.append(manifest_row(image, captions, scene.label))
    return Built(train=rows[: num - num_val], val=rows[num - num_val :])
