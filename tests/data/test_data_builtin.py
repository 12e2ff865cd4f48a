"""Built-in datasets: shapes (deterministic, any size), fashion-mnist (real idx files), the split, errors."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from triclip.data import debian, fashion_mnist, inspect, load_pairs, shapes
from triclip.data.builtin import prepare
from triclip.data.manifest import split_of
from triclip.core.errors import UserError

HAS_FASHION_MNIST = os.path.isdir(fashion_mnist.ROOT)


def _bytes_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------- shapes


def test_shapes_writes_valid_records_with_a_90_10_split(tmp_path: Path):
    summary = prepare("shapes", tmp_path / "d", num=50, seed=1)
    assert (summary["train"], summary["val"], summary["skipped"]) == (45, 5, {})
    train, val = _rows(tmp_path / "d" / "train.jsonl"), _rows(tmp_path / "d" / "val.jsonl")
    assert len({r["image"] for r in train + val}) == 50
    for row in train + val:
        with Image.open(tmp_path / "d" / row["image"]) as image:
            assert image.size == (64, 64)
        assert 2 <= len(row["captions"]) <= 3 and len(set(row["captions"])) == len(row["captions"])
        colour, shape = row["label"].split()
        for caption in row["captions"]:  # compositional: colour and shape named in every phrasing
            assert colour in caption and shape in caption
            assert any(size in caption for size in shapes.SIZES)
    assert inspect(tmp_path / "d" / "train.jsonl")["records"] == 45
    assert load_pairs(tmp_path / "d" / "val.jsonl").skipped == Counter()


def test_shapes_is_deterministic_from_the_seed(tmp_path: Path):
    prepare("shapes", tmp_path / "a", num=30, seed=7)
    prepare("shapes", tmp_path / "b", num=30, seed=7)
    prepare("shapes", tmp_path / "c", num=30, seed=8)
    prepare("shapes", tmp_path / "e", num=40, seed=7)
    a, b, c = _bytes_of(tmp_path / "a"), _bytes_of(tmp_path / "b"), _bytes_of(tmp_path / "c")
    assert a == b  # byte-identical manifests and images
    assert a["train.jsonl"] != c["train.jsonl"]
    assert sum(a[k] != c[k] for k in a if k.startswith("images/")) > 20
    e = _bytes_of(tmp_path / "e")
    assert all(e[k] == a[k] for k in a if k.startswith("images/"))  # a larger --num only adds images
    assert _rows(tmp_path / "e" / "train.jsonl")[:27] == _rows(tmp_path / "a" / "train.jsonl")


def test_shapes_captions_describe_the_scene():
    rng = random.Random(0)
    scene = shapes.Scene(count=2, colour="blue", shape="triangle", size="small", position="top left")
    captions = shapes.captions_for(scene, rng)
    assert all("blue triangles" in c and "top left" in c and "small" in c for c in captions)
    single = shapes.Scene(count=1, colour="red", shape="star", size="large", position="center")
    assert "a large red star in the center" in shapes._phrases(single)
    assert single.label == "red star"


def test_shapes_draws_the_right_colour_and_count():
    scene = shapes.Scene(count=3, colour="red", shape="square", size="large", position="bottom right")
    image = shapes.render(scene, random.Random(0))
    pixels = image.load()
    red = [(x, y) for x in range(64) for y in range(64) if pixels[x, y][0] > 180 and pixels[x, y][1] < 90]
    assert len(red) > 3 * 40  # three large squares' worth of red pixels
    assert all(x >= 28 and y >= 28 for x, y in red)  # all in the bottom-right region


# ---------------------------------------------------------------------------- errors


def test_prepare_rejects_bad_arguments(tmp_path: Path):
    with pytest.raises(UserError, match="unknown built-in dataset 'mnist'"):
        prepare("mnist", tmp_path)
    with pytest.raises(UserError, match="--num must be positive"):
        prepare("shapes", tmp_path, num=0)
    with pytest.raises(UserError, match="at least 2"):
        prepare("shapes", tmp_path, num=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        prepare("shapes", tmp_path / "file", num=5)


def test_missing_debian_package_says_what_to_install(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(fashion_mnist, "ROOT", str(tmp_path / "absent"))
    monkeypatch.setattr(debian, "_can_install", lambda: False)
    with pytest.raises(UserError, match="sudo apt-get install dataset-fashion-mnist"):
        prepare("fashion-mnist", tmp_path / "out", num=5)
    assert not (tmp_path / "out" / "train.jsonl").exists()


def test_failed_apt_get_is_a_user_error(tmp_path: Path, monkeypatch):
    calls = []
    monkeypatch.setattr(debian, "_can_install", lambda: True)
    monkeypatch.setattr(debian.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or _Done(100))
    with pytest.raises(UserError, match="apt-get could not install.*openclipart-png"):
        debian.ensure_debian_packages({"openclipart-png": str(tmp_path / "absent")})
    assert calls[0][:2] == ["apt-get", "install"] and "openclipart-png" in calls[0]


class _Done:
    def __init__(self, returncode: int):
        self.returncode = returncode


# ---------------------------------------------------------------------------- split


def test_hash_split_is_deterministic_and_about_ten_percent():
    names = [f"file_{i}.png" for i in range(20000)]
    splits = [split_of(n) for n in names]
    assert splits == [split_of(n) for n in names]
    assert 0.09 < splits.count("val") / len(names) < 0.11
    assert split_of("anything", 0.0) == "train" and split_of("anything", 1.0) == "val"
    with pytest.raises(ValueError):
        split_of("x", 1.5)


# ---------------------------------------------------------------------------- fashion-mnist


@pytest.mark.skipif(not HAS_FASHION_MNIST, reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_idx_files_and_prepare(tmp_path: Path):
    labels = fashion_mnist.read_idx(os.path.join(fashion_mnist.ROOT, "t10k-labels-idx1-ubyte.gz"))
    images = fashion_mnist.read_idx(os.path.join(fashion_mnist.ROOT, "t10k-images-idx3-ubyte.gz"))
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    assert sorted(Counter(labels.tolist()).values()) == [1000] * 10
    summary = prepare("fashion-mnist", tmp_path / "a", num=14, seed=2)
    assert (summary["train"], summary["val"]) == (12, 2)
    val = _rows(tmp_path / "a" / "val.jsonl")
    for i, row in enumerate(val):
        assert row["label"] == fashion_mnist.CLASSES[labels[i]]
        noun = fashion_mnist.NOUNS[labels[i]]
        assert len(row["captions"]) == 3 and all(noun in c for c in row["captions"])
        with Image.open(tmp_path / "a" / row["image"]) as image:
            assert image.mode == "L"
            assert list(image.getdata()) == images[i].ravel().tolist()
    prepare("fashion-mnist", tmp_path / "b", num=14, seed=2)
    assert _bytes_of(tmp_path / "a") == _bytes_of(tmp_path / "b")
