"""``index build --embeddings EMB --bytes B --val-embeddings VAL``: the codes chosen on the validation split."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from triclip.compact.features import CompactTransform
from triclip.core.errors import UserError
from triclip.data import load_pairs
from triclip.index.sources import IndexBuildConfig, build_index
from triclip.index.store import read_manifest as read_index_manifest
from triclip.index.val_embeddings import sign_change, validation_set
from triclip.model.embed import embed_pairs
from triclip.model.run import load_run
from triclip.model.shards import EmbedConfig, embed_to_shards, read_manifest


@pytest.fixture(scope="module")
def embedded(run_dir, shapes_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The train split and the val split of the shapes data, each embedded by ``triclip embed`` with one run."""
    root = tmp_path_factory.mktemp("val-emb")
    for split in ("train", "val"):
        embed_to_shards(EmbedConfig(run=str(run_dir), data=str(shapes_dir / f"{split}.jsonl"), out=str(root / split),
                                    shard_size=25))
    return root / "train", root / "val"


def test_val_vectors_are_the_val_split_in_the_shards_space(embedded, run_dir, shapes_dir):
    """The evaluation set's images and captions equal the val split embedded by the run and mapped through the
    *shards'* transform: the sign fix each embed anchors on its own first images is undone."""
    train, val = embedded
    manifest = read_manifest(train)
    evaluation = validation_set(str(val), manifest)
    model, _ = load_run(str(run_dir), torch.device("cpu"))
    pairs = load_pairs(str(shapes_dir / "val.jsonl"))
    out = embed_pairs(model, pairs, torch.device("cpu"), 16)
    transform = CompactTransform.from_dict(manifest["transform"])
    np.testing.assert_allclose(evaluation.gallery, transform(out.image).numpy(), rtol=0, atol=1e-5)
    first: dict[str, int] = {}  # each distinct caption's first vector, as EvalSet.of keeps
    texts = [pairs.records[int(r)].captions[c] for r, c in zip(out.text_to_image.tolist(), _caption_numbers(out))]
    for t, caption in enumerate(texts):
        first.setdefault(caption, t)
    np.testing.assert_allclose(evaluation.queries, transform(out.text).numpy()[list(first.values())], rtol=0, atol=1e-5)
    assert evaluation.split == "validation" and evaluation.data == str(val.absolute())


def test_another_sign_fix_is_undone(embedded, tmp_path):
    """VAL embedded with other signs (its own anchors) gives the same evaluation set: flip half the dimensions of a
    copy's vectors and of its transform's signs, as an embed anchored on other images would have written it."""
    train, val = embedded
    flipped = tmp_path / "flipped"
    shutil.copytree(val, flipped)
    dim = read_manifest(val)["dim"]
    signs = np.where(np.arange(dim) % 2 == 0, -1.0, 1.0)  # (D,)
    path = flipped / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["transform"]["signs"] = (signs * np.asarray(manifest["transform"]["signs"] or np.ones(dim))).tolist()
    path.write_text(json.dumps(manifest))
    for name in ("image.npy", "text.npy"):
        for file in flipped.glob(f"shard-*/{name}"):
            np.save(file, (np.load(file) * signs).astype(np.float32))  # same shape and dtype: same size
    assert (sign_change(manifest["transform"], read_manifest(train)["transform"]) == signs).all()
    a, b = validation_set(str(val), read_manifest(train)), validation_set(str(flipped), read_manifest(train))
    np.testing.assert_allclose(a.gallery, b.gallery, rtol=0, atol=1e-6)
    np.testing.assert_allclose(a.queries, b.queries, rtol=0, atol=1e-6)
    assert a.positives == b.positives
    other = dict(manifest["transform"], weights=[1.0] * dim)
    with pytest.raises(UserError, match="another compact transform"):
        sign_change(other, read_manifest(train)["transform"])


def _caption_numbers(out) -> list[int]:
    """The caption number of each caption vector within its image (they come image by image)."""
    owners, numbers = out.text_to_image.tolist(), []
    for t, owner in enumerate(owners):
        numbers.append(numbers[-1] + 1 if t and owners[t - 1] == owner else 0)
    return numbers


def test_build_from_embeddings_chooses_codes_as_the_model_path_does_on_val(embedded, run_dir, shapes_dir, tmp_path,
                                                                         given_latency):
    """--embeddings + --val-embeddings measures every candidate on the val split as --run --data --val-data does:
    the same choice and the same recorded recall; without it the shards' own images are the exam."""
    train, val = embedded
    common = dict(dims=[8], bytes=[4, 8])
    from_emb, direct, own = tmp_path / "from_emb", tmp_path / "direct", tmp_path / "own"
    build_index(IndexBuildConfig(embeddings=str(train), val_embeddings=str(val), out=str(from_emb), **common))
    build_index(IndexBuildConfig(run=str(run_dir), data=str(shapes_dir / "train.jsonl"),
                                 val_data=str(shapes_dir / "val.jsonl"), out=str(direct), **common))
    build_index(IndexBuildConfig(embeddings=str(train), out=str(own), **common))
    a, b, c = (read_index_manifest(f)["budgets"] for f in (from_emb, direct, own))
    for budget in ("4", "8"):
        assert a[budget]["split"] == b[budget]["split"] == "validation" and c[budget]["split"] == "indexed"
        assert a[budget]["spec"] == b[budget]["spec"]
        assert a[budget]["recall"] == pytest.approx(b[budget]["recall"], abs=1e-6)
        assert a[budget]["full_recall"] == pytest.approx(b[budget]["full_recall"], abs=1e-6)
        assert a[budget]["text"]["recall"] == pytest.approx(b[budget]["text"]["recall"], abs=1e-6)
    assert any(a[k]["full_recall"] != pytest.approx(c[k]["full_recall"], abs=1e-6) for k in ("4", "8"))


def test_bad_val_embeddings_are_one_line(embedded, run_dir, other_run_dir, shapes_dir, tmp_path):
    train, val = embedded
    other = tmp_path / "other"
    embed_to_shards(EmbedConfig(run=str(other_run_dir), data=str(shapes_dir / "val.jsonl"), out=str(other)))
    with pytest.raises(UserError, match="fingerprints differ"):
        validation_set(str(other), read_manifest(train))
    no_text = tmp_path / "no-text"
    embed_to_shards(EmbedConfig(run=str(run_dir), data=str(shapes_dir / "val.jsonl"), out=str(no_text), text=False))
    with pytest.raises(UserError, match="no caption vectors"):
        validation_set(str(no_text), read_manifest(train))
    with pytest.raises(UserError, match="--embeddings and --bytes"):
        build_index(IndexBuildConfig(embeddings=str(train), val_embeddings=str(val), out=str(tmp_path / "i1")))
    with pytest.raises(UserError, match="--embeddings and --bytes"):
        build_index(IndexBuildConfig(run="r", data="d", val_embeddings=str(val), bytes=[8], out=str(tmp_path / "i2")))
